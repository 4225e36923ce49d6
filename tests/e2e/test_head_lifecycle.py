"""The head stops, restarts and hands its workers over without losing what it accepted.

Real processes (null workers): SIGTERM drains within --disagg-drain-timeout whatever state requests are
in; a restarted head finds every worker's pool free within one heartbeat; finished results and
video jobs outlive the head that made them.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.harness import deployment
from tests.e2e.test_null_pipeline import assert_all_capacity_released, image, metric
from triptych.config import HEAD_SHUTDOWN_OVERHEAD_S
from triptych.liveness import HEARTBEAT_INTERVAL_S
from triptych.roles import Role
from triptych_dev.localdeploy import LocalDeployment, wait_until_ready
from triptych_head.main import READY_WITHOUT_WORKERS_S
from triptych_head.results import JOB_LEASE_S

pytestmark = pytest.mark.slow

STEPS_1S = ("--step-seconds", "0.05")  # 20 denoising steps take a second


@pytest.fixture(scope="module")
def flux(tiny_models):
    return tiny_models["tiny-flux"]


def sigterm_and_wait(dep: LocalDeployment, bound: float) -> float:
    """SIGTERM the head; return how long it took to exit (asserting it exited 0 within `bound`)."""
    head = dep.head
    started = time.monotonic()
    head.popen.send_signal(signal.SIGTERM)
    try:
        rc = head.popen.wait(bound)
    except Exception:
        head.kill()
        raise AssertionError(f"the head ignored SIGTERM for {bound:g}s:\n{head.tail()}") from None
    assert rc == 0, f"the head exited with {rc}:\n{head.tail()}"
    return time.monotonic() - started


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"{what} within {timeout:g}s"
        time.sleep(0.05)
    return value


def test_sigterm_with_a_request_stuck_waiting_exits_0_within_the_drain_bound(flux, tmp_path):
    # The decoder's only worker is gone: a request waits for it, and would for --disagg-timeout (600 s).
    flags = ("--disagg-drain-timeout", "2", "--disagg-heartbeat-timeout", "2")
    with deployment(flux, tmp_path, null_payload=4096, head_flags=flags) as dep, dep.client(timeout=60) as c:
        dep.workers(Role.DECODER)[0].kill()
        wait_for(lambda: not c.get("/health").json()["workers"]["decoder"][0]["alive"], 10, "decoder seen gone")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            stuck = pool.submit(image, c)
            wait_for(lambda: metric(c, "triptych_role_queued_requests") >= 1, 10, "request queued for the decoder")
            took = sigterm_and_wait(dep, 2 + HEAD_SHUTDOWN_OVERHEAD_S)
            r = stuck.result(10)
        assert took >= 1.5, "the head did not give the request its drain time"
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "shut down" in message and "--disagg-drain-timeout" in message, message


def test_sigterm_lets_requests_in_flight_finish_and_refuses_new_ones(flux, tmp_path):
    flags = ("--disagg-drain-timeout", "30")
    with deployment(flux, tmp_path, null_payload=4096, head_flags=flags, worker_flags=STEPS_1S) as dep:
        with dep.client(timeout=60) as c, concurrent.futures.ThreadPoolExecutor(3) as pool:
            assert c.get("/ready").status_code == 200
            running = [pool.submit(image, c, num_inference_steps=20) for _ in range(3)]
            wait_for(lambda: metric(c, "triptych_active_requests") >= 3, 10, "three requests in flight")
            dep.head.popen.send_signal(signal.SIGTERM)
            wait_for(lambda: c.get("/ready").status_code == 503, 5, "readiness failing")
            refused = image(c)
            assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit(), refused.text
            assert c.get("/health").json()["draining"] is True  # liveness holds: it is not killed mid-drain
            assert [f.result(30).status_code for f in running] == [200] * 3
            assert dep.head.popen.wait(10) == 0  # as soon as nothing is left, well before the 30 s


def test_a_head_restart_under_traffic_loses_no_accepted_request(flux, tmp_path):
    flags = ("--disagg-drain-timeout", "30")
    worker_flags = ("--step-seconds", "0.02")
    with deployment(flux, tmp_path, null_payload=4096, head_flags=flags, worker_flags=worker_flags) as dep:
        stop = threading.Event()
        outcomes: list[str] = []  # "ok", "refused" (never accepted: the client retries), or the error

        def client_loop() -> None:
            with httpx.Client(base_url=dep.http, timeout=60) as c:
                while not stop.is_set():
                    try:
                        r = image(c, num_inference_steps=10)
                    except httpx.TransportError:  # no head listening for a moment
                        outcomes.append("refused")
                        time.sleep(0.1)
                        continue
                    if r.status_code == 200:
                        outcomes.append("ok")
                    elif r.status_code == 503 and r.json()["error"]["code"] in ("shutting_down", "rejected"):
                        outcomes.append("refused")
                        time.sleep(0.1)
                    else:
                        outcomes.append(f"{r.status_code} {r.text}")

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            clients = [pool.submit(client_loop) for _ in range(3)]
            wait_for(lambda: outcomes.count("ok") >= 6, 30, "traffic through head A")
            sigterm_and_wait(dep, 30 + HEAD_SHUTDOWN_OVERHEAD_S)
            served_by_a = outcomes.count("ok")
            dep.start_head()
            wait_until_ready(dep, 3, 60)
            wait_for(lambda: outcomes.count("ok") >= served_by_a + 6, 30, "traffic through head B")
            stop.set()
            for f in clients:
                f.result(60)
        lost = [o for o in outcomes if o not in ("ok", "refused")]
        assert lost == [], lost
        with dep.client() as c:
            assert_all_capacity_released(c)


def pools_free(health: dict) -> bool:  # type: ignore[type-arg]
    """Every worker holds nothing: no pool bytes beyond its standing slots, and no request in any of
    its scheduling slots (outputs sent in place hold a slot, not pool bytes)."""
    workers = [w for ws in health["workers"].values() for w in ws]
    return all(
        w["alive"] and w["free_bytes"] + w["standing_bytes"] == w["pool_bytes"] and w["free_slots"] == w["capacity"]
        for w in workers
    )


def test_after_a_head_is_killed_its_successor_finds_every_pool_free_within_one_heartbeat(flux, tmp_path):
    # A slow denoiser with a queue: when head A dies, encoders hold staged outputs and the denoiser
    # holds reserved and standing slots and queued work, all for A's requests (10 s of steps each).
    with deployment(flux, tmp_path, null_payload=65536, worker_flags=STEPS_1S) as dep:
        with dep.client(timeout=60) as c, concurrent.futures.ThreadPoolExecutor(6) as pool:
            for _ in range(6):
                pool.submit(image, c, num_inference_steps=200)
            wait_for(lambda: not pools_free(c.get("/health").json()), 10, "pool bytes or slots held for head A")
            dep.head.kill()
        dep.start_head()
        wait_until_ready(dep, 3, 60)
        seen_alive = time.monotonic()
        # One heartbeat (1 s) in practice; five allow for a loaded machine. What a worker kept for A
        # would stay held far longer: queued requests of 10 s of steps each, outputs no head will fetch.
        bound = 5 * HEARTBEAT_INTERVAL_S
        with dep.client() as c:
            wait_for(lambda: pools_free(c.get("/health").json()), bound, "every pool free under B")
            took = time.monotonic() - seen_alive
            assert took <= bound, f"every pool was free {took:.1f}s after B saw its workers"
            workers = [w for ws in c.get("/health").json()["workers"].values() for w in ws]
            assert all(w["free_slots"] == w["capacity"] for w in workers), workers
            assert image(c).status_code == 200


def answers(c: httpx.Client) -> bool:
    try:
        return c.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def test_a_head_is_not_ready_while_a_role_has_no_worker_for_it_and_is_after_the_grace(flux, tmp_path):
    # A Service must not send requests to a head its workers have not found yet (a rollout's surge
    # head): /ready says 503 until each role has a ready instance, or READY_WITHOUT_WORKERS_S passed
    # (a pipeline with a role at zero then takes requests and queues them).
    with deployment(flux, tmp_path, null_payload=4096) as dep:
        dep.workers(Role.DECODER)[0].kill()
        dep.head.kill()
        dep.start_head()
        started = time.monotonic()
        with dep.client(timeout=5) as c:
            wait_for(lambda: answers(c), 60, "the new head answering")
            workers = lambda: c.get("/health").json()["workers"]  # noqa: E731
            wait_for(lambda: all(w["alive"] for w in workers()["encoder"] + workers()["denoiser"]), 10, "the others")
            while time.monotonic() - started < READY_WITHOUT_WORKERS_S - 5:
                assert c.get("/ready").status_code == 503, "ready without a decoder"
                time.sleep(0.5)
            wait_for(lambda: c.get("/ready").status_code == 200, 15, "ready after the grace")
            assert time.monotonic() - started >= READY_WITHOUT_WORKERS_S


def test_finished_results_survive_a_head_restart_and_a_running_job_is_run_again_by_the_next_head(tiny_models, tmp_path):
    wan = tiny_models["tiny-wan"]
    slow = ("--step-seconds", "0.1")
    with deployment(wan, tmp_path, null_payload=4096, worker_flags=slow) as dep, dep.client(timeout=60) as c:
        video = {"prompt": "waves", "size": "32x32", "num_frames": 5}
        done = c.post("/v1/videos", json={**video, "num_inference_steps": 2}).json()
        wait_for(lambda: c.get(f"/v1/videos/{done['id']}").json()["status"] == "completed", 30, "video completed")
        url = image(c, response_format="url").json()["data"][0]["url"]
        running = c.post("/v1/videos", json={**video, "num_inference_steps": 50}).json()
        wait_for(lambda: c.get(f"/v1/videos/{running['id']}").json()["step"] >= 1, 30, "second video denoising")
        mp4 = c.get(f"/v1/videos/{done['id']}/content").content

        dep.head.kill()  # no drain: as if its node died
        dep.start_head()
        wait_until_ready(dep, 3, 60)

        assert c.get(f"/v1/videos/{done['id']}").json()["status"] == "completed"
        assert c.get(f"/v1/videos/{done['id']}/content").content == mp4
        png = c.get(url)
        assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
        # The dead head's lease on its running job (renewed while it lived) must run out first: until
        # then another head could still be running it (replicated heads share the store). Then the
        # new head runs it again from the start (50 steps of 0.1 s).
        deadline = time.monotonic() + JOB_LEASE_S + 60
        while (job := c.get(f"/v1/videos/{running['id']}").json())["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"the dead head's job was not run again: {job}\n{dep.head.tail()}"
            time.sleep(0.2)
        assert job["status"] == "completed" and job["restarts"] == 1, job
        assert c.get(f"/v1/videos/{running['id']}/content").content[4:8] == b"ftyp"
        assert {j["id"] for j in c.get("/v1/videos").json()["data"]} == {done["id"], running["id"]}
