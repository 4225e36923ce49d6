"""The `triptych serve` flags the operator sets in each pod, and where each comes from.

A pod's argv is the operator's flags, then extraArgs, and argparse keeps the last value: a flag given
again in extraArgs would silently replace the operator's while the rest of what the operator made
(Services, ports, probes, GPU limits, the head's worker URLs) still follows the spec. extraArgs may
therefore not change one of these flags; the refusal names the field that sets it instead.

Each table maps a ServeArgs attribute to its source: a CR field (`spec....`, with `{pool}` for the
pool's own `spec.<role>` or `spec.fullPipeline`), or why the operator alone chooses it.
"""

from __future__ import annotations

from triptych.config import ROLE_PARALLEL_FLAGS, URL_FLAGS, flag
from triptych.roles import Role

MODEL = "spec.model.path or spec.model.hubId"
KEYS = "it creates the pipeline's control-plane keys and mounts them there"

WORKER_SOURCES: dict[str, str] = {
    "model_path": MODEL,
    "disagg_role": "a pool's role is the field it is declared in (spec.encoder, spec.denoiser, ...)",
    "disagg_server_addr": "workers find the heads through their headless Service",
    "scheduler_port": "the heads discover workers, and the probes check them, on this port",
    "num_gpus": "{pool}.gpusPerReplica",
    "base_gpu_id": "{pool}.gpusPerReplica",  # the pod sees only the GPUs it was given, from 0
    "device": "{pool}.gpusPerReplica",
    "disagg_p2p_hostname": "peers reach a worker at its pod IP",
    "disagg_ib_device": "spec.transfer.ibDevice",
    "disagg_transfer_pool_size": "spec.transfer.poolSize",
    "master_port": "a pod's ranks meet on this port",
    "dtype": "{pool}.dtype",
    "disagg_drain_timeout": "{pool}.drainSeconds",
    "disagg_keys_dir": KEYS,
    "batching_max_size": "{pool}.batching.maxSize",
    "disagg_full_pipeline": "spec.fullPipeline",
    "otlp_endpoint": "spec.tracing.otlpEndpoint",
    "log_format": "spec.logging.format",
    "lora_catalog": "spec.model.loras",
    # Unset degrees are derived by the worker as the operator derived them, so every degree is the spec's.
    "tp_size": "{pool}.parallelism.tp",
    "sp_degree": "{pool}.parallelism.sp",
    "cfg_parallel_size": "{pool}.parallelism.cfg",
}

HEAD_SOURCES: dict[str, str] = {
    "model_path": MODEL,
    "disagg_role": "the head runs --disagg-role server",
    "scheduler_port": "workers report to this port through the heads' headless Service",
    "host": "the head listens on every address of its pod",
    "port": "spec.head.port",
    "disagg_timeout": "spec.head.timeoutSeconds",
    "disagg_dispatch_policy": "spec.head.dispatchPolicy",
    "disagg_priority_aging": "spec.head.priority.agingSeconds",
    "disagg_preemption": "spec.head.priority.preemption",
    "output_path": "spec.head.results",
    "disagg_drain_timeout": "spec.head.drainSeconds",
    "results_max_age": "spec.head.results.maxAgeSeconds",
    "results_max_bytes": "spec.head.results.maxBytes",
    "results_store": "spec.head.results.s3.url",
    "results_s3_endpoint": "spec.head.results.s3.endpoint",
    "results_presign": "spec.head.results.s3.presignSeconds",
    "api_keys_file": "spec.head.apiKeysSecret",
    "webhook_url": "spec.head.webhook.url",
    "webhook_secret_file": "spec.head.webhook.secret",
    "ssl_certfile": "spec.head.tls.secretName",
    "ssl_keyfile": "spec.head.tls.secretName",
    "disagg_keys_dir": KEYS,
    "otlp_endpoint": "spec.tracing.otlpEndpoint",
    "log_format": "spec.logging.format",
    "lora_catalog": "spec.model.loras",
    "batching_mode": "spec.<role>.batching.maxSize",
    "batching_max_size": "spec.<role>.batching.maxSize",
    "enable_batching_metrics": "spec.<role>.batching.maxSize",
    "batching_delay_ms": "spec.head.batching.delayMs",
    "batching_role_delay_ms": "spec.<role>.batching.delayMs",
    # Not --disagg-no-instance-wait: docs/autoscaling.md lets extraArgs set it below the operator's.
    **{attr: "the head finds the worker pools through their Services" for attr in URL_FLAGS.values()},
}


def worker_sources(role: Role, pool: str) -> dict[str, str]:
    """What sets each flag of a worker of `role` in the pool at `pool` (spec.<role> or spec.fullPipeline)."""
    own = {attr: f"{{pool}}.parallelism.{degree}" for degree, attr in ROLE_PARALLEL_FLAGS.get(role, {}).items()}
    return {attr: source.format(pool=pool) for attr, source in {**WORKER_SOURCES, **own}.items()}


def refusal(attr: str, source: str) -> str:
    """Why extraArgs may not set `attr`, and what to do instead."""
    if source.startswith("spec."):
        return f"{flag(attr)} is set by the operator from {source}; set that field instead of the flag"
    return f"{flag(attr)} is the operator's: {source}; remove it from extraArgs"
