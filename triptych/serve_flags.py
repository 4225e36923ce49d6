"""The `triptych serve` command line: every flag, its help and its default (from ServeArgs).

One place declares the flags; `--help` groups them by who uses them (serve_help.py), ServeArgs
(config.py) holds and validates the values, and flag_roles.py says which roles take each one.
"""

from __future__ import annotations

import argparse

from triptych.config import (
    BATCHING_MODES,
    DEVICES,
    DISPATCH_POLICIES,
    DTYPES,
    ROLE_PARALLEL_ATTRS,
    SIMULATE_DEFAULTS,
    URL_FLAGS,
    ServeArgs,
    parse_bind_address,
    parse_size,
    parse_urls,
)
from triptych.liveness import HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_TIMEOUT_S
from triptych.log_format import FORMATS
from triptych.ports import DEFAULT_MASTER_PORT_OFFSET
from triptych.roles import Role
from triptych.serve_help import flag, grouped_adder


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Register every `triptych serve` flag; defaults come from ServeArgs."""
    d = ServeArgs(model_path="")
    a = grouped_adder(parser)  # --help lists them by who uses them (serve_help.py)
    a("--model-path", required=True, help="diffusers-format model directory (same package on every process)")
    a("--served-model-name", default=None,
      help="head/monolithic: the model id requests name and /v1/models lists first; the --model-path as "
           "given, its hub id and its folder's name are accepted too")  # fmt: skip
    roles = "{" + ",".join(r.value for r in Role) + "}"
    a("--disagg-role", type=Role, choices=list(Role), default=d.disagg_role, metavar=roles,
      help="what this process runs (default: monolithic)")  # fmt: skip
    a(
        "--disagg-server-addr",
        default=None,
        help="workers: the head's tcp://HOST:SCHEDULER_PORT; replicated heads: ';'-separated, "
        "dns://NAME:SCHEDULER_PORT (a headless Service) or file:///PATH, served all at once",
    )
    a("--scheduler-port", type=int, default=d.scheduler_port,
      help="head: frontend port (results at +1..+5); worker: port its work socket binds")  # fmt: skip
    a("--num-gpus", type=int, default=d.num_gpus)
    a("--base-gpu-id", type=int, default=d.base_gpu_id)
    for role, attr in URL_FLAGS.items():
        a(
            flag(attr),
            type=parse_urls,
            default=[],
            help=f"head: {role.value} endpoints, ';'-separated: tcp://HOST:PORT dns://NAME:PORT file:///PATH",
        )
    a("--host", type=parse_bind_address, default=d.host,
      help="head: HTTP and result-socket bind address; workers on other hosts report to the result sockets, "
           "so give an address they reach (or 0.0.0.0, with --disagg-keys-dir)")  # fmt: skip
    a("--port", type=int, default=d.port, help="head/monolithic: HTTP port")
    a(
        "--disagg-p2p-hostname",
        type=parse_bind_address,
        default=d.disagg_p2p_hostname,
        help="worker: address peers reach it on (pod IP)",
    )
    a("--disagg-ib-device", default=None, help="worker: RDMA device (e.g. mlx5_0); TCP transport when unset")
    a("--disagg-transfer-pool-size", type=parse_size, default=d.disagg_transfer_pool_size,
      help="worker: registered transfer pool, bytes or 256MiB/1GiB (default 256MiB)")  # fmt: skip
    a("--disagg-transfer-listen-any", action="store_true",
      help="worker: let Mooncake's handshake and data ports listen on every address of the host (its own "
           "behaviour), not only --disagg-p2p-hostname; whoever reaches them can read and write the pool")  # fmt: skip
    a("--disagg-load-ahead", type=int, default=d.disagg_load_ahead,
      help="image_encoder, denoiser, decoder: copy the inputs of up to N next batches out of their receive slots while "
           "the current one computes, on a thread (and CUDA stream) of their own (default 1; 0: the "
           "computing thread copies its own)")  # fmt: skip
    a("--disagg-full-pipeline", action="store_true",
      help="denoiser: load and run the whole pipeline (encode, denoise, decode) and return pixels to a "
           "head started with only --denoiser-urls; no tensor moves between workers: no Mooncake engine")  # fmt: skip
    a("--encoder-cache-bytes", type=parse_size, default=d.encoder_cache_bytes,
      help="encoder, prompt_encoder, full-pipeline denoiser: bytes of prompt embeddings kept for repeated "
           "prompts, least recently used dropped first (default 256MiB; 0: no cache)")  # fmt: skip
    a("--disagg-timeout", type=float, default=d.disagg_timeout, help="head: seconds before a request times out")
    a("--disagg-dispatch-policy", choices=DISPATCH_POLICIES, default=d.disagg_dispatch_policy)
    a("--disagg-heartbeat-timeout", type=float, default=d.disagg_heartbeat_timeout,
      help="head: seconds without a heartbeat before a worker counts as gone and its requests are retried; "
           f"at least {MIN_HEARTBEAT_TIMEOUT_S:g} (twice the workers' {HEARTBEAT_INTERVAL_S:g} s heartbeat interval); "
           "worker: seconds without a ping before it releases a head's work")  # fmt: skip
    a("--disagg-discovery-interval", type=float, default=d.disagg_discovery_interval,
      help="head: seconds between re-reads of dns:// and file:// worker lists (default 5)")  # fmt: skip
    a("--disagg-max-retries", type=int, default=d.disagg_max_retries,
      help="head: times a request is restarted on other instances after losing a worker (default 2)")  # fmt: skip
    a("--disagg-no-instance-wait", type=float, default=d.disagg_no_instance_wait,
      help="head: seconds a request waits while its role has no ready instance, then fails (default 120)")  # fmt: skip
    a("--disagg-migration", choices=("on", "off"), default=d.disagg_migration,
      help="head: move a draining denoiser's running requests to denoisers with room at their next step, so a "
           "drain takes about one step and a transfer (default on); off: they finish where they are")  # fmt: skip
    a("--disagg-preemption", choices=("on", "off"), default=d.disagg_preemption,
      help="head: when every denoiser is busy, suspend the lowest-priority running denoise at its next step for a "
           "waiting request of higher priority, and resume it later on any denoiser (default on)")  # fmt: skip
    a("--disagg-priority-aging", type=float, default=d.disagg_priority_aging,
      help="head: seconds of waiting that raise a request's priority by one level, so that no request "
           "waits forever behind higher ones (default 30)")  # fmt: skip
    a("--master-port", type=int, default=None,
      help="worker: the port on loopback where a multi-GPU worker's ranks meet (torch.distributed) "
           f"(default: its --scheduler-port + {DEFAULT_MASTER_PORT_OFFSET})")  # fmt: skip
    a("--output-path", default=d.output_path,
      help="head/monolithic: where finished images (URL responses) and video jobs are kept; mount a "
           "persistent volume here for them to survive a restart")  # fmt: skip
    a("--results-max-age", type=float, default=d.results_max_age,
      help="head: seconds a finished result is kept under --output-path (default one day)")  # fmt: skip
    a("--results-max-bytes", type=parse_size, default=d.results_max_bytes,
      help="head: most bytes kept under --output-path, oldest results removed first (default 5GiB)")  # fmt: skip
    a("--results-store", default=None, metavar="s3://BUCKET/PREFIX",
      help="head/monolithic: keep results in this S3-compatible bucket, shared by every head (credentials from "
           "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or the files AWS_ACCESS_KEY_ID_FILE and "
           "AWS_SECRET_ACCESS_KEY_FILE name); default: the --output-path folder, which several "
           "heads share as one ReadWriteMany volume")  # fmt: skip
    a("--results-s3-endpoint", default=None, metavar="URL",
      help="head: the S3-compatible server of --results-store, e.g. http://seaweedfs:8333 "
           "(default: AWS S3)")  # fmt: skip
    a("--results-presign", type=int, default=d.results_presign, metavar="SECONDS",
      help="head: hand out image URLs and video content as presigned URLs of --results-store valid this long, "
           "so the bytes skip the head; 0 proxies them through the head (default 0)")  # fmt: skip
    a("--device", choices=DEVICES, default=None, help="default: cuda when available, else cpu")
    a("--dtype", choices=DTYPES, default=d.dtype,
      help="model workers, monolithic: the dtype the model loads and computes in; auto: bfloat16 on a GPU, "
           "float32 on the CPU. Roles may differ (a receiver casts its inputs to its own), e.g. a float32 "
           "decoder")  # fmt: skip
    for attr in ("tp_size", "sp_degree", "cfg_parallel_size", *ROLE_PARALLEL_ATTRS):
        a(flag(attr), type=int, default=None)
    a("--worker-capacity", type=int, default=d.worker_capacity,
      help="worker: requests it holds at once (one running, the rest prefetched)")  # fmt: skip
    a("--log-level", default=d.log_level, choices=("debug", "info", "warning", "error"))
    a("--log-format", default=d.log_format, choices=FORMATS,
      help="how log lines are written to stderr: text, or json (one object per line: time, level, process, "
           "logger, message, and structured fields such as the access log's http)")  # fmt: skip
    a("--disagg-drain-timeout", type=float, default=d.disagg_drain_timeout,
      help="head and worker: on SIGTERM, seconds to finish accepted work before exiting "
           "(the head fails what is left with a 503)")  # fmt: skip
    a("--api-keys-file", default=None, metavar="PATH",
      help="head/monolithic: require 'Authorization: Bearer KEY' on the API; one key per line (# comments), "
           "re-read when the file changes; /health, /ready and /metrics stay open")  # fmt: skip
    a("--max-request-bytes", type=parse_size, default=d.max_request_bytes,
      help="head/monolithic: largest HTTP request body, bytes or 16MiB; larger get 413 (default 16MiB)")  # fmt: skip
    a("--access-log", action="store_true",
      help="head/monolithic: log a line per HTTP request as its answer ends: client, method and path, status, "
           "seconds, the request's id and its key's owner (probes and scrapes only when they fail)")  # fmt: skip
    a("--webhook-url", default=None, metavar="URL",
      help="head/monolithic: POST each video job's end (video.completed, video.failed, video.cancelled) to this "
           "http(s) URL, signed as Standard Webhooks sign (needs --webhook-secret-file); retried on no answer, "
           "408, 429 and 5xx")  # fmt: skip
    a("--webhook-secret-file", default=None, metavar="PATH",
      help="head/monolithic: the file of --webhook-url's signing key, whsec_<base64 of 24+ random bytes>")  # fmt: skip
    a("--ssl-certfile", default=None, metavar="PATH",
      help="head/monolithic: serve the HTTP API over TLS (HTTPS) with this PEM certificate, its chain after it; "
           "with --ssl-keyfile (default: plain HTTP, for TLS terminated in front of the head)")  # fmt: skip
    a("--ssl-keyfile", default=None, metavar="PATH",
      help="head/monolithic: the PEM private key of --ssl-certfile (not encrypted)")  # fmt: skip
    a("--max-queued-requests", type=int, default=None, metavar="N",
      help="head/monolithic: a hard cap on requests accepted beyond what the workers can run at once; more get "
           "429 with Retry-After (default: no cap, a request is refused only when it would miss its deadline; "
           "monolithic: 8)")  # fmt: skip
    a("--reference-url-networks", default=d.reference_url_networks, metavar="CIDR;CIDR",
      help="image encoder/monolithic: private networks an edit's image URL may reach; public addresses always "
           "may, every other address (loopback, link-local, private) is refused (default: none)")  # fmt: skip
    a("--batching-mode", choices=BATCHING_MODES, default=d.batching_mode,
      help="head: dynamic groups compatible queued requests (same size, frames, steps, guidance, negative prompt "
           "given or not, max sequence length, outputs) for one worker, which runs each group as one batched "
           "forward per stage (default off)")  # fmt: skip
    a("--batching-max-size", type=int, default=d.batching_max_size, metavar="N",
      help="head: most requests per group; worker: most requests it runs as one batched forward, and it holds "
           "--worker-capacity such batches (default 1: no batching)")  # fmt: skip
    a("--batching-delay-ms", type=float, default=d.batching_delay_ms, metavar="MS",
      help="head --batching-mode dynamic: longest a request waits for its group to fill; a group leaves when "
           "full, at this delay, or when the worker has no more free slots (default 30)")  # fmt: skip
    a("--batching-role-delay-ms", default=d.batching_role_delay_ms, metavar="ROLE=MS[,ROLE=MS]",
      help="head --batching-mode dynamic: a role's own --batching-delay-ms, e.g. encoder=5,denoiser=50 (a short "
           "stage waits less, a long one can wait more); the roles not named use --batching-delay-ms")  # fmt: skip
    a("--enable-batching-metrics", action="store_true",
      help="head: export batch sizes, batching waits and fill ratios per role (histograms) on /metrics")  # fmt: skip
    a("--otlp-endpoint", default=d.otlp_endpoint, metavar="URL",
      help="head and workers: export OpenTelemetry traces of requests over OTLP/HTTP to this collector "
           "(http://HOST:4318; spans go to URL/v1/traces); without it OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
           "OTEL_EXPORTER_OTLP_ENDPOINT, else off")  # fmt: skip
    a("--lora", action="extend", type=parse_urls, default=[], metavar="NAME=SOURCE",
      help="head, denoiser, encoders, monolithic: a LoRA adapter requests may name (`loras`), repeatable (or "
           "';'-separated); SOURCE: a folder with pytorch_lora_weights.safetensors, a .safetensors file or a hub "
           "id (a gated one: HF_TOKEN, or HF_TOKEN_PATH naming the token's file)")  # fmt: skip
    a("--lora-catalog", default=None, metavar="PATH",
      help="head, denoiser, encoders, monolithic: a file of NAME=SOURCE lines (# comments), re-read when it "
           "changes, so adding a line adds an adapter without a restart; its names win over --lora's")  # fmt: skip
    a("--lora-cache-bytes", type=parse_size, default=d.lora_cache_bytes,
      help="denoiser, encoders, monolithic: bytes of LoRA adapters kept loaded, least recently used unloaded first "
           "(default 2GiB)")  # fmt: skip
    a("--simulate", action="store_true",
      help="worker: load no model; each stage sleeps a modelled time and emits the tensors --model-path's family "
           "would (shapes from its configs), through the real pool and Mooncake transfers")  # fmt: skip
    sim = {role.value: costs for role, costs in SIMULATE_DEFAULTS.items()}
    a("--simulate-seconds", type=float, default=None, metavar="S",
      help="worker --simulate: fixed seconds per request (default: "
           + ", ".join(f"{role} {fixed:g}" for role, (fixed, _) in sim.items()) + ")")  # fmt: skip
    a("--simulate-seconds-per-unit", type=float, default=None, metavar="S",
      help="worker --simulate: seconds per unit of work, added to --simulate-seconds; a unit is, for the denoiser, "
           f"one step over one megapixel-frame (default {sim['denoiser'][1]:g}), for the decoder one "
           f"megapixel-frame (default {sim['decoder'][1]:g}), for the encoder one output "
           f"(default {sim['encoder'][1]:g}; the same for prompt_encoder and image_encoder)")  # fmt: skip
    a("--disagg-keys-dir", default=None, metavar="DIR",
      help="head and worker: authenticate and encrypt the control plane (CURVE) with the keys in DIR "
           "(`triptych keys generate DIR`); needed on a non-loopback address unless --disagg-insecure")  # fmt: skip
    a("--disagg-insecure", action="store_true",
      help="head and worker: run the control plane unauthenticated on a non-loopback address "
           "(anyone who reaches a worker's port controls it; only on a network you trust)")  # fmt: skip
