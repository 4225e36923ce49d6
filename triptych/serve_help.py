"""How `triptych serve --help` reads: the flags grouped by who uses them, every default shown.

The flags themselves stay declared in one place (serve_flags.add_serve_flags); this only says which
group each one is listed under. A flag not named here is listed under "model and process".
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from triptych.roles import ROLE_SPECS, WORKER_ROLES


def flag(attr: str) -> str:
    """The command-line flag of a ServeArgs attribute (disagg_p2p_hostname -> --disagg-p2p-hostname)."""
    return "--" + attr.replace("_", "-")


GENERAL = "model and process"
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    GENERAL: ("every process", ("--model-path", "--disagg-role", "--device", "--dtype", "--log-level", "--log-format")),
    "head": (
        "the GPU-less head (--disagg-role server) and, for the HTTP ones, monolithic mode",
        (
            "--scheduler-port",
            *(flag(role.url_attr) for role in WORKER_ROLES),
            "--host",
            "--port",
            "--disagg-timeout",
            "--disagg-dispatch-policy",
            "--disagg-heartbeat-timeout",
            "--disagg-discovery-interval",
            "--disagg-max-retries",
            "--disagg-no-instance-wait",
            "--disagg-migration",
            "--disagg-preemption",
            "--disagg-priority-aging",
            "--output-path",
            "--results-max-age",
            "--results-max-bytes",
            "--results-store",
            "--results-s3-endpoint",
            "--results-presign",
            "--api-keys-file",
            "--max-request-bytes",
            "--access-log",
            "--webhook-url",
            "--webhook-secret-file",
            "--max-queued-requests",
            "--ssl-certfile",
            "--ssl-keyfile",
            "--disagg-drain-timeout",
        ),
    ),
    "batching": (
        "the head groups compatible requests, each worker runs a group as one batched forward",
        (
            "--batching-mode",
            "--batching-max-size",
            "--batching-delay-ms",
            "--batching-role-delay-ms",
            "--enable-batching-metrics",
        ),
    ),
    "worker": (
        "encoder, denoiser and decoder processes",
        (
            "--disagg-server-addr",
            "--disagg-full-pipeline",
            "--encoder-cache-bytes",
            "--worker-capacity",
            "--simulate",
            "--simulate-seconds",
            "--simulate-seconds-per-unit",
            "--reference-url-networks",
        ),
    ),
    "parallelism": (
        "GPUs per process and how a role splits its work over them",
        (
            "--num-gpus",
            "--base-gpu-id",
            "--master-port",
            "--tp-size",
            "--sp-degree",
            "--cfg-parallel-size",
            *(flag(attr) for spec in ROLE_SPECS.values() for attr in spec.parallel_flags.values()),
        ),
    ),
    "transfer": (
        "worker-to-worker tensors (Mooncake)",
        (
            "--disagg-p2p-hostname",
            "--disagg-ib-device",
            "--disagg-transfer-pool-size",
            "--disagg-transfer-listen-any",
            "--disagg-load-ahead",
        ),
    ),
    "control plane security": (
        "head and workers",
        ("--disagg-keys-dir", "--disagg-insecure"),
    ),
    "lora": (
        "LoRA adapters: the head checks the names requests give, denoisers and prompt encoders load and apply them "
        "(docs/serving.md)",
        ("--lora", "--lora-catalog", "--lora-cache-bytes"),
    ),
    "tracing": ("head and workers: OpenTelemetry traces of requests (docs/serving.md)", ("--otlp-endpoint",)),
}
GROUP_OF = {flag: title for title, (_, flags) in GROUPS.items() for flag in flags}


def default_note(default: Any) -> str:
    """The default as help shows it (argparse fills in %(default)s)."""
    if default is None or default == [] or default == "":
        return "default: none"
    if default is False:
        return "default: off"
    return "default: %(default)s"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends every optional flag's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default is argparse.SUPPRESS or "default" in text:
            return text
        return f"{text} ({default_note(action.default)})"


def grouped_adder(parser: argparse.ArgumentParser) -> Callable[..., argparse.Action]:
    """An add_argument that files each flag under its group in `parser`'s help."""
    parser.formatter_class = DefaultsHelpFormatter
    groups = {title: parser.add_argument_group(title, description) for title, (description, _) in GROUPS.items()}

    def add(*names: str, **kwargs: Any) -> argparse.Action:
        if not kwargs.get("help") and not kwargs.get("required"):  # argparse shows nothing for a flag without help
            kwargs["help"] = default_note(kwargs.get("default"))
        return groups[GROUP_OF.get(names[0], GENERAL)].add_argument(*names, **kwargs)

    return add
