"""A head's drain waits for the HTTP requests it let in before their admission, not only for those its
core holds: a request waiting on another head's run of its Idempotency-Key when SIGTERM comes gets
that run's answer. Before, the core held nothing, so the drain ended at once and uvicorn cut the
request off after its flush time with a bare 500.

The head runs in a child process (this file run as a script: SIGTERM reaches its main thread, as in
`triptych serve`), with a real DiffusionServer, HTTP server and drain; no worker is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from triptych_dev.localdeploy import free_port_block

KEY = "k-drain"
PORTS = 8  # HTTP, the scheduler's six, the worker's
ANSWER = {"created": 1, "data": [{"b64_json": "AAAA"}]}


def _record(folder: Path) -> tuple[Path, Path]:
    from triptych_head.idempotency import Idempotency

    digest = Idempotency.digest(hashlib.sha256(b"").hexdigest(), KEY)  # the scope of a request without a key
    return folder / "idempotency" / f"{digest}.0.json", folder / "idempotency" / f"{digest}.0.response"


def test_a_request_waiting_on_another_head_s_run_when_sigterm_comes_gets_its_answer(tmp_path: Path) -> None:
    record, response = _record(tmp_path)
    record.parent.mkdir(parents=True)
    lease = time.time() + 300  # another head runs the key now, and renews its lease
    record.write_text(json.dumps({"state": "running", "fingerprint": "", "head": "other", "lease_until": lease}))
    port = free_port_block(PORTS)
    head = subprocess.Popen(
        [sys.executable, __file__, str(tmp_path), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert head.poll() is None and time.monotonic() < deadline, "the head did not start"
            time.sleep(0.1)
        answered: dict[str, httpx.Response] = {}

        def post() -> None:
            body = {"prompt": "cat", "size": "32x32"}
            url = f"http://127.0.0.1:{port}/v1/images/generations"
            answered["r"] = httpx.post(url, json=body, headers={"Idempotency-Key": KEY}, timeout=60)

        client = threading.Thread(target=post)
        client.start()
        time.sleep(1.0)  # the request waits on the other run
        head.send_signal(signal.SIGTERM)
        time.sleep(7.0)  # longer than the HTTP server's flush time (shutdown.FLUSH_S) after a drain
        response.write_text(json.dumps(ANSWER))
        record.write_text(json.dumps({"state": "done", "fingerprint": "", "head": "other", "lease_until": 0}))
        client.join(60)
        assert head.wait(60) == 0
    finally:
        head.kill()
        output = head.communicate()[0].decode(errors="replace")
    r = answered.get("r")
    assert r is not None and r.status_code == 200, (r.status_code if r else None, r.text if r else None, output[-3000:])
    assert r.json() == ANSWER and r.headers.get("Idempotent-Replayed") == "true"


def _serve(folder: str, port: int) -> None:
    """The head as `triptych serve --disagg-role server` builds it (head/triptych_head/main.py), with a
    worker address nobody answers on: HTTP on `port`, the scheduler's ports from `port` + 1 (six of
    them), the worker on the last of the block of PORTS."""
    from triptych.cli import build_parser
    from triptych.config import ServeArgs
    from triptych.families import ModelInfo
    from triptych_head.api.app import create_app
    from triptych_head.api.context import HeadContext
    from triptych_head.backend import LocalClient
    from triptych_head.http_socket import bind_http
    from triptych_head.metrics import HeadMetrics
    from triptych_head.server import DiffusionServer
    from triptych_head.shutdown import disaggregated_drain, serve_http

    argv = ["serve", "--model-path", "m", "--disagg-role", "server", "--scheduler-port", str(port + 1),
            "--denoiser-urls", f"tcp://127.0.0.1:{port + PORTS - 1}", "--port", str(port), "--output-path", folder,
            "--disagg-drain-timeout", "60"]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    sock = bind_http(args)
    server = DiffusionServer(args, HeadMetrics())
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    model = ModelInfo("tiny", "FluxPipeline", "image", 4, 3.5)
    ctx = HeadContext(backend=LocalClient(server.local), model=model, output_path=Path(folder),
                      registry=server.metrics.registry, drain_seconds=60)  # fmt: skip
    drain, hurry = disaggregated_drain(server, loop, ctx)
    serve_http(create_app(ctx), ctx, args, sock, drain, hurry)
    server.stop()
    loop.join(5)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _serve(sys.argv[1], int(sys.argv[2]))
