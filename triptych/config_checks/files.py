"""Checks of the files the flags name, as the process starts (not where the flags are written: the
operator builds flags for files a pod mounts later)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from triptych import private_files
from triptych.config import (
    URL_FLAGS,
    ConfigError,
    ServeArgs,
    parse_urls,
)
from triptych.env_secrets import secret_file_variables
from triptych.serve_help import flag


def check_listed_files(args: ServeArgs) -> None:
    """A file:// worker or head list and --lora-catalog may be missing at start-up (a ConfigMap mounted
    later), but a folder there is never a list: the lists would stay empty without a word."""
    named = [(flag(URL_FLAGS[role]), url) for role in URL_FLAGS for url in args.urls_for(role)]
    if args.disagg_server_addr:
        named += [("--disagg-server-addr", spec) for spec in parse_urls(args.disagg_server_addr)]
    paths = [(name, url.removeprefix("file://")) for name, url in named if url.startswith("file://")]
    if args.lora_catalog:
        paths.append(("--lora-catalog", args.lora_catalog))
    for name, path in paths:
        if os.path.isdir(path):
            raise ConfigError(f"{name} {path} is a folder; give the file in it that lists one entry per line")


def check_tls_files(args: ServeArgs) -> None:
    """--ssl-certfile and --ssl-keyfile: readable, and a certificate the key belongs to."""
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        return
    import ssl

    for name, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"{name} {path}: {exc.strerror or exc}") from None
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(
            f"--ssl-certfile {args.ssl_certfile} and --ssl-keyfile {args.ssl_keyfile} do not load as a PEM "
            f"certificate and its private key ({exc}); an encrypted key is not supported"
        ) from None


def check_pool_fits_memory(args: ServeArgs) -> None:
    """--disagg-transfer-pool-size: no more than this host's memory, which the worker would fail to
    allocate only after its model loaded."""
    if not args.disagg_role.is_worker or args.disagg_full_pipeline:  # a full-pipeline worker has no pool
        return
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host that says
        return
    if 0 < memory < args.disagg_transfer_pool_size:
        raise ConfigError(
            f"--disagg-transfer-pool-size {args.disagg_transfer_pool_size} is more than this host's memory "
            f"({memory} bytes); use e.g. 256MiB"
        )


def secret_file_warnings(args: ServeArgs, environ: Mapping[str, str] | None = None) -> list[str]:
    """The secret files that every user of the host may read (triptych.private_files): the HTTP side's
    flags', and those the environment names (the hub token's, the S3 credentials': triptych.env_secrets)."""
    env = os.environ if environ is None else environ
    named = [
        ("--api-keys-file", args.api_keys_file),
        ("--webhook-secret-file", args.webhook_secret_file),
        ("--ssl-keyfile", args.ssl_keyfile),
        *((variable, env.get(variable)) for variable in secret_file_variables()),
    ]
    return [problem for name, path in named if path and (problem := private_files.problem(path, name)) is not None]
