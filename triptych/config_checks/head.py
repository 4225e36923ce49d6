"""What only the head serves: the model's name, where results and traces go, the HTTP API's limits,
keys, TLS and webhooks."""

from __future__ import annotations

from urllib.parse import urlsplit

from triptych.config import (
    MAX_PRESIGN_S,
    S3_BUCKET,
    ConfigError,
    ServeArgs,
)
from triptych.config_checks.addresses import http_endpoint
from triptych.serve_help import flag


def check_served_model_name(args: ServeArgs) -> None:
    if args.served_model_name is None:
        return
    if args.disagg_role.is_worker:
        raise ConfigError(f"--served-model-name is for the head (server or monolithic), not {args.disagg_role.value}")
    if not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty: give the id clients send as `model`")


def check_output_path(args: ServeArgs) -> None:
    if not args.output_path.strip():
        raise ConfigError("--output-path is empty: give the folder the head keeps URL images and videos in")


def check_results_store(args: ServeArgs) -> None:
    given = [f for f in ("results_store", "results_s3_endpoint", "results_presign") if getattr(args, f)]
    if given and args.disagg_role.is_worker:
        raise ConfigError(f"{flag(given[0])} is for the head (server or monolithic), not {args.disagg_role}")
    if args.results_store is not None:
        not_s3 = ConfigError(
            f"--results-store {args.results_store!r} is not s3://BUCKET/PREFIX (for a shared folder, "
            "mount it and give --output-path instead)"
        )
        try:
            parts = urlsplit(args.results_store)
        except ValueError:  # an unclosed or bad [IPv6] host: 's3://[x/p'
            raise not_s3 from None
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise not_s3
        if not S3_BUCKET.fullmatch(parts.netloc):
            raise ConfigError(
                f"--results-store {args.results_store!r}: {parts.netloc!r} is not an S3 bucket name "
                "(3-63 lowercase letters, digits, dots and hyphens)"
            )
    elif args.results_s3_endpoint or args.results_presign:
        which = "--results-s3-endpoint" if args.results_s3_endpoint else "--results-presign"
        raise ConfigError(f"{which} only applies with --results-store s3://BUCKET/PREFIX")
    if args.results_s3_endpoint is not None:
        parts_or_none = http_endpoint(args.results_s3_endpoint)
        if parts_or_none is None or parts_or_none.path.strip("/") or parts_or_none.query:
            raise ConfigError(
                f"--results-s3-endpoint {args.results_s3_endpoint!r} is not http(s)://HOST[:PORT] "
                "(the bucket goes in --results-store)"
            )
    if not 0 <= args.results_presign <= MAX_PRESIGN_S:
        raise ConfigError(
            f"--results-presign {args.results_presign} must be between 0 (the head proxies content) and "
            f"{MAX_PRESIGN_S} seconds (S3's longest)"
        )


def check_otlp_endpoint(args: ServeArgs) -> None:
    if args.otlp_endpoint and http_endpoint(args.otlp_endpoint) is None:
        raise ConfigError(
            f"--otlp-endpoint {args.otlp_endpoint!r} is not http(s)://HOST:PORT, an OTLP/HTTP collector "
            "(traces go to its /v1/traces)"
        )


def both_or_neither(args: ServeArgs, first: str, second: str, why: str) -> None:
    """Two flags (ServeArgs fields) given together or not at all: one alone is refused, naming the other."""
    if (getattr(args, first) is None) != (getattr(args, second) is None):
        given, missing = (first, second) if getattr(args, second) is None else (second, first)
        raise ConfigError(f"{flag(given)} needs {flag(missing)} too ({why})")


def check_webhook(args: ServeArgs) -> None:
    """--webhook-url and --webhook-secret-file come together (an unsigned event could be anyone's), the
    URL an absolute http(s) one. The secret's form is checked where it is read (triptych_head.webhooks)."""
    both_or_neither(args, "webhook_url", "webhook_secret_file", "webhooks are always signed")
    if args.webhook_url is not None:
        try:
            parts = urlsplit(args.webhook_url)
            usable = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:  # e.g. an unclosed [ of an IPv6 address
            usable = False
        if not usable:
            raise ConfigError(
                f"--webhook-url {args.webhook_url!r} is not an http(s) URL; give e.g. https://hooks.example.com/triptych"
            )


def check_http_limits(args: ServeArgs) -> None:
    head_only = [
        f
        for f in ("api_keys_file", "max_queued_requests", "webhook_url", "webhook_secret_file")
        if getattr(args, f) is not None
    ]
    if head_only and args.disagg_role.is_worker:
        raise ConfigError(f"{flag(head_only[0])} is for the head (server or monolithic), not {args.disagg_role}")
    if args.api_keys_file is not None and not args.api_keys_file.strip():  # the API would be open, unasked
        raise ConfigError(
            "--api-keys-file is empty: give the file of API keys (one per line), or leave the flag out for an "
            "API without keys"
        )
    if args.max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} is below 1KiB; use e.g. 16MiB")
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ConfigError(f"--max-queued-requests {args.max_queued_requests} must be >= 0")
    check_webhook(args)
    both_or_neither(args, "ssl_certfile", "ssl_keyfile", "the certificate and its private key, PEM files")
