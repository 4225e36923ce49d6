"""What the head's /metrics says about the work done: real DiffusionServer, scripted workers over real ZMQ."""

from __future__ import annotations

import math
import time

from prometheus_client import generate_latest

from tests.unit.core_harness import Harness
from tests.unit.scripted import PARAMS, scripted_head
from triptych.params import GenerationParams
from triptych.protocol import RequestEvent, StepCacheStats, Submit, TransferStaged, Work, decode, encode
from triptych.roles import Role

MANIFEST = [{"name": "x", "dtype": "uint8", "shape": [8], "offset": 0}]


def test_worker_seconds_add_up_what_workers_report_and_an_impossible_report_fails_only_its_request():
    """An infinite report used to reach the work estimate and crash the head's loop (Retry-After)."""
    reported = [0.25, 0.5, -3.0, math.inf, math.nan]
    # Three encoders of two slots each: every request is encoded at once (none is pushed on here).
    with scripted_head({Role.ENCODER: 3, Role.DENOISER: 1, Role.DECODER: 1}) as (server, client, w):
        everyone = [worker for ws in w.values() for worker in ws]
        for i in range(len(reported)):
            client.send_multipart(encode(Submit(f"r{i}", GenerationParams(**PARAMS))))
        failed: dict[str, str] = {}
        running: list[tuple[float, object, Work]] = []  # (when it was got, its worker, the work)
        deadline = time.monotonic() + 10
        while len(failed) < 3 or running:
            assert time.monotonic() < deadline, f"failed so far: {failed}"
            for worker in everyone:
                worker.pump(0.01)
                for work in [m for m in worker.got if isinstance(m, Work)]:
                    worker.got.remove(work)
                    running.append((time.monotonic(), worker, work))
            for got, worker, work in list(running):
                seconds = reported[int(work.request_id.removeprefix("r"))]
                # The possible reports come once that much time has passed (the head takes no more
                # than the time it saw pass), the impossible ones at once.
                if not 0 <= seconds < math.inf or time.monotonic() - got >= seconds:
                    running.remove((got, worker, work))
                    worker.send(TransferStaged(work.request_id, work.instance, 8, MANIFEST, {}, seconds))
            while client.poll(0):
                event, _ = decode(client.recv_multipart())
                if isinstance(event, RequestEvent) and event.state == "FAILED":
                    failed[event.request_id] = event.error or ""
        assert sorted(failed) == ["r2", "r3", "r4"]
        assert all("field 'seconds'" in error for error in failed.values()), failed
        sample = server.metrics.registry.get_sample_value
        while sample("triptych_stage_seconds_count", {"role": "encoder"}) != 2:  # the last report on its way
            assert time.monotonic() < deadline, sample("triptych_stage_seconds_count", {"role": "encoder"})
            time.sleep(0.01)
        assert sample("triptych_worker_seconds_total", {"role": "encoder"}) == 0.75
        client.send_multipart(encode(Submit("after", GenerationParams(**PARAMS))))  # the loop still runs:
        deadline = time.monotonic() + 5
        while not any(isinstance(m, Work) and m.request_id == "after" for x in everyone for m in x.got):
            assert time.monotonic() < deadline, "the head dispatched nothing after the impossible reports"
            for worker in everyone:
                worker.pump(0.01)


def test_a_worker_restarted_at_its_url_keeps_no_series_of_its_predecessors_step_caches():
    """A container restart keeps the pod's IP: the new process reports none of its predecessor's modes.
    Their series went on showing the old counts, and outlived the worker when it left."""
    h = Harness({Role.ENCODER: 1, Role.DENOISER: 1, Role.DECODER: 1})
    denoiser = next(w for w in h.workers.values() if w.role is Role.DENOISER)

    def step_cache_series() -> list[str]:
        text = generate_latest(h.core.metrics.registry).decode()
        return [line for line in text.splitlines() if line.startswith("triptych_step_cache_") and denoiser.url in line]

    denoiser.step_cache = (StepCacheStats("first_block", 1, 2, 3), StepCacheStats("taylorseer", 1, 2, 3))
    h.tick()
    assert len(step_cache_series()) == 6  # requests, computed, skipped for each mode
    denoiser.session, denoiser.step_cache = "restarted", (StepCacheStats("taylorseer", 1, 0, 0),)
    h.tick()
    assert len(step_cache_series()) == 3 and all('mode="taylorseer"' in line for line in step_cache_series())
    h.core.membership.remove(h.core.membership.get(Role.DENOISER, denoiser.url))
    assert step_cache_series() == []
