"""Simulated workers in a real deployment: requests complete through the real transfer path, and a
worker started or drained while the head runs joins or leaves (tests/e2e/harness.py helpers)."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.harness import deployment
from triptych.roles import Role

pytestmark = pytest.mark.slow

INSTANT = ("--simulate-seconds", "0", "--simulate-seconds-per-unit", "0")
# A drain lasts until the head acknowledges it, or --disagg-drain-timeout: long here, so that an idle
# worker's drain ending well before it shows that the acknowledgement ended it.
DRAIN_TIMEOUT_S = 60
FAST = {Role.ENCODER: INSTANT, Role.DENOISER: (*INSTANT, "--disagg-drain-timeout", str(DRAIN_TIMEOUT_S)),
        Role.DECODER: INSTANT}  # fmt: skip


def alive(c, role: Role) -> int:
    return sum(w["alive"] for w in c.get("/health").json()["workers"][role.value])


def test_a_simulated_deployment_serves_images_and_takes_a_worker_added_and_one_drained(tiny_models, tmp_path):
    flux, spare = tiny_models["tiny-flux"], {Role.DENOISER: 1}
    with deployment(flux, tmp_path, simulate=True, role_flags=FAST, spare=spare) as dep:
        with dep.client(timeout=30) as c:
            body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2, "seed": 1}
            r = c.post("/v1/images/generations", json=body)
            assert r.status_code == 200, r.text
            image = np.array(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
            assert image.shape == (32, 64, 3) and not image.any()  # the simulated decoder's black pixels

            added = dep.start_worker(Role.DENOISER)
            deadline = time.monotonic() + 20
            while alive(c, Role.DENOISER) < 2:
                assert time.monotonic() < deadline, f"the added denoiser never joined:\n{added.tail()}"
                time.sleep(0.2)
            assert c.post("/v1/images/generations", json=body).status_code == 200

            started = time.monotonic()
            # SIGTERM: drained, exit 0. Idle, it exits once the head acknowledged (about a second; a few
            # on a loaded machine), in any case well before its drain timeout.
            assert dep.stop_worker(added, drain=True, timeout=DRAIN_TIMEOUT_S / 2) == 0
            took = time.monotonic() - started
            assert took < DRAIN_TIMEOUT_S / 2, f"the idle worker took {took:.1f}s from SIGTERM to its exit"
            assert dep.spare[Role.DENOISER] == [int(added.url.rsplit(":", 1)[1])]  # free for start_worker again
            deadline = time.monotonic() + 20
            while alive(c, Role.DENOISER) > 1:  # the head lets it go (at the latest when its heartbeats stop)
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert c.post("/v1/images/generations", json=body).status_code == 200


def sent(c, kind: str) -> float:
    """How many `kind` messages the head has sent to workers (its /metrics)."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'triptych_worker_messages_sent_total{{type="{kind}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_receivers_reserve_standing_slots_at_start_up_so_no_hop_waits_for_an_allocation(tiny_models, tmp_path):
    """Sized for a request at the API's defaults (1024x1024 here): that request and smaller ones go
    straight to pushes from the first on; a larger one takes the transfer_alloc path."""
    with deployment(tiny_models["tiny-flux"], tmp_path, simulate=True, role_flags=FAST) as dep:
        with dep.client(timeout=60) as c:
            workers = c.get("/health").json()["workers"]
            for role in (Role.DENOISER, Role.DECODER):
                (w,) = workers[role.value]
                assert w["standing_bytes"] > 0 and w["free_bytes"] + w["standing_bytes"] == w["pool_bytes"], w
            assert workers[Role.ENCODER.value][0]["standing_bytes"] == 0, "an encoder receives nothing"
            for size in ("1024x1024", "64x32", "1024x1024"):
                body = {"prompt": "x", "size": size, "num_inference_steps": 1}
                assert c.post("/v1/images/generations", json=body).status_code == 200
            assert sent(c, "transfer_push") == 6, "two hops for each of three requests"
            assert sent(c, "transfer_alloc") == 0, "every hop fit a standing slot reserved at start-up"
            body = {"prompt": "x", "size": "1536x1536", "num_inference_steps": 1}
            assert c.post("/v1/images/generations", json=body).status_code == 200
            assert sent(c, "transfer_alloc") >= 1, "larger latents than a default request's need an allocation"


def test_a_request_for_a_role_without_workers_waits_for_one_to_start_as_scale_from_zero_needs(tiny_models, tmp_path):
    """A pool at zero (scaled to zero while idle, autoscaling.md#scale-to-zero): the first request
    waits for a worker to come up, however long the role has had none, and is served by it."""
    flux = tiny_models["tiny-flux"]
    wait = ("--disagg-no-instance-wait", "4")
    with deployment(flux, tmp_path, simulate=True, role_flags=FAST, denoisers=0, spare={Role.DENOISER: 1},
                    head_flags=wait) as dep:  # fmt: skip
        with dep.client(timeout=60) as c:
            time.sleep(5)  # the role has had no instance for longer than the wait, with nothing waiting for it
            body = {"prompt": "x", "size": "64x32", "num_inference_steps": 2, "seed": 1}
            answers: list[httpx.Response] = []
            asking = threading.Thread(target=lambda: answers.append(c.post("/v1/images/generations", json=body)))
            asking.start()
            time.sleep(1.5)
            assert not answers, f"answered before any denoiser existed: {answers[0].text}"
            woken = dep.start_worker(Role.DENOISER)  # what the operator's wake-up starts, as a pod
            asking.join(60)
            assert answers and answers[0].status_code == 200, answers[0].text if answers else woken.tail()
