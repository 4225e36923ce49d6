"""ServeArgs: the values of `triptych serve`'s flags, their defaults and validation (the flags: serve_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from urllib.parse import SplitResult, urlsplit

from triptych.flag_roles import first_unused, refusal
from triptych.liveness import HEARTBEAT_INTERVAL_S, MIN_HEARTBEAT_TIMEOUT_S
from triptych.parallelism import Parallelism, ParallelismError, resolve_parallelism
from triptych.ports import (
    DEFAULT_HTTP_PORT,
    DEFAULT_MASTER_PORT_OFFSET,
    DEFAULT_SCHEDULER_PORT,
    MAX_RESULT_PORT_OFFSET,
    is_loopback,
    parse_tcp_endpoint,
)
from triptych.roles import FULL_PIPELINE_ROLE, ROLE_SPECS, WORKER_ROLES, Role, is_full_pipeline
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
MIN_DISCOVERY_INTERVAL_S = 0.05  # --disagg-discovery-interval: each pass resolves every worker list
DEFAULT_PRIORITY_AGING_S = 30.0  # --disagg-priority-aging: a wait this long raises a request one level
DEFAULT_RESULTS_MAX_AGE_S = 24 * 3600.0
DEFAULT_RESULTS_MAX_BYTES = 5 << 30
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


def url_port_ok(parts: SplitResult) -> bool:
    """Whether a URL's port, if it has one, is a TCP port (urlsplit raises on reading a bad one)."""
    try:
        return parts.port is None or parts.port > 0
    except ValueError:
        return False


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and what to do."""


def parse_size(text: str) -> int:
    """Bytes from '268435456', '256MiB', '1GiB', '512M'."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 268435456, 256MiB, 1GiB)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(m.group(1)) * scale


def parse_urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(";") if u.strip()]


def parse_endpoint_spec(url: str) -> None:
    """Accept tcp://HOST:PORT, dns://NAME:PORT (every address NAME resolves to, re-resolved) or
    file:///PATH (the tcp:// endpoints listed in that file, re-read)."""
    if url.startswith("file://"):
        if not url.removeprefix("file://").startswith("/"):
            raise ValueError(f"{url!r} is not a file:///ABSOLUTE/PATH")
        return
    if url.startswith("dns://"):
        url = "tcp://" + url.removeprefix("dns://")
        try:
            parse_tcp_endpoint(url)
        except ValueError:
            raise ValueError(f"{url.replace('tcp://', 'dns://', 1)!r} is not a dns://NAME:PORT endpoint") from None
        return
    parse_tcp_endpoint(url)


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
    disagg_drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S
    api_keys_file: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    ssl_certfile: str | None = None  # head/monolithic: serve HTTPS with this PEM certificate (chain) ...
    ssl_keyfile: str | None = None  # ... and this PEM private key
    max_queued_requests: int | None = None  # None: no cap, deadlines decide (triptych_head.admission)
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
        """Raise ConfigError for a missing or contradictory flag, naming it and the fix."""
        self._validate_numbers()
        role = self.disagg_role
        if self.served_model_name is not None:
            if role.is_worker:
                raise ConfigError(f"--served-model-name is for the head (server or monolithic), not {role.value}")
            if not self.served_model_name.strip():
                raise ConfigError("--served-model-name is empty: give the id clients send as `model`")
        if role.is_worker and not self.disagg_server_addr:
            raise ConfigError(f"--disagg-role {role.value} needs --disagg-server-addr tcp://HEAD:SCHEDULER_PORT")
        if self.disagg_server_addr:
            if not role.is_worker:
                raise ConfigError(f"--disagg-server-addr is only for worker roles, not --disagg-role {role.value}")
            try:  # one head, or several (replicated heads): the forms of the head's worker lists
                specs = parse_urls(self.disagg_server_addr)
                for spec in specs:
                    parse_endpoint_spec(spec)
            except ValueError as exc:
                raise ConfigError(f"--disagg-server-addr: {exc}") from None
            if not specs:
                raise ConfigError("--disagg-server-addr is empty: give tcp://HEAD:SCHEDULER_PORT")
            for spec in specs:  # a worker reports on the head's result port for its role: up to +5
                port = urlsplit(spec).port if spec.startswith("tcp://") else None
                if port is not None and port + MAX_RESULT_PORT_OFFSET > 65535:
                    raise ConfigError(
                        f"--disagg-server-addr {spec}: a head's --scheduler-port leaves room for its result ports "
                        f"(+1..+{MAX_RESULT_PORT_OFFSET}), so it is at most {65535 - MAX_RESULT_PORT_OFFSET}"
                    )
        given_urls = [r for r in URL_FLAGS if self.urls_for(r)]
        if role is Role.SERVER:
            self._validate_head_urls(given_urls)
        elif given_urls:
            names = ", ".join(flag(URL_FLAGS[r]) for r in given_urls)
            raise ConfigError(f"{names} only apply to --disagg-role server, not {role.value}")
        for name in ("scheduler_port", "port") + (("master_port",) if self.master_port is not None else ()):
            value = getattr(self, name)
            if not 1 <= value <= 65535:
                raise ConfigError(f"{flag(name)} {value} is not a TCP port (1-65535)")
        if role is Role.SERVER and self.scheduler_port + MAX_RESULT_PORT_OFFSET > 65535:
            raise ConfigError(
                f"--scheduler-port {self.scheduler_port} leaves no room for the result ports "
                f"(+1..+{MAX_RESULT_PORT_OFFSET})"
            )
        self._validate_port_clashes()
        if self.disagg_transfer_pool_size < MIB:
            raise ConfigError(
                f"--disagg-transfer-pool-size {self.disagg_transfer_pool_size} is below 1 MiB; use e.g. 256MiB"
            )
        if self.disagg_load_ahead < 0:
            raise ConfigError(
                f"--disagg-load-ahead {self.disagg_load_ahead} must be >= 0 "
                "(0: the computing thread copies its own inputs)"
            )
        if self.disagg_transfer_listen_any and not role.is_worker:
            raise ConfigError(f"--disagg-transfer-listen-any is for worker roles, not --disagg-role {role.value}")
        if self.disagg_timeout <= 0:
            raise ConfigError(f"--disagg-timeout {self.disagg_timeout} must be > 0 seconds")
        if not self.disagg_heartbeat_timeout >= MIN_HEARTBEAT_TIMEOUT_S:  # NaN too
            raise ConfigError(
                f"--disagg-heartbeat-timeout {self.disagg_heartbeat_timeout:g} is below twice the workers' "
                f"{HEARTBEAT_INTERVAL_S:g} s heartbeat interval, so a worker whose heartbeat is a little late "
                f"would count as lost: use at least {MIN_HEARTBEAT_TIMEOUT_S:g}"
            )
        if self.disagg_discovery_interval < MIN_DISCOVERY_INTERVAL_S:
            raise ConfigError(
                f"--disagg-discovery-interval {self.disagg_discovery_interval} must be at least "
                f"{MIN_DISCOVERY_INTERVAL_S:g} seconds (each pass resolves every worker list's names)"
            )
        if self.disagg_max_retries < 0:
            raise ConfigError(f"--disagg-max-retries {self.disagg_max_retries} must be >= 0 (0: never retry)")
        if self.disagg_no_instance_wait <= 0:
            raise ConfigError(f"--disagg-no-instance-wait {self.disagg_no_instance_wait} must be > 0 seconds")
        if not self.disagg_priority_aging > 0:
            raise ConfigError(
                f"--disagg-priority-aging {self.disagg_priority_aging} must be > 0 seconds (the wait that raises a "
                "request one priority level, so that none waits forever)"
            )
        if self.results_max_age <= 0:
            raise ConfigError(f"--results-max-age {self.results_max_age} must be > 0 seconds")
        if not self.output_path.strip():
            raise ConfigError("--output-path is empty: give the folder the head keeps URL images and videos in")
        self._validate_results_store()
        self._validate_otlp_endpoint()
        if self.num_gpus < 1 or self.base_gpu_id < 0:
            raise ConfigError("--num-gpus must be >= 1 and --base-gpu-id >= 0")
        if self.worker_capacity < 1:
            raise ConfigError(f"--worker-capacity {self.worker_capacity} must be >= 1")
        if self.disagg_drain_timeout <= 0:
            raise ConfigError(f"--disagg-drain-timeout {self.disagg_drain_timeout} must be > 0 seconds")
        if self.encoder_cache_bytes < 0:
            raise ConfigError(f"--encoder-cache-bytes {self.encoder_cache_bytes} must be >= 0 (0: no cache)")
        self._validate_full_pipeline()
        self._validate_http_limits()
        self._validate_batching()
        self._validate_reference_urls()
        self._validate_simulation()
        self._validate_control_security()
        self._validate_flags_taken()
        self._validate_lora()
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        try:
            self.parallelism()
        except ParallelismError as exc:
            raise ConfigError(str(exc)) from None

    def _validate_flags_taken(self) -> None:
        # No flag silently ignored: one a role does not use is refused (the table: triptych.flag_roles).
        defaults = ServeArgs(model_path="")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        unused = first_unused(values, {n: getattr(defaults, n) for n in values}, self.disagg_role)
        if unused is not None:
            raise ConfigError(refusal(unused, self.disagg_role))

    def _validate_full_pipeline(self) -> None:
        if not self.disagg_full_pipeline:
            return
        if self.disagg_role is not FULL_PIPELINE_ROLE:
            raise ConfigError(
                f"--disagg-full-pipeline is for --disagg-role {FULL_PIPELINE_ROLE} (a full-pipeline pool), "
                f"not {self.disagg_role}"
            )
        if self.simulate:
            raise ConfigError("--disagg-full-pipeline does not support --simulate; simulate the role pools instead")

    def _validate_otlp_endpoint(self) -> None:
        if self.otlp_endpoint:
            parts = urlsplit(self.otlp_endpoint)
            if parts.scheme not in ("http", "https") or not parts.netloc or not url_port_ok(parts):
                raise ConfigError(
                    f"--otlp-endpoint {self.otlp_endpoint!r} is not http(s)://HOST:PORT, an OTLP/HTTP collector "
                    "(traces go to its /v1/traces)"
                )

    def _validate_lora(self) -> None:
        from triptych.lora import parse_entries

        try:
            parse_entries(self.lora)  # the --lora-catalog file is the process's to read (and re-read): not here
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.lora_catalog is not None and not self.lora_catalog.strip():
            raise ConfigError("--lora-catalog is empty: give the path of a file of NAME=SOURCE lines")
        if self.lora_cache_bytes < 1:
            raise ConfigError(f"--lora-cache-bytes {self.lora_cache_bytes} must be > 0; use e.g. 2GiB")

    def _validate_results_store(self) -> None:
        given = [f for f in ("results_store", "results_s3_endpoint", "results_presign") if getattr(self, f)]
        if given and self.disagg_role.is_worker:
            raise ConfigError(f"{flag(given[0])} is for the head (server or monolithic), not {self.disagg_role}")
        if self.results_store is not None:
            parts = urlsplit(self.results_store)
            if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
                raise ConfigError(
                    f"--results-store {self.results_store!r} is not s3://BUCKET/PREFIX (for a shared folder, "
                    "mount it and give --output-path instead)"
                )
            if not S3_BUCKET.fullmatch(parts.netloc):
                raise ConfigError(
                    f"--results-store {self.results_store!r}: {parts.netloc!r} is not an S3 bucket name "
                    "(3-63 lowercase letters, digits, dots and hyphens)"
                )
        elif self.results_s3_endpoint or self.results_presign:
            which = "--results-s3-endpoint" if self.results_s3_endpoint else "--results-presign"
            raise ConfigError(f"{which} only applies with --results-store s3://BUCKET/PREFIX")
        if self.results_s3_endpoint is not None:
            parts = urlsplit(self.results_s3_endpoint)
            if (
                parts.scheme not in ("http", "https") or not parts.netloc or parts.path.strip("/") or parts.query
                or not url_port_ok(parts)
            ):  # fmt: skip
                raise ConfigError(
                    f"--results-s3-endpoint {self.results_s3_endpoint!r} is not http(s)://HOST[:PORT] "
                    "(the bucket goes in --results-store)"
                )
        if not 0 <= self.results_presign <= MAX_PRESIGN_S:
            raise ConfigError(
                f"--results-presign {self.results_presign} must be between 0 (the head proxies content) and "
                f"{MAX_PRESIGN_S} seconds (S3's longest)"
            )

    def _validate_reference_urls(self) -> None:
        from triptych.reference import parse_networks

        try:
            parse_networks(self.reference_url_networks)
        except ValueError as exc:
            raise ConfigError(f"--reference-url-networks: {exc}") from None

    def _validate_http_limits(self) -> None:
        head_only = [f for f in ("api_keys_file", "max_queued_requests") if getattr(self, f) is not None]
        if head_only and self.disagg_role.is_worker:
            raise ConfigError(f"{flag(head_only[0])} is for the head (server or monolithic), not {self.disagg_role}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max-request-bytes {self.max_request_bytes} is below 1KiB; use e.g. 16MiB")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests {self.max_queued_requests} must be >= 0")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            given, missing = (
                ("--ssl-certfile", "--ssl-keyfile") if self.ssl_keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
            )
            raise ConfigError(f"{given} needs {missing} too (the certificate and its private key, PEM files)")

    def check_files(self) -> None:
        """What validate() cannot check where the flags are written (the operator builds them for files
        a pod mounts): ConfigError unless they are there as this process starts."""
        self._check_tls_files()

    def _check_tls_files(self) -> None:
        """--ssl-certfile and --ssl-keyfile: readable, and a certificate the key belongs to."""
        if self.ssl_certfile is None or self.ssl_keyfile is None:
            return
        import ssl

        for name, path in (("--ssl-certfile", self.ssl_certfile), ("--ssl-keyfile", self.ssl_keyfile)):
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise ConfigError(f"{name} {path}: {exc.strerror or exc}") from None
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(
                f"--ssl-certfile {self.ssl_certfile} and --ssl-keyfile {self.ssl_keyfile} do not load as a PEM "
                f"certificate and its private key ({exc}); an encrypted key is not supported"
            ) from None

    def _validate_batching(self) -> None:
        if self.batching_mode not in BATCHING_MODES:
            raise ConfigError(f"--batching-mode {self.batching_mode!r} is not one of {', '.join(BATCHING_MODES)}")
        if self.batching_max_size < 1:
            raise ConfigError(f"--batching-max-size {self.batching_max_size} must be >= 1 (1: no batching)")
        if not self.batching_delay_ms >= 0:  # NaN too
            raise ConfigError(f"--batching-delay-ms {self.batching_delay_ms} must be >= 0 milliseconds")
        head_only = [f for f in ("batching_mode", "batching_delay_ms", "batching_role_delay_ms",
                                 "enable_batching_metrics") if getattr(self, f) != getattr(ServeArgs, f)]  # fmt: skip
        if head_only and self.disagg_role is not Role.SERVER:
            raise ConfigError(f"{flag(head_only[0])} is for the head (--disagg-role server), not {self.disagg_role}")
        if self.disagg_role is Role.SERVER and self.batching_mode != "dynamic":  # the head forms no groups
            self._refuse_grouping_flags()
        self.role_batching_delays_ms()  # raises naming the entry
        if self.batching_max_size > 1 and self.disagg_role is Role.MONOLITHIC:
            raise ConfigError("--batching-max-size is for --disagg-role server and its workers; monolithic mode "
                              "runs one request at a time")  # fmt: skip

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
            if not 0 <= ms < float("inf"):
                raise ConfigError(f"{what}: {role.value}={value.strip()!r} must be a number of milliseconds >= 0")
            if role in delays:
                raise ConfigError(f"{what}: {role.value} is given twice")
            delays[role] = ms
        return delays

    def _refuse_grouping_flags(self) -> None:
        """A head without --batching-mode dynamic forms no groups: the flags that size, wait for or
        measure them would do nothing there."""
        if self.batching_max_size > 1:
            raise ConfigError(
                f"--batching-max-size {self.batching_max_size} on --disagg-role server does nothing without "
                "--batching-mode dynamic (the head groups requests only then): add --batching-mode dynamic, or "
                "drop it and give --batching-max-size to the workers only"
            )
        grouping = [
            f
            for f in ("batching_delay_ms", "batching_role_delay_ms", "enable_batching_metrics")
            if getattr(self, f) != getattr(ServeArgs, f)
        ]
        if grouping:
            raise ConfigError(
                f"{flag(grouping[0])} on --disagg-role server does nothing without --batching-mode dynamic (the head "
                "forms no groups to wait for or measure): add --batching-mode dynamic, or drop it"
            )

    def _validate_simulation(self) -> None:
        timing = [f for f in ("simulate_seconds", "simulate_seconds_per_unit") if getattr(self, f) is not None]
        if self.simulate and not self.disagg_role.is_worker:
            workers = ", ".join(role.value for role in WORKER_ROLES)
            raise ConfigError(f"--simulate is for worker roles ({workers}), not {self.disagg_role}")
        if timing and not self.simulate:
            raise ConfigError(f"{flag(timing[0])} only applies with --simulate")
        if self.simulate and self.dtype not in ("auto", "float32"):
            raise ConfigError(
                f"--dtype {self.dtype} does nothing with --simulate: a simulated worker loads no model and emits "
                "float32 tensors; leave --dtype out"
            )
        for name in timing:
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag(name)} {getattr(self, name)} must be >= 0 seconds")

    def control_bind_address(self) -> str | None:
        """Where this process accepts control-plane peers: the head's result sockets (--host), a
        worker's work socket (--disagg-p2p-hostname); None for monolithic mode (no control plane)."""
        if self.disagg_role is Role.SERVER:
            return self.host
        return self.disagg_p2p_hostname if self.disagg_role.is_worker else None

    def _validate_control_security(self) -> None:
        if self.disagg_keys_dir and self.disagg_insecure:
            raise ConfigError("give --disagg-keys-dir or --disagg-insecure, not both")
        address = self.control_bind_address()
        if address is None or self.disagg_keys_dir or self.disagg_insecure or is_loopback(address):
            return
        which = "--host" if self.disagg_role is Role.SERVER else "--disagg-p2p-hostname"
        raise ConfigError(
            f"{which} {address} is reachable from other hosts and the control plane has no keys: give "
            "--disagg-keys-dir DIR (`triptych keys generate DIR` writes one) or, on a trusted network, "
            "--disagg-insecure"
        )

    def _validate_numbers(self) -> None:
        """Every number flag is finite and below MAX_NUMBER: NaN passes every `x <= 0` check below and
        then never times out, or times out at once; infinity overflows the clocks' waits."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_NUMBER):
                raise ConfigError(f"{flag(f.name)} {value} must be a finite number (at most {MAX_NUMBER:g})")

    def _validate_port_clashes(self) -> None:
        """Two sockets of this process on one port: the second bind would fail after the model loaded."""
        if self.disagg_role is Role.SERVER:
            taken = range(self.scheduler_port, self.scheduler_port + MAX_RESULT_PORT_OFFSET + 1)
            if self.port in taken:
                raise ConfigError(
                    f"--port {self.port} is one of the head's control ports (--scheduler-port {self.scheduler_port} "
                    f"and its result ports +1..+{MAX_RESULT_PORT_OFFSET}); give the HTTP API another port"
                )
        derived = self.scheduler_port + DEFAULT_MASTER_PORT_OFFSET
        if self.disagg_role.is_worker and self.num_gpus > 1 and self.master_port is None and derived > 65535:
            raise ConfigError(
                f"--scheduler-port {self.scheduler_port}: the ranks meet on it + {DEFAULT_MASTER_PORT_OFFSET} "
                f"({derived}), not a TCP port; give --master-port"
            )
        if self.master_port is not None and self.master_port == self.scheduler_port:
            raise ConfigError(
                f"--master-port {self.master_port} is also --scheduler-port (this worker's work port); give another"
            )

    def _validate_head_urls(self, given: list[Role]) -> None:
        if not is_full_pipeline(set(given)):  # only denoisers: a full-pipeline pool (--disagg-full-pipeline)
            self._validate_role_pools(given)
        seen: dict[str, Role] = {}
        for role in given:
            for url in self.urls_for(role):
                try:
                    parse_endpoint_spec(url)
                except ValueError as exc:
                    raise ConfigError(f"{flag(URL_FLAGS[role])}: {exc}") from None
                if url in seen:
                    raise ConfigError(
                        f"{url} is listed for both {seen[url].value} and {role.value}; each worker has one role"
                    )
                seen[url] = role
                self._check_workers_reach_results(role, url)

    def _check_workers_reach_results(self, role: Role, url: str) -> None:
        """A worker reports (heartbeats, results) to the head's result sockets, which bind --host: a
        worker on another host never reaches a loopback --host, so its instance would never come up.
        Only a tcp:// endpoint names its host; dns:// and file:// lists may resolve anywhere."""
        if not url.startswith("tcp://") or not is_loopback(self.host):
            return
        host, _ = parse_tcp_endpoint(url)
        if is_loopback(host):
            return
        raise ConfigError(
            f"{flag(URL_FLAGS[role])} {url} is on another host, but --host {self.host} binds the head's result "
            f"sockets to loopback, which that {role.value} cannot reach (its heartbeats never arrive): pass "
            "--host with an address the workers reach (or 0.0.0.0), with --disagg-keys-dir DIR"
        )

    @staticmethod
    def _validate_role_pools(given: list[Role]) -> None:
        if Role.DENOISER not in given or Role.DECODER not in given:
            raise ConfigError(
                "--disagg-role server needs --denoiser-urls and --decoder-urls (semicolon-separated), or only "
                "--denoiser-urls for a full-pipeline pool (workers started with --disagg-full-pipeline)"
            )
        split = Role.PROMPT_ENCODER in given or Role.IMAGE_ENCODER in given
        if split and Role.ENCODER in given:
            raise ConfigError("give either --encoder-urls or --prompt-encoder-urls/--image-encoder-urls, not both")
        if not split and Role.ENCODER not in given:
            raise ConfigError("--disagg-role server needs --encoder-urls (or --prompt-encoder-urls)")
        if split and Role.PROMPT_ENCODER not in given:
            raise ConfigError("--image-encoder-urls needs --prompt-encoder-urls as well")

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
