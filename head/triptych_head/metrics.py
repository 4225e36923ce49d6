"""Prometheus metrics of the head: one registry per process, served at GET /metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from triptych_head.loop_metrics import LoopCounter, LoopHistogram

# The label naming a worker (its URL) in what the head reports per worker. Not "instance": Prometheus
# sets `instance` on every scraped series to the target's (the head's) address, which would rename
# ours to exported_instance and leave queries grouping by instance grouping by head.
WORKER = "worker"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class HeadMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        if registry is None:  # the process's own: with its CPU, memory and descriptors (process_*)
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = LoopCounter("triptych_requests", "Requests by final state", ["state"], registry=r)
        self.request_seconds = LoopHistogram(
            "triptych_request_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r
        )
        self.stage_seconds = LoopHistogram(
            "triptych_stage_seconds",
            "Time a request spends in a role, from dispatch to its output being staged",
            ["role"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Device time (the Grafana dashboard's device-seconds): what workers report spending on each
        # request's stages, never queueing; a replica with G GPUs spends G GPU-seconds per second of it.
        self.worker_seconds = LoopCounter(
            "triptych_worker_seconds",
            "Seconds workers spent running requests' stages (load inputs, run, stage outputs), as they report them",
            ["role"],
            registry=r,
        )
        self.queue_seconds = LoopHistogram(
            "triptych_queue_seconds", "Time waiting for a free instance", ["role"], buckets=LATENCY_BUCKETS, registry=r
        )
        # Per-role load, the autoscaling signal (docs/autoscaling.md); workload.py has the estimate.
        self.role_queued = Gauge(
            "triptych_role_queued_requests", "Requests waiting for an instance of the role", ["role"], registry=r
        )
        self.role_running = Gauge(
            "triptych_role_running_requests", "Requests dispatched to an instance of the role", ["role"], registry=r
        )
        self.role_ready = Gauge(
            "triptych_role_ready_instances",
            "Instances that heartbeat and take new work (not draining or leaving)",
            ["role"],
            registry=r,
        )
        self.role_pending_work = Gauge(
            "triptych_role_pending_work_seconds",
            "Estimated device-seconds of work accepted requests still need from the role",
            ["role"],
            registry=r,
        )
        self.role_seconds_per_unit = Gauge(
            "triptych_role_seconds_per_work_unit",
            "The calibrated cost of one unit of the role's work (see docs/autoscaling.md)",
            ["role"],
            registry=r,
        )
        self.retries = Counter(
            "triptych_retries",
            "Requests restarted on another instance after losing one (cause: heartbeat_lost, disconnected, "
            "left_discovery, transfer_failed, session_mismatch)",
            ["role", "cause"],
            registry=r,
        )
        self.migrations = Counter(
            "triptych_migrations",
            "Denoising requests handed to another denoiser at a step boundary (reason: drain, asked, preempt)",
            ["reason"],
            registry=r,
        )
        self.migration_bytes = Counter(
            "triptych_migration_bytes", "Bytes of denoising state staged by migrations", registry=r
        )
        self.migration_seconds = Histogram(
            "triptych_migration_seconds",
            "From a migration's state staged (a suspended request's: from its dispatch to the next denoiser) to that "
            "denoiser told to resume it (slot, push, write)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Preemption (preemption.py): suspensions, how long suspended requests waited, where they resumed.
        self.suspensions = Counter(
            "triptych_suspensions",
            "Denoising requests suspended at a step boundary for a waiting request of higher priority",
            registry=r,
        )
        self.suspension_bytes = Counter(
            "triptych_suspension_bytes", "Bytes of denoising state suspensions kept in the denoisers' pools", registry=r
        )
        self.suspended_seconds = Histogram(
            "triptych_suspended_seconds",
            "From a suspended request's state staged to its denoising resumed",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.resumptions = Counter(
            "triptych_resumptions",
            "Suspended requests resumed (where: same, in place on the denoiser holding their state, nothing "
            "moved; other, moved there by a migration, also counted in triptych_migrations reason preempt)",
            ["where"],
            registry=r,
        )
        self.refused_work = Counter(
            "triptych_refused_work",
            "Work a worker refused because other heads' requests held its slots (replicated heads); each went "
            "to another instance",
            ["role"],
            registry=r,
        )
        self.active_requests = Gauge("triptych_active_requests", "Requests in flight", registry=r)
        self.free_slots = Gauge(
            "triptych_free_slots", "Free scheduling slots per instance", ["role", WORKER], registry=r
        )
        self.free_pool_bytes = Gauge(
            "triptych_transfer_pool_free_bytes",
            "Free transfer-pool bytes per instance",
            ["role", WORKER],
            registry=r,
        )
        self.instance_up = Gauge("triptych_instance_up", "1 when the instance heartbeats", ["role", WORKER], registry=r)
        self.worker_open_files = Gauge(
            "triptych_worker_open_files",
            "Descriptors the instance's process has open, as of its last heartbeat (Mooncake's TCP transport "
            "keeps connections to peers that went away: alert as it nears triptych_worker_open_files_limit)",
            ["role", WORKER],
            registry=r,
        )
        self.worker_open_files_limit = Gauge(
            "triptych_worker_open_files_limit",
            "The instance's soft open-file limit (each process raises it to its hard limit at start-up); 0: none",
            ["role", WORKER],
            registry=r,
        )
        self.transfer_bytes = LoopCounter(
            "triptych_transfer_bytes", "Bytes moved worker-to-worker", ["source", "destination"], registry=r
        )
        self.transfer_seconds = LoopHistogram(
            "triptych_transfer_seconds",
            "Mooncake write time reported by the sender",
            ["source", "destination"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.handoff_seconds = LoopHistogram(
            "triptych_handoff_seconds",
            "From a sender's output being staged to its receiver being told it is ready (slot, push, write)",
            ["source", "destination"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Admission control (admission.py): the bound, its parts, and what it refused.
        self.admission_max_in_flight = Gauge(
            "triptych_admission_max_in_flight_requests",
            "Requests the head takes at once (worker slots + --max-queued-requests; +Inf without the flag)",
            registry=r,
        )
        self.admission_in_flight = Gauge(
            "triptych_admission_in_flight_requests",
            "Requests the HTTP API accepted and has not answered yet (video jobs until they end)",
            registry=r,
        )
        self.admission_worker_slots = Gauge(
            "triptych_admission_worker_slots", "Scheduling slots of the ready workers, all roles", registry=r
        )
        self.admission_retry_after = Gauge(
            "triptych_admission_retry_after_seconds", "The Retry-After a refused request gets now", registry=r
        )
        self.rejected_overloaded = Counter(
            "triptych_rejected_overloaded_requests",
            "Requests refused with 429: the pipeline was at capacity",
            registry=r,
        )
        self.rejected_deadline = Counter(
            "triptych_rejected_deadline_requests",
            "Requests refused with 429: their estimated completion was beyond their deadline",
            registry=r,
        )
        self.admission_wait = Gauge(
            "triptych_admission_wait_seconds",
            "How long a new request would wait behind the work ahead of it (the largest role's backlog)",
            registry=r,
        )
        self.admission_estimate = Histogram(
            "triptych_admission_estimate_seconds",
            "The estimated completion accepted requests were told (queue wait + their own work)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.dropped_messages = Counter(
            "triptych_dropped_messages", "Worker messages that could not be decoded or matched", registry=r
        )
        self.worker_messages = LoopCounter(
            "triptych_worker_messages_sent",
            "Messages the head sent to workers, by type (work, transfer_alloc, transfer_push, transfer_ready, "
            "ping, cancel_work); a full-pipeline pool gets no transfer_*",
            ["type"],
            registry=r,
        )
        # Each worker's prompt-embedding cache (--encoder-cache-bytes) as its last heartbeat reported it:
        # gauges, since the head relays the worker's own running counts.
        cache = {
            "hits": "Prompt encodings served from the worker's cache (text encoders skipped), since it started",
            "misses": "Prompt encodings the worker's text encoders ran for, since it started",
            "evictions": "Cached prompt embeddings the worker dropped to stay within --encoder-cache-bytes",
            "bytes": "Bytes of prompt embeddings the worker's cache holds now",
            "capacity_bytes": "The worker's --encoder-cache-bytes",
        }
        self.encoder_cache = {
            field: Gauge(f"triptych_encoder_cache_{field}", text, ["role", WORKER], registry=r)
            for field, text in cache.items()
        }

        # Each denoiser's step caches (triptych/step_cache.py) per mode, relayed from its heartbeats like the above.
        step = {
            "requests": "Requests (or batches of them) the worker denoised with the step cache mode, since it started",
            "computed": "Attention computations the worker's transformer ran with the mode, since it started",
            "skipped": "Attention computations the mode skipped (reused or predicted; a skipped block counts its "
            "attentions), since it started",
        }
        self.step_cache = {
            field: Gauge(f"triptych_step_cache_{field}", text, ["role", WORKER, "mode"], registry=r)
            for field, text in step.items()
        }

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, kept: prometheus_client's lookup costs microseconds, and the
        request path asks for the same few children at every message. Only for label sets that are
        never removed (roles, message types, states; not the per-instance gauges membership forgets)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_stage(self, role: str, elapsed: float, worker_seconds: float) -> None:
        """One request's hop through `role`: the head-seen time and the worker's own time."""
        self.child(self.stage_seconds, role).observe(elapsed)
        self.child(self.worker_seconds, role).inc(worker_seconds)
