"""Deadline-aware admission against real processes (a head and simulated workers): a request the
head estimates would miss its deadline gets 429 deadline_unachievable before any worker sees it, and
a burst of quick images is all accepted (no cap in requests by default), each told its estimate."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_http_guards import counter
from tests.e2e.test_null_pipeline import metric
from triptych.roles import Role

pytestmark = pytest.mark.slow

INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")
SMALL = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2}
ESTIMATE = "X-Estimated-Completion-Seconds"
DENOISER_UNITS = 32 * 32 / 1e6 * 2  # SMALL's megapixel-steps (workload.py)


def denoiser_taking(seconds: float) -> dict[Role, tuple[str, ...]]:
    fixed = ("--simulate-seconds", str(seconds), "--simulate-seconds-per-unit", "0")
    return {Role.ENCODER: INSTANT, Role.DENOISER: fixed, Role.DECODER: INSTANT}


def work_sent(c: httpx.Client) -> float:
    """Work messages the head sent: one per request, to its first role (the rest follow by transfers)."""
    return counter(c, "triptych_worker_messages_sent_total", type="work")


def test_a_request_that_would_miss_its_deadline_gets_429_before_any_worker_sees_it(tiny_models, tmp_path):
    # One denoiser, 1 s per request: after one request the head knows it.
    role_flags = denoiser_taking(1.0)
    with deployment(tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=role_flags) as dep:
        with dep.client(timeout=120) as c:
            assert c.post("/v1/images/generations", json=SMALL).status_code == 200  # calibrates the 1 s
            calibrated = time.monotonic() + 10
            while counter(c, "triptych_role_seconds_per_work_unit", role="denoiser") < 0.5 / DENOISER_UNITS:
                assert time.monotonic() < calibrated, "the head never took in the denoiser's 1 s"
                time.sleep(0.1)
            time.sleep(0.2)  # the same tick hands admission its figures
            before = work_sent(c)
            assert before == 1

            # Idle, but its own work alone is ~1 s: a 0.5 s deadline is refused at once.
            r = c.post("/v1/images/generations", json={**SMALL, "deadline_seconds": 0.5})
            assert r.status_code == 429, r.text
            error = r.json()["error"]
            assert (error["code"], error["param"], error["deadline_seconds"]) == (
                "deadline_unachievable",
                "deadline_seconds",
                0.5,
            )
            assert 0.5 < error["estimate_seconds"] < 3 and int(r.headers["Retry-After"]) >= 1
            assert "its own work alone" in error["message"]
            assert work_sent(c) == before  # no worker was sent anything for it

            # Six requests queue 6 s of denoising; a 1.5 s deadline behind them cannot be met.
            go = threading.Barrier(6)

            def queued() -> httpx.Response:
                go.wait(10)
                return c.post("/v1/images/generations", json=SMALL)

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                backlog = [pool.submit(queued) for _ in range(6)]
                waited = time.monotonic() + 10
                while c.get("/health").json()["admission"]["wait_s"].get("denoiser", 0) < 3:
                    assert time.monotonic() < waited, "the backlog never showed in the estimate"
                    time.sleep(0.05)
                late = c.post("/v1/images/generations", json=SMALL, headers={"X-Deadline-Seconds": "1.5"})
                relaxed = c.post("/v1/images/generations", json={**SMALL, "deadline_seconds": 120})
                answers = [f.result(120) for f in backlog]
            assert late.status_code == 429 and late.json()["error"]["param"] == "X-Deadline-Seconds", late.text
            assert late.json()["error"]["wait_seconds"] >= 1.5
            assert relaxed.status_code == 200 and float(relaxed.headers[ESTIMATE]) >= 2, relaxed.headers
            assert [a.status_code for a in answers] == [200] * 6
            assert metric(c, "triptych_rejected_deadline_requests_total") == 2
            # Every accepted request reached a worker, and neither refused one did.
            assert work_sent(c) == before + 7
            assert counter(c, "triptych_requests_total", state="DONE") == 8


def test_a_burst_of_thirty_quick_images_on_one_denoiser_is_all_accepted_with_estimates(tiny_models, tmp_path):
    # Before, the default cap (worker slots + twice as many queued: 18 here) answered 12 of them 429,
    # although the whole burst takes the denoiser ~3 s.
    role_flags = denoiser_taking(0.1)
    with deployment(tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=role_flags) as dep:
        with dep.client(timeout=120) as c:
            assert c.get("/health").json()["admission"]["max_in_flight"] is None
            go = threading.Barrier(30)

            def one() -> httpx.Response:
                go.wait(20)
                return c.post("/v1/images/generations", json=SMALL)

            with concurrent.futures.ThreadPoolExecutor(30) as pool:
                responses = [f.result(180) for f in [pool.submit(one) for _ in range(30)]]
            assert [r.status_code for r in responses] == [200] * 30, [r.text for r in responses if r.status_code != 200]
            estimates = [float(r.headers[ESTIMATE]) for r in responses]
            assert all(0 <= e < 600 for e in estimates), estimates
            assert counter(c, "triptych_requests_total", state="DONE") == 30
            assert metric(c, "triptych_rejected_deadline_requests_total") == 0
            assert metric(c, "triptych_rejected_overloaded_requests_total") == 0
