"""`triptych-metrics-api`: the custom metrics API server for DiffusionPipeline autoscaling.

    triptych-metrics-api --tls-cert-file tls.crt --tls-private-key-file tls.key [--secure-port 6443]

Runs in-cluster with its service account, or with $KUBECONFIG / --kubeconfig elsewhere. It must
be registered as the APIService v1beta2.custom.metrics.k8s.io (the Helm chart does this). The serving
pair is reloaded when its files change (triptych/tls_reload.py), as a renewed Secret's are.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from triptych import log_format
from triptych.log_format import FORMATS as LOG_FORMATS
from triptych.tls_reload import RECHECK_S as TLS_RECHECK_S
from triptych.tls_reload import CertificateReloader
from triptych_operator.metrics_api.auth import AuthConfigError, Authorizer, kube_review, read_request_header_config
from triptych_operator.metrics_api.server import build_app
from triptych_operator.metrics_api.source import (
    DEFAULT_CACHE_SECONDS,
    DEFAULT_SCRAPE_TIMEOUT_S,
    HeadMetricsSource,
    KubePipelineReader,
    heads_tls,
    http_fetcher,
)

DEFAULT_PORT = 6443
log = logging.getLogger("triptych_operator.metrics_api")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triptych-metrics-api", description=__doc__.splitlines()[0])
    parser.add_argument("--bind-address", default="0.0.0.0", help="address to serve HTTPS on (default 0.0.0.0)")
    parser.add_argument("--secure-port", type=int, default=DEFAULT_PORT, help=f"HTTPS port (default {DEFAULT_PORT})")
    parser.add_argument("--tls-cert-file", required=True, help="serving certificate (PEM), valid for the Service name")
    parser.add_argument("--tls-private-key-file", required=True, help="its private key (PEM)")
    parser.add_argument(
        "--cache-seconds",
        type=float,
        default=DEFAULT_CACHE_SECONDS,
        help=f"reuse a pipeline's scrape this long (default {DEFAULT_CACHE_SECONDS})",
    )
    parser.add_argument(
        "--scrape-timeout",
        type=float,
        default=DEFAULT_SCRAPE_TIMEOUT_S,
        help=f"seconds to wait for a head's /metrics (default {DEFAULT_SCRAPE_TIMEOUT_S})",
    )
    parser.add_argument(
        "--head-ca-file",
        default=None,
        help="PEM CA that signs the certificates of heads serving HTTPS (spec.head.tls); each must name "
        "<pipeline>-head.<namespace>.svc. Unset: HTTPS heads are scraped without verifying them",
    )
    parser.add_argument("--kubeconfig", default=None, help="default: in-cluster service account, else $KUBECONFIG")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format", choices=LOG_FORMATS, default=LOG_FORMATS[0], help="text, or json: an object per line"
    )
    return parser


def api_client(kubeconfig: str | None) -> Any:
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"))


def server_tls(cert_file: str, key_file: str, client_ca_pem: str) -> tuple[ssl.SSLContext, CertificateReloader]:
    """TLS that asks for (but does not require) a client certificate, trusting only the requestheader CA,
    and the reloader that keeps it serving the pair on disk (run it: `reloader.run(every_s)`).

    The serving pair must be reloaded: a Secret the chart did not make (metricsApi.tls.secretName,
    cert-manager's) is renewed under the running pod, and nothing restarts it; the old certificate
    expiring would leave the kube-apiserver unable to verify the APIService, and every HPA blind.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # The files are stamped before they are loaded: a renewal landing in between is loaded at the first check.
    reloader = CertificateReloader(ctx, cert_file, key_file)
    ctx.load_cert_chain(cert_file, key_file)
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.load_verify_locations(cadata=client_ca_pem)
    return ctx, reloader


async def serve(args: argparse.Namespace, *, tls_recheck_s: float = TLS_RECHECK_S) -> None:
    """Serve until SIGTERM/SIGINT (or cancelled); the serving pair is looked at every `tls_recheck_s`."""
    kube = api_client(args.kubeconfig)
    auth_config = await asyncio.to_thread(read_request_header_config, kube)
    tls, reloader = server_tls(args.tls_cert_file, args.tls_private_key_file, auth_config.client_ca_pem)
    heads = heads_tls(args.head_ca_file)
    if heads is None:
        log.info("--head-ca-file unset: heads serving HTTPS are scraped without verifying their certificates")
    async with aiohttp.ClientSession() as session:
        fetch = http_fetcher(session, args.scrape_timeout, heads)
        source = HeadMetricsSource(KubePipelineReader(kube), fetch, cache_seconds=args.cache_seconds)
        app = build_app(source, Authorizer(kube_review(kube)), auth_config)
        runner = web.AppRunner(app, access_log=log if args.verbose else None)
        await runner.setup()
        await web.TCPSite(runner, args.bind_address, args.secure_port, ssl_context=tls).start()
        log.info("serving custom.metrics.k8s.io on https://%s:%d", args.bind_address, args.secure_port)
        reloading = asyncio.create_task(reloader.run(tls_recheck_s))
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            reloading.cancel()
            await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `triptych-metrics-api` console script."""
    args = build_parser().parse_args(argv)
    log_format.configure("debug" if args.verbose else "info", args.log_format, "metrics-api")
    try:
        asyncio.run(serve(args))
    except AuthConfigError as exc:
        print(f"triptych-metrics-api: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
