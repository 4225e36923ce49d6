"""The control and transfer planes with zero-compute stages: real processes, ZMQ and Mooncake.

Workers run `triptych_dev.null_pipeline` (real sockets, pool and Mooncake transfers, no
model compute), so these tests exercise the head's routing, dispatch and failure handling fast.
"""

from __future__ import annotations

import base64
import concurrent.futures
import re
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.e2e.harness import deployment
from triptych.params import GenerationParams
from triptych.protocol import RequestEvent, RequestResult, Submit, decode, encode
from triptych.protocol.codec import PROTOCOL_VERSION
from triptych.roles import Role
from triptych.security import ControlPlane, Side, load_keys
from triptych_dev.localdeploy import LocalDeployment
from triptych_worker.transfer.waiting import TIMER_SLACK_NS

pytestmark = pytest.mark.slow

SLOW_DENOISER = ("--step-seconds", "0.03")  # so a request is still running when the test pokes at it
SLOWER_DENOISER = ("--step-seconds", "0.2")  # 500 steps (the API's maximum) take 100 s


@pytest.fixture(scope="module")
def flux(tiny_models):
    return tiny_models["tiny-flux"]


def image(c, **extra):
    body = {"prompt": "a red square", "size": "32x32", "seed": 1, "num_inference_steps": 2, **extra}
    return c.post("/v1/images/generations", json=body)


def metric(c, name: str) -> float:
    text = c.get("/metrics").text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


def test_image_request_flows_through_all_roles(flux, tmp_path):
    with deployment(flux, tmp_path, null_payload=4096) as dep, dep.client() as c:
        r = image(c)
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\x89PNG")
        assert metric(c, "triptych_transfer_bytes_total") >= 2 * 4096
        # Workers sleep precisely between the polls of their writes (transfer/waiting.py).
        workers = [p for p in dep.procs if p.role is not Role.SERVER]
        assert len(workers) == 3
        for p in workers:
            assert Path(f"/proc/{p.popen.pid}/timerslack_ns").read_text().strip() == str(TIMER_SLACK_NS), p.role


def test_workers_started_before_the_head_join_without_restarts(flux, tmp_path):
    with deployment(flux, tmp_path, null_payload=4096, head_first=False) as dep, dep.client() as c:
        assert image(c).status_code == 200


@pytest.mark.parametrize("policy", ["round_robin", "max_free_slots"])
def test_concurrent_requests_spread_over_instances(flux, tmp_path, policy):
    flags = ("--disagg-dispatch-policy", policy)
    with deployment(flux, tmp_path, encoders=2, denoisers=2, null_payload=4096, head_flags=flags) as dep:
        with dep.client() as c, concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: image(c), range(16)))
            assert [r.status_code for r in results] == [200] * 16
            workers = c.get("/health").json()["workers"]
    for role, n in (("encoder", 2), ("denoiser", 2), ("decoder", 1)):
        dispatched = [w["dispatched"] for w in workers[role]]
        assert len(dispatched) == n and sum(dispatched) == 16
        assert min(dispatched) > 0, f"{policy}: {role} work not spread: {dispatched}"


@pytest.mark.parametrize("small", [Role.ENCODER, Role.DENOISER], ids=["sender-pool", "receiver-pool"])
def test_payload_larger_than_the_pool_fails_that_request_naming_the_flag(flux, tmp_path, small):
    pool = {small: ("--disagg-transfer-pool-size", "1MiB")}
    with deployment(flux, tmp_path, null_payload=2 * 1024 * 1024, role_flags=pool) as dep, dep.client() as c:
        r = image(c)
        assert r.status_code == 413, r.text
        message = r.json()["error"]["message"]
        assert "--disagg-transfer-pool-size" in message and small.value in message
        ok = c.post("/v1/images/generations", json={"prompt": "x", "size": "32x32"})
        assert ok.status_code == 413  # same payload, same answer: nothing got stuck
        assert c.get("/health").json()["workers"]["encoder"][0]["free_slots"] == 2


def _frontend(dep, ctx):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.connect(f"tcp://127.0.0.1:{dep.scheduler_port}")
    return sock


def _recv_until_terminal(sock):
    while True:
        msg, _ = decode(sock.recv_multipart())
        if isinstance(msg, RequestResult) or msg.error is not None:
            return msg


def test_only_a_watching_client_hears_state_changes_and_steps(flux, tmp_path):
    params = {"prompt": "x", "width": 32, "height": 32, "num_inference_steps": 3}
    slow = {Role.DENOISER: SLOW_DENOISER}
    with deployment(flux, tmp_path, null_payload=4096, role_flags=slow) as dep:
        ctx = zmq.Context()
        front = _frontend(dep, ctx)
        try:
            front.send_multipart(encode(Submit("quiet", params)))
            first, _ = decode(front.recv_multipart())
            assert isinstance(first, RequestResult), first  # the outcome only, no RequestEvent before it
            # Each role's time as its worker spent it, inside the time the head saw for that hop.
            timings = first.timings
            for role in ("encoder", "denoiser", "decoder"):
                assert 0 < timings[f"worker_{role}"] <= timings[role], (role, timings)
            assert timings["worker_denoiser"] >= 3 * 0.03  # three simulated steps
            assert timings["total"] >= sum(timings[role] for role in ("encoder", "denoiser", "decoder"))

            front.send_multipart(encode(Submit("watched", params, watch=True)))
            events = []
            while not isinstance(msg := decode(front.recv_multipart())[0], RequestResult):
                events.append(msg)
            states = [e.state for e in events]
            assert states[0] == "ENCODER_WAITING" and states[-1] == "DECODER_RUNNING"
            assert list(dict.fromkeys(states)) == [
                "ENCODER_WAITING", "ENCODER_RUNNING", "DENOISING_WAITING", "DENOISING_RUNNING",
                "DECODER_WAITING", "DECODER_RUNNING",
            ]  # fmt: skip
            steps = [(e.step, e.total_steps) for e in events if e.total_steps]
            assert steps == [(1, 3), (2, 3), (3, 3)]
        finally:
            front.close()
            ctx.term()


def test_duplicate_active_request_id_is_rejected_without_touching_the_original(flux, tmp_path):
    params = {"prompt": "x", "width": 32, "height": 32, "num_inference_steps": 50}
    with deployment(flux, tmp_path, null_payload=4096, worker_flags=SLOW_DENOISER) as dep:
        ctx = zmq.Context()
        first, second = _frontend(dep, ctx), _frontend(dep, ctx)
        try:
            first.send_multipart(encode(Submit("dup-1", params)))
            time.sleep(0.05)
            second.send_multipart(encode(Submit("dup-1", params)))
            rejected = _recv_until_terminal(second)
            assert isinstance(rejected, RequestEvent) and rejected.status_code == 409
            assert "already active" in rejected.error
            assert isinstance(_recv_until_terminal(first), RequestResult)
        finally:
            first.close()
            second.close()
            ctx.term()


class KeyedPeer:
    """PUSH sockets holding one side's keys of a deployment: a buggy worker ("worker") or head ("head").
    A peer without the keys gets nothing through the CURVE handshake (tests/e2e/test_security.py)."""

    def __init__(self, dep: LocalDeployment, side: Side):
        assert dep.keys_dir is not None
        self.ctx = zmq.Context()
        self.plane = ControlPlane(self.ctx, load_keys(dep.keys_dir, side))

    def push(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        self.plane.client(sock)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        self.plane.close()
        self.ctx.term()


def test_garbage_frames_on_every_socket_change_nothing_else(flux, tmp_path):
    with deployment(flux, tmp_path, null_payload=4096) as dep, dep.client() as c:
        ctx = zmq.Context()
        as_worker, as_head = KeyedPeer(dep, "worker"), KeyedPeer(dep, "head")
        try:
            pack = msgspec.msgpack.encode
            garbage = [[b"\xff\x00garbage"], [b""], [pack({"v": PROTOCOL_VERSION, "type": "heartbeat"})],
                       [pack({"v": 7, "type": "x"}), b"frame"],
                       # well-formed, but the wrong message for the socket, or a negative size
                       encode(Submit("stray", GenerationParams("x", 32, 32))),
                       [pack({"type": "transfer_alloc", "request_id": "r", "instance": "i", "nbytes": -1})],
                       ]  # fmt: skip
            targets = [(f"tcp://127.0.0.1:{dep.scheduler_port + i}", as_worker) for i in (1, 2, 3)]
            targets += [(w.url, as_head) for w in dep.procs if w.role is not Role.SERVER]
            for target, peer in targets:
                push = peer.push(target)
                for parts in garbage:
                    push.send_multipart(parts)
                push.close(linger=2000)
            front = _frontend(dep, ctx)
            front.send_multipart([b"\x93\x01"])
            assert _recv_until_terminal(front).status_code == 400
            front.close()
            time.sleep(0.5)
            assert image(c).status_code == 200
            assert all(p.popen.poll() is None for p in dep.procs)
            assert metric(c, "triptych_dropped_messages_total") >= 3 * len(garbage)
        finally:
            as_worker.close()
            as_head.close()
            ctx.term()


def test_malformed_message_with_a_request_id_fails_only_that_request(flux, tmp_path):
    params = {"prompt": "x", "width": 32, "height": 32, "num_inference_steps": 100}
    with deployment(flux, tmp_path, null_payload=4096, worker_flags=SLOW_DENOISER) as dep, dep.client() as c:
        ctx = zmq.Context()
        front = _frontend(dep, ctx)
        as_worker = KeyedPeer(dep, "worker")  # a buggy worker of the pipeline
        try:
            front.send_multipart(encode(Submit("victim", params)))
            time.sleep(0.2)
            push = as_worker.push(f"tcp://127.0.0.1:{dep.scheduler_port + 2}")
            bad = {"v": PROTOCOL_VERSION, "type": "progress", "request_id": "victim", "instance": 5}
            push.send_multipart([msgspec.msgpack.encode(bad)])
            push.close(linger=2000)
            failed = _recv_until_terminal(front)
            assert isinstance(failed, RequestEvent) and failed.state == "FAILED"
            assert "malformed" in failed.error
            assert image(c).status_code == 200
        finally:
            front.close()
            as_worker.close()
            ctx.term()


def test_without_retries_killing_a_denoiser_fails_only_its_requests_and_the_head_keeps_serving(flux, tmp_path):
    worker_flags = ("--step-seconds", "0.05")  # 40 steps: each request denoises for ~2 s
    # With retries (the default) nothing fails: tests/e2e/test_elastic_pools.py.
    head_flags = ("--disagg-heartbeat-timeout", "3", "--disagg-timeout", "60", "--disagg-max-retries", "0")
    with deployment(flux, tmp_path, denoisers=2, null_payload=4096, head_flags=head_flags,
                    worker_flags=worker_flags) as dep, dep.client() as c:  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(image, c, num_inference_steps=40) for _ in range(4)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # wait until both denoisers hold work
                denoisers = c.get("/health").json()["workers"]["denoiser"]
                if all(d["dispatched"] > 0 for d in denoisers):
                    break
                time.sleep(0.05)
            victim = dep.workers(Role.DENOISER)[0]
            killed_at = time.monotonic()
            victim.kill()
            results = [f.result(timeout=60) for f in futures]
        codes = sorted(r.status_code for r in results)
        assert 200 in codes and any(code >= 500 for code in codes), codes
        for r in results:
            if r.status_code != 200:
                message = r.json()["error"]["message"]
                assert victim.url in message, message
                # Which words depends on where the request was when the process died; each names the dead worker.
                causes = ("stopped responding", "became unreachable", "transfer to denoiser", "is not connected")
                assert any(cause in message for cause in causes), message
                assert "gave up after 0 retries" in message or "transfer to denoiser" in message, message
        took = time.monotonic() - killed_at
        # The lost heartbeats (3 s) fail its requests and the others finish (~2 s each): seconds, not
        # the --disagg-timeout (60 s) that a head missing the loss would wait for.
        assert took < 30, f"the last request ended {took:.1f}s after the kill"
        assert image(c).status_code == 200  # the head keeps serving on the remaining denoiser
        alive = {d["url"]: d["alive"] for d in c.get("/health").json()["workers"]["denoiser"]}
        assert alive[victim.url] is False


def assert_all_capacity_released(c) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 10
    while True:
        workers = [w for ws in c.get("/health").json()["workers"].values() for w in ws]
        # Kept receive slots stay reserved by design; every other byte must be back in the pool.
        if all(
            w["free_slots"] == w["capacity"] and w["free_bytes"] + w["standing_bytes"] == w["pool_bytes"]
            for w in workers
        ):
            return
        assert time.monotonic() < deadline, f"capacity or pool bytes still held: {workers}"
        time.sleep(0.1)


def test_a_worker_error_fails_only_its_request_and_releases_slots_and_buffers(flux, tmp_path):
    flags = (*SLOW_DENOISER, "--fail-prompt-prefix", "fail:")
    with deployment(flux, tmp_path, null_payload=4096, worker_flags=flags) as dep, dep.client() as c:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bad = pool.submit(image, c, prompt="fail:denoiser", num_inference_steps=5)
            good = [pool.submit(image, c, num_inference_steps=5) for _ in range(3)]
            r = bad.result(60)
            assert r.status_code == 500 and "failed on purpose" in r.json()["error"]["message"]
            assert [g.result(60).status_code for g in good] == [200] * 3
        assert_all_capacity_released(c)


def test_a_request_past_the_timeout_is_timed_out_and_its_capacity_released(flux, tmp_path):
    flags = ("--disagg-timeout", "1.5")
    with deployment(flux, tmp_path, null_payload=4096, head_flags=flags, worker_flags=SLOWER_DENOISER) as dep:
        with dep.client() as c:
            started = time.monotonic()
            r = image(c, num_inference_steps=500)  # ~100 s of denoising
            took = time.monotonic() - started
            assert r.status_code == 504, r.text
            assert "--disagg-timeout" in r.json()["error"]["message"]
            # The timeout (1.5 s) plus an upkeep tick, not the 100 s the denoiser would take.
            assert took < 30, f"the 504 came {took:.1f}s after the request"
            assert_all_capacity_released(c)
            assert image(c).status_code == 200


def test_cancelling_a_video_stops_it_on_the_workers(tiny_models, tmp_path):
    wan = tiny_models["tiny-wan"]
    with deployment(wan, tmp_path, null_payload=4096, worker_flags=SLOWER_DENOISER) as dep, dep.client() as c:
        body = {"prompt": "x", "size": "32x32", "num_frames": 5, "num_inference_steps": 500}  # ~100 s of work
        job = c.post("/v1/videos", json=body).json()
        deadline = time.monotonic() + 20
        while c.get(f"/v1/videos/{job['id']}").json()["step"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelled = c.delete(f"/v1/videos/{job['id']}").json()
        assert cancelled["status"] == "cancelled"
        assert_all_capacity_released(c)
        assert c.get(f"/v1/videos/{job['id']}/content").status_code == 409
        # The denoiser really stopped: ~100 s of cancelled work does not delay the next request, which
        # takes a second or two (0.2 s of denoising).
        started = time.monotonic()
        r = c.post("/v1/videos", json={**body, "num_inference_steps": 1}).json()
        while c.get(f"/v1/videos/{r['id']}").json()["status"] != "completed":
            took = time.monotonic() - started
            assert took < 30, f"the cancelled request kept the denoiser busy: not done after {took:.1f}s"
            time.sleep(0.05)


def test_a_tight_receive_pool_never_deadlocks_against_its_own_outputs(flux, tmp_path):
    # A reserved 1.2 MiB input plus a 1.2 MiB output do not fit a 2 MiB denoiser pool: accepting the
    # next request's input while one runs would leave the denoiser unable to stage its output, and
    # the slot it waits on belongs to the request queued behind it.
    pools = {Role.DENOISER: ("--disagg-transfer-pool-size", "2MiB")}
    flags = ("--disagg-timeout", "30")
    with deployment(flux, tmp_path, null_payload=1_258_291, role_flags=pools, head_flags=flags,
                    worker_flags=("--step-seconds", "0.01")) as dep, dep.client() as c:  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = [f.status_code for f in pool.map(lambda _: image(c, num_inference_steps=3), range(6))]
        assert codes == [200] * 6
        assert_all_capacity_released(c)


def test_workers_found_through_dns_names(flux, tmp_path):
    # dns://localhost:PORT stands for every address localhost resolves to (127.0.0.1, maybe ::1);
    # the head serves through the ones that answer, as it would through a headless Service.
    from triptych_dev.localdeploy import local_deployment

    with local_deployment(flux, tmp_path, worker_flags=("--device", "cpu"), null_payload_bytes=4096,
                          worker_url_scheme="dns://localhost") as dep, dep.client() as c:  # fmt: skip
        assert image(c).status_code == 200
        urls = [w["url"] for ws in c.get("/health").json()["workers"].values() for w in ws]
        assert any(u.startswith("tcp://127.0.0.1:") for u in urls)
