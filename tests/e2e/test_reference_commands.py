"""The reference design's command blocks as docs/reference-commands.md gives them, run from that page
with bash: each runs here (loopback, the tiny models under the blocks' hub ids in an offline Hugging
Face cache) or is refused at start-up with one line naming the flag and what to do instead.

Host addresses in the page are in 192.0.2.0/24 (documentation); host 192.0.2.N runs as 127.0.0.N,
which is loopback too. The blocks keep their ports, so these tests run one block at a time and stop
every process a block started (its own process group) before the next.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image

from triptych.reference_flags import REFERENCE_ONLY

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference-commands.md"
BLOCK = re.compile(r"<!-- reference-block: (?P<name>[^>]+?) -->\n```bash\n(?P<body>.*?)```", re.S)
START_S = 300  # a loaded 2-core machine starts seven torch processes in well under this
VIDEO_S = 300

pytestmark = pytest.mark.slow

# The defaults of a Wan request (81 frames, 50 steps) take minutes on a CPU with any model; the test
# adds these to the page's video bodies (docs/reference-commands.md says so).
SHORT_VIDEO = {"num_frames": 5, "num_inference_steps": 2}


def blocks() -> dict[str, str]:
    found = {m["name"]: m["body"] for m in BLOCK.finditer(PAGE.read_text())}
    assert found, f"no reference blocks in {PAGE}"
    return found


def on_loopback(text: str) -> str:
    return re.sub(r"\b192\.0\.2\.(\d+)\b", r"127.0.0.\1", text)


def hub_ids(text: str) -> set[str]:
    return set(re.findall(r"--model-path\s+\"?([\w.-]+/[\w.-]+)\b", text)) | set(
        re.findall(r"^MODEL_PATH=([\w.-]+/[\w.-]+)$", text, re.M)
    )


@pytest.fixture
def shell_env(tiny_models, tmp_path) -> dict[str, str]:
    """bash's environment: the venv's `triptych` first on PATH, and an offline hub cache holding the
    tiny package of each family under every hub id the page's blocks name."""
    home = tmp_path / "hf"
    for hub_id in set().union(*(hub_ids(b) for b in blocks().values())):
        family = "tiny-flux-kontext" if "Kontext" in hub_id else "tiny-wan" if "Wan" in hub_id else None
        if family is None:
            continue  # a refused block's model: never loaded
        repo = home / "hub" / f"models--{hub_id.replace('/', '--')}"
        shutil.copytree(tiny_models[family], repo / "snapshots" / "0123abcd")
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text("0123abcd")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CUDA_VISIBLE"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env['PATH']}", HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return env


@contextmanager
def started(script: str, env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run `script` with bash in its own process group (its `&` processes stay in it); stop the group."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        yield proc
    finally:
        _stop_group(proc)


def _stop_group(leader: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group (each `triptych serve` drains), SIGKILL what outlives the grace. The leader
    is reaped as it exits: a zombie still counts as a member of its group."""
    for sig, grace in ((signal.SIGTERM, 60.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(leader.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            leader.poll()
            try:
                os.killpg(leader.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def command(block: str, comment: str) -> str:
    """The command after the line `comment` in `block`, without its trailing `&`."""
    chunk = next(c for c in block.split("\n\n") if c.startswith(comment))
    return chunk.split("\n", 1)[1].rstrip().removesuffix("&").rstrip()


def wait_ready(url: str, roles: dict[str, int], log: Path) -> None:
    """Until the head at `url` has `roles[r]` ready instances of each role r."""
    deadline = time.monotonic() + START_S
    seen: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            view = httpx.get(f"{url}/v1/pipeline", timeout=5).json()
            seen = {r: sum(i["ready"] for i in view["roles"].get(r, {}).get("instances", [])) for r in roles}
            if seen == roles:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"not ready after {START_S} s: {seen} of {roles}\n{log.read_text()[-6000:]}")


def run_request(script: str, env: dict[str, str], cwd: Path) -> str:
    out = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=VIDEO_S)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def shorter_video(script: str) -> str:
    """The page's video request with SHORT_VIDEO's fields added to its JSON body."""
    body = re.search(r"-d '(\{.*\})'", script)
    assert body is not None, script
    longer = json.dumps({**json.loads(body[1]), **SHORT_VIDEO})
    return script.replace(body[0], f"-d '{longer}'")


def wait_video(url: str, job: dict[str, object], log: Path) -> bytes:
    deadline = time.monotonic() + VIDEO_S
    while (status := httpx.get(f"{url}/v1/videos/{job['id']}", timeout=10).json())["status"] != "completed":
        assert status["status"] not in ("failed", "cancelled"), f"{status}\n{log.read_text()[-6000:]}"
        assert time.monotonic() < deadline, f"{status}\n{log.read_text()[-6000:]}"
        time.sleep(0.5)
    content = httpx.get(f"{url}/v1/videos/{job['id']}/content", timeout=60)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    return content.content


def test_the_page_has_the_blocks_this_test_runs():
    assert set(blocks()) == {
        "one-machine serve", "one-machine request", "several-machines serve", "several-machines request",
        "split-encoders serve", "split-encoders request", "instances serve", "glm-image refused",
    }  # fmt: skip


def test_one_machine_as_written(shell_env, tmp_path):
    log = tmp_path / "serve.log"
    with started(blocks()["one-machine serve"], shell_env, tmp_path, log):
        url = "http://127.0.0.1:22000"
        wait_ready(url, {"encoder": 1, "denoiser": 1, "decoder": 1}, log)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in [m["id"] for m in models["data"]], models
        job = json.loads(run_request(shorter_video(blocks()["one-machine request"]), shell_env, tmp_path))
        assert job["object"] == "video" and job["model"] == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", job
        assert len(wait_video(url, job, log)) > 0
        assert httpx.get(f"{url}/v1/videos/{job['id']}", timeout=10).json()["size"] == "832x480"


def test_several_machines_on_loopback_with_a_four_rank_denoiser(shell_env, tmp_path):
    serve = on_loopback(blocks()["several-machines serve"])
    log = tmp_path / "serve.log"
    with started(serve, shell_env, tmp_path, log):
        url = "http://127.0.0.4:30000"
        wait_ready(url, {"encoder": 1, "denoiser": 1, "decoder": 1}, log)
        job = json.loads(
            run_request(shorter_video(on_loopback(blocks()["several-machines request"])), shell_env, tmp_path)
        )
        assert job["model"] == "Wan-AI/Wan2.1-T2V-14B-Diffusers", job
        assert len(wait_video(url, job, log)) > 0
        ranks = [line for line in log.read_text().splitlines() if "rank" in line.lower()]
        assert ranks, "the denoiser's ranks left no line in its log"


def test_an_rdma_device_this_host_lacks_is_refused_at_start_up_in_one_line(shell_env, tmp_path):
    """The several-machines block's workers with the reference's `--disagg-ib-device mlx5_0`: this machine
    has no RDMA NIC, and a worker told to use one exits at start-up naming the flag."""
    encoder = on_loopback(command(blocks()["several-machines serve"], "# Machine A"))
    script = f"triptych keys generate keys\n{encoder} --disagg-ib-device mlx5_0"
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                         timeout=START_S)  # fmt: skip
    assert out.returncode != 0, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("triptych: error:") and "--disagg-ib-device mlx5_0" in last, out.stderr[-3000:]


def test_the_one_machine_head_without_keys_is_refused_in_one_line_saying_what_to_give(shell_env, tmp_path):
    """As the reference types it (no --disagg-keys-dir): the head's `--host 0.0.0.0` would take
    control-plane peers from other hosts unauthenticated."""
    head = command(blocks()["one-machine serve"], "# Terminal 4").replace("--disagg-keys-dir keys \\\n", "")
    assert "--disagg-keys-dir" not in head and "--host 0.0.0.0" in head, head
    out = subprocess.run(["bash", "-c", head], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("triptych: error: --host 0.0.0.0"), out.stderr
    assert "--disagg-keys-dir" in lines[0] and "--disagg-insecure" in lines[0], lines[0]


def test_split_encoders_as_written(shell_env, tmp_path):
    log = tmp_path / "serve.log"
    Image.new("RGB", (64, 48), (200, 120, 40)).save(tmp_path / "reference.png")
    with started(blocks()["split-encoders serve"], shell_env, tmp_path, log):
        url = "http://127.0.0.1:30000"
        wait_ready(url, {"prompt_encoder": 1, "image_encoder": 1, "denoiser": 1, "decoder": 1}, log)
        run_request(blocks()["split-encoders request"], shell_env, tmp_path)
        t2i = json.loads((tmp_path / "flux-t2i.json").read_text())
        i2i = json.loads((tmp_path / "flux-i2i.json").read_text())
        t2i_image = Image.open(io.BytesIO(base64.b64decode(t2i["data"][0]["b64_json"])))
        i2i_image = Image.open(io.BytesIO(base64.b64decode(i2i["data"][0]["b64_json"])))
        assert t2i_image.size == (1024, 1024)
        assert i2i_image.size == (64, 48)  # an edit without size keeps the reference's dimensions


def test_several_instances_per_role_as_written(shell_env, tmp_path):
    log = tmp_path / "serve.log"
    with started(on_loopback(blocks()["instances serve"]), shell_env, tmp_path, log):
        deadline = time.monotonic() + START_S
        while True:  # the head's default port; its workers never start, so none is ready
            try:
                view = httpx.get("http://127.0.0.1:30000/v1/pipeline", timeout=5).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        listed = {role: [i["url"] for i in info["instances"]] for role, info in view["roles"].items()}
        assert listed == {
            "encoder": ["tcp://127.0.0.1:35000", "tcp://127.0.0.2:35000"],
            "denoiser": ["tcp://127.0.0.3:35000", "tcp://127.0.0.4:35000"],
            "decoder": ["tcp://127.0.0.5:35000"],
        }, listed


def test_the_several_instances_head_without_host_is_refused_in_one_line_saying_what_to_give(shell_env, tmp_path):
    """As the reference types it (no --host, no keys): its result sockets would bind 127.0.0.1, which
    the workers on other hosts never reach. Run as written, not on loopback: the refusal is at start-up."""
    head = command(blocks()["instances serve"], "# 2 encoders").replace(
        "    --host 0.0.0.0 --disagg-keys-dir keys \\\n", ""
    )
    assert "--host" not in head and "--disagg-keys-dir" not in head and "tcp://192.0.2.1:35000" in head, head
    out = subprocess.run(["bash", "-c", head], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "triptych: error: --encoder-urls tcp://192.0.2.1:35000 is on another host, but --host 127.0.0.1"
    ), lines[0]
    assert "pass --host" in lines[0] and "--disagg-keys-dir" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("index", "flag"),
    [(0, "--srt-encoder-url"), (1, "--srt-encoder-url"), (2, "--tokenizer-path")],
    ids=["denoiser", "head", "language-server"],
)
def test_glm_image_commands_are_refused_in_one_line_naming_the_flag(shell_env, tmp_path, index, flag):
    command = blocks()["glm-image refused"].split("\n\n")[index]
    out = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0] == f"triptych: error: {flag} {REFERENCE_ONLY[flag]}", lines[0]  # why, and what to run
