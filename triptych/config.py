"""ServeArgs: the values of `triptych serve`'s flags and their defaults (the flags: serve_flags.py;
their checks: the config_checks package)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
import re
from dataclasses import dataclass, field

from triptych.parallelism import Parallelism, resolve_parallelism
from triptych.ports import DEFAULT_HTTP_PORT, DEFAULT_SCHEDULER_PORT, parse_tcp_endpoint
from triptych.roles import ROLE_SPECS, WORKER_ROLES, Role
from triptych.serve_help import flag

MIB = 1 << 20
DEFAULT_POOL_SIZE = 256 * MIB
DEFAULT_TIMEOUT_S = 600.0
# --disagg-drain-timeout: on SIGTERM a head or worker lets the work it accepted finish for this long
# (as long as --disagg-timeout lets a request live). The head then fails the rest and needs at most
# HEAD_SHUTDOWN_OVERHEAD_S more to answer the last clients and save video jobs.
DEFAULT_DRAIN_TIMEOUT_S = 600.0
HEAD_SHUTDOWN_OVERHEAD_S = 15.0
MAX_NUMBER = 1e9  # any number flag: ~31 years of seconds, below what a thread's wait takes (threading.TIMEOUT_MAX)
MAX_SIZE = 1 << 50  # any size flag (SIZE_FIELDS): 1 PiB, more than any host's memory or a results cap needs
# The flags in bytes (parse_size): bounded by MAX_SIZE, not MAX_NUMBER (their defaults pass 1e9 already).
SIZE_FIELDS = frozenset(
    {"disagg_transfer_pool_size", "encoder_cache_bytes", "results_max_bytes", "max_request_bytes", "lora_cache_bytes"}
)
MIN_DISCOVERY_INTERVAL_S = 0.05  # --disagg-discovery-interval: each pass resolves every worker list
DEFAULT_PRIORITY_AGING_S = 30.0  # --disagg-priority-aging: a wait this long raises a request one level
DEFAULT_RESULTS_MAX_AGE_S = 24 * 3600.0
DEFAULT_RESULTS_MAX_BYTES = 5 << 30
PIPELINE_ENV = "TRIPTYCH_PIPELINE"  # the pipeline a head serves (<namespace>/<name>): whose its result store is
S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_PRESIGN_S = 7 * 24 * 3600  # S3 signs a URL for a week at most
DISPATCH_POLICIES = ("round_robin", "max_free_slots")
BATCHING_MODES = ("off", "dynamic")  # dynamic: the head groups compatible requests (triptych.batching)
# --max-request-bytes: room for a prompt and, once edits land, an uploaded image or two.
DEFAULT_MAX_REQUEST_BYTES = 16 * MIB
DEVICES = ("cuda", "cpu")
# --dtype: what a worker's model computes in; auto: bfloat16 on a GPU, float32 on the CPU.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --encoder-cache-bytes: prompt embeddings kept for repeated prompts (a FLUX.1 prompt: 512 x 4096 bf16, 4 MiB).
DEFAULT_ENCODER_CACHE_BYTES = 256 * MIB
# --lora-cache-bytes: LoRA adapters a denoiser (an encoder: their text-encoder parts) keeps loaded
# (a FLUX.1 rank-16 adapter: about 80 MiB in bf16).
DEFAULT_LORA_CACHE_BYTES = 2048 * MIB

# Worker-URL flags of the head, by the role they list (the role descriptor's, triptych.roles).
URL_FLAGS: dict[Role, str] = {role: role.url_attr for role in WORKER_ROLES}

# --simulate: per role, (seconds per request, seconds per unit of work) unless the flags say otherwise;
# a unit is one output (encoders), one step over one megapixel-frame (denoiser), one megapixel-frame
# (decoder). Coarse figures for a FLUX.1-dev-class model on one modern GPU (triptych_worker.simulated).
SIMULATE_DEFAULTS: dict[Role, tuple[float, float]] = {role: spec.simulate_seconds for role, spec in ROLE_SPECS.items()}

# Per-role parallelism flags: role -> {degree: attribute}.
ROLE_PARALLEL_FLAGS: dict[Role, dict[str, str]] = {role: spec.parallel_flags for role, spec in ROLE_SPECS.items()}
ROLE_PARALLEL_ATTRS: tuple[str, ...] = tuple(attr for flags in ROLE_PARALLEL_FLAGS.values() for attr in flags.values())


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and what to do."""


# A bind refused for its address (a name that does not resolve, an address not on this machine),
# not for its port: ZeroMQ's ENODEV and EADDRNOTAVAIL.
_ADDRESS_ERRNOS = frozenset({errno.ENODEV, errno.EADDRNOTAVAIL})


def bind_error(
    exc: Exception, endpoint: str, host: tuple[str, str], port: tuple[str, int], port_hint: str
) -> ConfigError:
    """What a failed bind of `endpoint` means, naming the flag at fault: `host` (its flag and value)
    when the address is not this machine's, else `port` (its flag and value) with `port_hint`."""
    if getattr(exc, "errno", None) in _ADDRESS_ERRNOS:  # zmq.ZMQError's, or an OSError's
        return ConfigError(
            f"{host[0]} {host[1]}: cannot bind {endpoint}: {exc} (give an address of this machine, a name "
            "that resolves to one, or 0.0.0.0)"
        )
    return ConfigError(f"{port[0]} {port[1]}: cannot bind {endpoint}: {exc} ({port_hint})")


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1GiB', '512M'."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 268435456, 256MiB, 1GiB)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(m.group(1)) * scale


def parse_bind_address(text: str) -> str:
    """--host and --disagg-p2p-hostname: an IPv6 address may come in brackets, as in a URL; it is kept
    without them, as sockets, uvicorn and Mooncake take it (and tcp_url brackets it again)."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return str(ipaddress.IPv6Address(inner))
    except ValueError:
        return text


def parse_urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(";") if u.strip()]


def parse_endpoint_spec(url: str) -> None:
    """Accept tcp://HOST:PORT, dns://NAME:PORT (every address NAME resolves to, re-resolved) or
    file:///PATH (the tcp:// endpoints listed in that file, re-read)."""
    if url.startswith("file://"):
        if not url.removeprefix("file://").startswith("/"):
            raise ValueError(f"{url!r} is not a file:///ABSOLUTE/PATH")
        return
    parse_tcp_endpoint(url, "dns" if url.startswith("dns://") else "tcp")


@dataclass
class ServeArgs:
    model_path: str
    served_model_name: str | None = None  # the id requests name and /v1/models lists first
    disagg_role: Role = Role.MONOLITHIC
    disagg_server_addr: str | None = None
    scheduler_port: int = DEFAULT_SCHEDULER_PORT
    num_gpus: int = 1
    base_gpu_id: int = 0
    encoder_urls: list[str] = field(default_factory=list)
    prompt_encoder_urls: list[str] = field(default_factory=list)
    image_encoder_urls: list[str] = field(default_factory=list)
    denoiser_urls: list[str] = field(default_factory=list)
    decoder_urls: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = DEFAULT_HTTP_PORT
    disagg_p2p_hostname: str = "127.0.0.1"
    disagg_ib_device: str | None = None
    disagg_transfer_pool_size: int = DEFAULT_POOL_SIZE
    disagg_transfer_listen_any: bool = False
    disagg_load_ahead: int = 1  # worker: batches of inputs copied out of their slots while one computes
    disagg_full_pipeline: bool = False  # a denoiser that runs every stage (a head with only --denoiser-urls)
    encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES
    disagg_timeout: float = DEFAULT_TIMEOUT_S
    disagg_dispatch_policy: str = "round_robin"
    disagg_heartbeat_timeout: float = 5.0
    disagg_max_retries: int = 2
    disagg_discovery_interval: float = 5.0
    disagg_no_instance_wait: float = 120.0
    disagg_migration: str = "on"  # a draining denoiser's running requests move to peers at a step boundary
    disagg_preemption: str = "on"  # a waiting higher-priority request suspends a lower one's denoising
    disagg_priority_aging: float = DEFAULT_PRIORITY_AGING_S  # a wait this long raises a request's priority one level
    results_max_age: float = DEFAULT_RESULTS_MAX_AGE_S
    results_max_bytes: int = DEFAULT_RESULTS_MAX_BYTES
    results_store: str | None = None  # s3://BUCKET/PREFIX; None: the --output-path folder
    results_s3_endpoint: str | None = None  # the S3-compatible server's URL; None: AWS S3
    results_presign: int = 0  # seconds presigned URLs of --results-store stay valid; 0: the head proxies content
    master_port: int | None = None
    output_path: str = "outputs"
    device: str | None = None
    dtype: str = "auto"  # model workers and monolithic: the dtype their model loads and computes in
    tp_size: int | None = None
    sp_degree: int | None = None
    cfg_parallel_size: int | None = None
    encoder_tp: int | None = None
    denoiser_tp: int | None = None
    denoiser_sp: int | None = None
    denoiser_ulysses: int | None = None
    denoiser_ring: int | None = None
    decoder_sp: int | None = None
    worker_capacity: int = 2
    log_level: str = "info"
    log_format: str = "text"  # every process: "json" writes a JSON object per line (triptych.log_format)
    disagg_drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    api_keys_file: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    access_log: bool = False  # head/monolithic: a line per HTTP request (triptych_head.api.access_log)
    ssl_certfile: str | None = None  # head/monolithic: serve HTTPS with this PEM certificate (chain) ...
    ssl_keyfile: str | None = None  # ... and this PEM private key
    max_queued_requests: int | None = None  # None: no cap, deadlines decide (triptych_head.admission)
    webhook_url: str | None = None  # head/monolithic: where the ends of video jobs are POSTed (triptych_head.webhooks)
    webhook_secret_file: str | None = None  # ... signed with this file's whsec_ key
    simulate: bool = False
    simulate_seconds: float | None = None
    simulate_seconds_per_unit: float | None = None
    disagg_keys_dir: str | None = None
    disagg_insecure: bool = False
    reference_url_networks: str = ""  # ';'-separated CIDRs image-edit URLs may reach besides public addresses
    batching_mode: str = "off"  # head: "dynamic" groups compatible queued requests (triptych.batching)
    batching_max_size: int = 1  # head: most requests per group; worker: most requests per batched forward
    batching_delay_ms: float = 30.0  # head: longest a request waits for its group to fill
    batching_role_delay_ms: str = ""  # head: ROLE=MS,... instead of batching_delay_ms for those roles
    enable_batching_metrics: bool = False  # head: batch size, wait and fill histograms on /metrics
    otlp_endpoint: str = ""  # head and workers: an OTLP/HTTP collector for traces ("": off; triptych.tracing)
    lora: list[str] = field(default_factory=list)  # NAME=SOURCE adapters requests may name (triptych.lora)
    lora_catalog: str | None = None  # a file of NAME=SOURCE lines, re-read when it changes
    lora_cache_bytes: int = DEFAULT_LORA_CACHE_BYTES  # denoiser, encoders: adapters kept loaded, LRU dropped

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> ServeArgs:
        """ServeArgs from flags by name (`ServeArgs.from_kwargs(model_path=..., denoiser_sp=4)`), as the
        design's Python API builds them; TypeError naming an argument that is not a flag."""
        known = set(cls.__dataclass_fields__)
        for name in kwargs:
            if name not in known:
                raise TypeError(
                    f"ServeArgs.from_kwargs: {name!r} is not a `triptych serve` flag (see triptych serve --help)"
                )
        return cls(**kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServeArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        args = cls(**{k: v for k, v in vars(ns).items() if k in names})
        args.validate()
        return args

    @property
    def resolved_device(self) -> str:
        """The torch device of this process: cuda:<--base-gpu-id> by default when CUDA is there."""
        device = self.device
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return f"cuda:{self.base_gpu_id}" if device == "cuda" else device

    def compute_dtype(self, device: str) -> str:
        """The dtype the model loads in on `device` (--dtype; auto: bfloat16 on a GPU, float32 on the CPU,
        where the pixels are held to the stock float32 pipeline's)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device.startswith("cuda") else "float32"

    @property
    def stage_role(self) -> Role:
        """Whose stages this process runs: a full-pipeline denoiser runs every stage, as monolithic mode does."""
        return Role.MONOLITHIC if self.disagg_full_pipeline else self.disagg_role

    def urls_for(self, role: Role) -> list[str]:
        return list(getattr(self, URL_FLAGS[role]))

    def parallelism(self) -> Parallelism:
        """Degrees for this process's role; role-specific flags win over the generic ones."""
        role_flags = ROLE_PARALLEL_FLAGS.get(self.disagg_role, {})
        degrees = {"tp": self.tp_size, "sp": self.sp_degree, "cfg": self.cfg_parallel_size}
        for degree, attr in role_flags.items():
            if getattr(self, attr) is not None:
                degrees[degree] = getattr(self, attr)
        prefix = self.disagg_role.flag_prefix if role_flags else "--"
        return resolve_parallelism(self.num_gpus, where=prefix, **degrees)

    def validate(self) -> None:
        """Raise ConfigError for a missing or contradictory flag, naming it and the fix (the checks:
        triptych.config_checks)."""
        from triptych.config_checks import CHECKS

        for check in CHECKS:
            check(self)

    def check_files(self) -> None:
        """What validate() cannot check where the flags are written (the operator builds them for files
        a pod mounts, and hosts it does not see): ConfigError unless they are there as this process starts."""
        from triptych.config_checks import check_listed_files, check_pool_fits_memory, check_tls_files

        check_tls_files(self)
        check_listed_files(self)
        check_pool_fits_memory(self)

    def role_batching_delays_ms(self) -> dict[Role, float]:
        """--batching-role-delay-ms as {role: milliseconds}; ConfigError naming a bad entry."""
        delays: dict[Role, float] = {}
        what = f"--batching-role-delay-ms {self.batching_role_delay_ms!r}"
        roles = {r.value: r for r in WORKER_ROLES}
        for entry in filter(None, (e.strip() for e in self.batching_role_delay_ms.split(","))):
            name, sep, value = entry.partition("=")
            role = roles.get(name.strip())
            if not sep or role is None:
                raise ConfigError(
                    f"{what}: {entry!r} is not ROLE=MS with ROLE one of {', '.join(roles)} (e.g. encoder=5,denoiser=50)"
                )
            try:
                ms = float(value)
            except ValueError:
                ms = float("nan")
            if not 0 <= ms <= MAX_NUMBER:  # NaN too
                raise ConfigError(
                    f"{what}: {role.value}={value.strip()!r} must be a number of milliseconds >= 0 "
                    f"(at most {MAX_NUMBER:g})"
                )
            if role in delays:
                raise ConfigError(f"{what}: {role.value} is given twice")
            delays[role] = ms
        return delays

    def control_bind_address(self) -> str | None:
        """Where this process accepts control-plane peers: the head's result sockets (--host), a
        worker's work socket (--disagg-p2p-hostname); None for monolithic mode (no control plane)."""
        if self.disagg_role is Role.SERVER:
            return self.host
        return self.disagg_p2p_hostname if self.disagg_role.is_worker else None

    def to_argv(self) -> list[str]:
        """The `triptych serve` arguments that reproduce these values (defaults omitted)."""
        argv: list[str] = []
        defaults = ServeArgs(model_path="")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "model_path" and value == getattr(defaults, f.name):
                continue
            if isinstance(value, bool):  # a switch: present or absent
                argv.append(flag(f.name))
                continue
            if isinstance(value, Role):
                value = value.value
            if isinstance(value, list):
                value = ";".join(value)
            argv += [flag(f.name), str(value)]
        return argv
