"""Cold start per role vs monolithic: process start to first request served, phase by phase.

    python bench/cold_start_bench.py [--model tiny-flux] [--rounds 3] [--split-encoders]
                                     [--full-size [--full-size-dir DIR]] [--json PATH]

Each round starts, one at a time, a monolithic `triptych serve` and a cold worker of each role as
real processes (ordinary processes: no preloaded interpreter), on the same model:

- monolithic, with nothing else of the benchmark running: from its process start until /health
  answers (ready), then one request; served is when its answer is complete.
- each role in turn: a disaggregated deployment (head and one warm worker per role, which have
  served one request) runs for the rest of the round; the role's warm worker is killed, and once
  the head has given it up, a cold one is started on the same port. Ready is when its log has
  its start-up line (its first heartbeat went to the head; polling the head's /health instead
  would take CPU from the process being timed); then the same request, through the head and the
  warm other roles; served is when its answer is complete.

So "served" counts one request end to end on both sides (every stage in the monolithic process;
through the head and the other roles for a role). The phases inside each process are its own
start-up line (triptych.startup: re-execution under the bind shim, flags parsed, torch/diffusers
imported, weights loaded, Mooncake registered, listening, first heartbeat), all in seconds since
the process started. Prints, per process kind, the median of each phase's duration, the time to
ready and to served, the ratio of served to monolithic's, and the share of the package's weight
bytes it loads (and its weight-load time against monolithic's).

`--model` is a tiny package's name or a package directory; `--split-encoders` (a FLUX.1 Kontext
package) times prompt_encoder and image_encoder instead of encoder, with the same text-to-image
request (the image encoder's stage passes it through). `--full-size` uses a random-weight
package of the Wan2.1-T2V-1.3B shape in bfloat16 (bench/random_wan.py: real-size transformer and
VAE, a 4096-wide 2-layer text encoder), written once to `--full-size-dir` (minutes on a CPU,
about 4 GB). Every process runs with OMP_NUM_THREADS=1 (`--omp-threads`), as pipeline_bench does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from triptych import startup  # noqa: E402
from triptych.roles import COMBINED_ROLES, Role  # noqa: E402
from triptych_dev.localdeploy import LocalDeployment, free_port_block, local_deployment  # noqa: E402
from triptych_dev.tiny_models import write_tiny_models  # noqa: E402

MONOLITHIC = "monolithic"
SPLIT_ROLES = (Role.PROMPT_ENCODER, Role.IMAGE_ENCODER, Role.DENOISER, Role.DECODER)
HEARTBEAT_TIMEOUT_S = 2.0  # the head's: how soon it gives up a killed worker (heartbeats come every second)
POLL_S = 0.02
READY_LIMIT_S = 900.0
# Durations printed, each from the previous phase reached to this one (absent phases are skipped).
STEPS = ("reexec", "started", "imported", "loaded", "transfer", "listening", "registered", "ready", "served")


def weight_bytes(model: Path, components: set[str]) -> int:
    """Bytes of the weight files of `components` in the package."""
    suffixes = (".safetensors", ".bin", ".pt", ".pth")
    return sum(
        f.stat().st_size for c in components for f in (model / c).rglob("*") if f.is_file() and f.suffix in suffixes
    )


def loaded_components(model: Path, role: Role) -> set[str]:
    """The components `role` loads (as the worker decides: triptych_worker.pipeline)."""
    from triptych_worker.adapters import adapter_for
    from triptych_worker.pipeline import role_components, role_stages

    family, adapter = adapter_for(str(model))
    return role_components(adapter, role_stages(role, family))


def request_body(model: Path, size: str, steps: int, frames: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": "a lighthouse at dusk", "size": size, "seed": 1, "num_inference_steps": steps}
    if json.loads((model / "model_index.json").read_text())["_class_name"] == "WanPipeline":
        body.update(num_frames=frames, guidance_scale=1.0)  # one transformer pass per step
    return body


def serve_one(url: str, body: dict[str, Any]) -> None:
    """One request until its pixels are ready: an image's answer, or a video job's completion."""
    with httpx.Client(base_url=url, timeout=READY_LIMIT_S) as client:
        if "num_frames" not in body:
            client.post("/v1/images/generations", json=body).raise_for_status()
            return
        job = client.post("/v1/videos", json=body).raise_for_status().json()
        deadline = time.monotonic() + READY_LIMIT_S
        while job["status"] not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(POLL_S)
            job = client.get(f"/v1/videos/{job['id']}").raise_for_status().json()
        if job["status"] != "completed":
            raise RuntimeError(f"video job {job['id']} {job['status']}: {job}")


def wait_for(what: str, check: Callable[[], bool], alive: Callable[[], bool], log: Path) -> None:
    deadline = time.monotonic() + READY_LIMIT_S
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what}: the process exited:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if check():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"{what}: not within {READY_LIMIT_S:.0f}s")


def phases_from(log: Path, started_at: float, ready_at: float, served_at: float) -> dict[str, float]:
    """The process's own phases plus ready and served, all in seconds since its start."""
    phases = startup.parse_line(log.read_text(errors="replace"))
    if phases is None:
        raise RuntimeError(f"{log}: no start-up line")
    return {**phases, "ready": ready_at - started_at, "served": served_at - started_at}


def cold_monolithic(model: Path, workdir: Path, body: dict[str, Any], i: int) -> dict[str, float]:
    port = free_port_block(1)
    log = workdir / f"monolithic-{i}.log"
    argv = [sys.executable, "-m", "triptych", "serve", "--model-path", str(model), "--port", str(port),
            "--device", "cpu", "--output-path", str(workdir / "outputs")]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("monolithic", lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
                 lambda: proc.poll() is None, log)  # fmt: skip
        ready = time.monotonic()
        serve_one(url, body)
        served = time.monotonic()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    return phases_from(log, t0, ready, served)


def role_count(dep: LocalDeployment, role: Role, key: str) -> int:
    workers = httpx.get(f"{dep.http}/health", timeout=2).json()["workers"]
    return sum(bool(w[key]) for w in workers.get(role.value, []))


def cold_role(dep: LocalDeployment, role: Role, body: dict[str, Any]) -> dict[str, float]:
    """Replace `role`'s warm worker with a cold one; its phases, ready and served."""
    (warm,) = dep.workers(role)
    dep.stop_worker(warm, drain=False)
    wait_for(f"{role.value} given up", lambda: role_count(dep, role, "alive") == 0, lambda: True, warm.log)
    t0 = time.monotonic()
    cold = dep.start_worker(role)
    alive = lambda: cold.popen.poll() is None  # noqa: E731
    # Its own start-up line says it has sent its first heartbeat: read from its log, as polling the
    # head's /health this often would take CPU from the process being timed.
    wait_for(f"cold {role.value}", lambda: "registered" in (startup.parse_line(cold.log.read_text()) or {}),
             alive, cold.log)  # fmt: skip
    ready = time.monotonic()
    serve_one(dep.http, body)
    served = time.monotonic()
    return phases_from(cold.log, t0, ready, served)


def record(runs: dict[str, list[dict[str, float]]], i: int, kind: str, phases: dict[str, float]) -> None:
    runs[kind].append(phases)
    print(f"  round {i + 1} {kind:15s} ready {phases['ready']:7.2f} s  served {phases['served']:7.2f} s", flush=True)


def durations(phases: dict[str, float]) -> dict[str, float]:
    """Each phase reached, as the time since the previous one (the first: since the process start)."""
    out, before = {}, 0.0
    for step in STEPS:
        if step in phases:
            out[step] = phases[step] - before
            before = phases[step]
    return out


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in STEPS if all(k in r for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-flux", help="a tiny package's name or a package directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--split-encoders", action="store_true", help="prompt_encoder and image_encoder, not encoder")
    p.add_argument("--full-size", action="store_true", help="a Wan2.1-1.3B-shaped random-weight package instead")
    p.add_argument("--full-size-dir", type=Path, default=ROOT / ".models" / "random-wan-1.3b-bf16")
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--frames", type=int, default=5, help="frames per video (Wan packages)")
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS of every process ('default': unset)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "cold_start.json")
    args = p.parse_args()
    if args.full_size:
        sys.path.insert(0, str(HERE))
        from random_wan import write_random_wan

        print(f"full-size package: {args.full_size_dir} (written once; minutes on a CPU)", flush=True)
        model = write_random_wan(args.full_size_dir, dtype="bfloat16")
    elif Path(args.model).is_dir():
        model = Path(args.model)
    else:
        (model,) = write_tiny_models(ROOT / ".models", families=[args.model])
    if args.omp_threads == "default":
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = args.omp_threads
    roles = SPLIT_ROLES if args.split_encoders else COMBINED_ROLES
    body = request_body(model, args.size, args.steps, args.frames)
    kinds = [MONOLITHIC, *(r.value for r in roles)]
    total = weight_bytes(model, loaded_components(model, Role.MONOLITHIC))
    shares = {kind: weight_bytes(model, loaded_components(model, Role(kind))) / total for kind in kinds}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    print(f"{model.name}: {total / 2**20:.1f} MiB of weights; request {body}; {args.rounds} rounds, "
          f"OMP_NUM_THREADS={args.omp_threads}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for i in range(args.rounds):
            # Monolithic first, with nothing else of ours running; then the roles, each with the others warm.
            record(runs, i, MONOLITHIC, cold_monolithic(model, workdir, body, i))
            with local_deployment(
                model, workdir / f"disagg-{i}", counts=dict.fromkeys(roles, 1),
                head_flags=("--disagg-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)),
                worker_flags=("--device", "cpu"), ready_timeout=READY_LIMIT_S,
            ) as dep:  # fmt: skip
                serve_one(dep.http, body)  # the warm roles have served once
                for role in roles[i % len(roles) :] + roles[: i % len(roles)]:  # each role first in some round
                    record(runs, i, role.value, cold_role(dep, role, body))
    report(kinds, runs, shares)
    result = {
        "model": str(model), "rounds": args.rounds, "request": body, "omp_threads": args.omp_threads,
        "weight_bytes": total, "shares": shares, "runs": runs,
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


def report(kinds: list[str], runs: dict[str, list[dict[str, float]]], shares: dict[str, float]) -> None:
    steps = [s for s in STEPS if any(s in median_of([durations(r) for r in runs[k]]) for k in kinds)]
    print("\nmedian seconds per phase (each since the previous one), and totals since the process start")
    print(f"{'':15s}" + "".join(f"{s:>11s}" for s in steps) + f"{'served/mono':>13s}{'weights':>9s}{'load/mono':>11s}")
    mono = median_of(runs[MONOLITHIC])
    mono_load = median_of([durations(r) for r in runs[MONOLITHIC]]).get("loaded", 0.0)
    for kind in kinds:
        each = median_of([durations(r) for r in runs[kind]])
        total = median_of(runs[kind])
        load = each.get("loaded", 0.0)
        load_ratio = f"{load / mono_load:11.2f}" if mono_load else f"{'-':>11s}"
        print(f"{kind:15s}" + "".join(f"{each[s]:11.3f}" if s in each else f"{'-':>11s}" for s in steps)
              + f"{total['served'] / mono['served']:13.2f}{shares[kind]:9.0%}{load_ratio}")  # fmt: skip
    print("\nratio of served to monolithic's served (same run):")
    for kind in kinds[1:]:
        print(f"  {kind:15s} {median_of(runs[kind])['served'] / mono['served']:.2f}x   "
              f"ready {median_of(runs[kind])['ready'] / mono['ready']:.2f}x of monolithic's")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
