"""Adapter sources checked where they are loaded (triptych/lora.py: source_problem, LoraCatalog.check_sources):
a --lora or --lora-catalog SOURCE that is a path without adapter weights refuses a denoiser's or an encoder's
start in one line (exit 2), naming the flag, the adapter and the path; a hub id is not looked up; a
catalogue re-read with such an entry keeps the process serving and logs the entry."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.harness import deployment
from triptych.lora import LoraCatalog, is_path, source_problem
from triptych.roles import Role

REPO = Path(__file__).resolve().parents[2]


def safetensors(path: Path, tensors: int = 1, cut: int = 0) -> Path:
    """A safetensors file of `tensors` float32 [2] tensors (8 bytes of header length, the JSON header, the
    data), `cut` bytes short."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for i in range(tensors):
        header[f"transformer.x.lora_A.weight{i}"] = {"dtype": "F32", "shape": [2], "data_offsets": [8 * i, 8 * i + 8]}
    text = json.dumps(header).encode()
    data = len(text).to_bytes(8, "little") + text + bytes(8 * tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data[: len(data) - cut])
    return path


def adapter_folder(root: Path, name: str = "ink") -> Path:
    safetensors(root / name / "pytorch_lora_weights.safetensors")
    return root / name


def test_paths_and_hub_ids_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    for hub in ("owner/name", "ink-lora", "org/model.v1"):
        assert not is_path(hub) and source_problem(hub) is None, hub  # downloaded on first use: not looked up
    for path in ("/missing", "./missing", "../missing", "~/missing", "a/b/c", "ink.safetensors", "adapters"):
        assert is_path(path), path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda root: root / "missing", "{root}/missing does not exist"),
        (lambda root: (root / "empty").mkdir() or root / "empty", "{root}/empty is a folder without a .safetensors"),
        (lambda root: safetensors(root / "a.safetensors", tensors=0), "{root}/a.safetensors holds no tensors"),
        (lambda root: safetensors(root / "a.safetensors", cut=4), "{root}/a.safetensors is cut short"),
        (lambda root: _write(root / "a.safetensors", b""), "{root}/a.safetensors is empty"),
        (lambda root: _write(root / "a.safetensors", b"not weights at all"), "is not a safetensors file"),
        (
            lambda root: safetensors(root / "f" / "pytorch_lora_weights.safetensors", tensors=0).parent,
            "{root}/f/pytorch_lora_weights.safetensors holds no tensors",
        ),
    ],
    ids=["missing", "empty-folder", "no-tensors", "truncated", "empty-file", "garbage", "folder-no-tensors"],
)
def test_a_path_without_adapter_weights_is_a_problem_naming_it(tmp_path: Path, make, says: str) -> None:  # type: ignore[no-untyped-def]
    problem = source_problem(str(make(tmp_path)))
    assert problem is not None and says.format(root=tmp_path) in problem, problem


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_a_path_holding_weights_as_diffusers_reads_them_is_no_problem(tmp_path: Path) -> None:
    assert source_problem(str(adapter_folder(tmp_path))) is None
    assert source_problem(str(safetensors(tmp_path / "one.safetensors", tensors=3))) is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_lora_weights.bin").write_bytes(b"pickled")  # diffusers' fallback
    assert source_problem(str(tmp_path / "bin")) is None


def test_check_sources_names_each_bad_flag_and_catalogue_entry_in_one_line(tmp_path: Path) -> None:
    good = adapter_folder(tmp_path)
    catalog = tmp_path / "loras.txt"
    catalog.write_text(f"# adapters\npaper={tmp_path}/paper\nhub=owner/name\nink2={good}\n")
    problem = LoraCatalog.from_flags([f"ink={good}", "gone=/nonexistent/adapter"], str(catalog)).check_sources(
        "denoiser"
    )
    assert problem is not None and "\n" not in problem
    assert problem.startswith("--lora gone=/nonexistent/adapter: /nonexistent/adapter does not exist on this denoiser")
    assert f"--lora-catalog {catalog}: paper={tmp_path}/paper: {tmp_path}/paper does not exist" in problem
    assert "give a folder holding pytorch_lora_weights.safetensors" in problem  # what to do
    assert "ink=" not in problem and "hub=" not in problem and "owner/name (" not in problem
    assert LoraCatalog.from_flags([f"ink={good}", "hub=owner/name"], str(catalog.with_name("none"))).check_sources(
        "encoder"
    ) is None  # fmt: skip


def test_a_re_read_catalogue_keeps_a_bad_entry_and_logs_it_and_the_head_logs_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = adapter_folder(tmp_path)
    path = tmp_path / "loras.txt"
    path.write_text(f"ink={good}\n")
    worker, head = LoraCatalog.from_flags([], str(path)), LoraCatalog.from_flags([], str(path))
    assert worker.check_sources("denoiser") is None
    path.write_text(f"ink={good}\ngone=/nonexistent/adapter\n")
    os.utime(path, ns=(1, 1))  # a new stamp even within the file system's time resolution
    with caplog.at_level(logging.WARNING, logger="triptych.lora"):
        assert worker.entries() == {"ink": str(good), "gone": "/nonexistent/adapter"}  # kept: no crash
        assert head.entries() == worker.entries()
    (record,) = [r for r in caplog.records if "gone" in r.getMessage()]
    assert record.getMessage().startswith(
        f"--lora-catalog {path}: gone=/nonexistent/adapter: /nonexistent/adapter does not exist on this denoiser"
    )
    caplog.clear()
    path.write_text(f"ink={good}\ngone=/nonexistent/adapter\n# unchanged entries\n")
    with caplog.at_level(logging.WARNING, logger="triptych.lora"):
        worker.entries()
    assert not caplog.records  # said once, when the entry came


def serve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "triptych", "serve", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("role", ["denoiser", "encoder"])
def test_serve_refuses_a_missing_adapter_path_in_one_line_with_exit_code_2(tiny_models, tmp_path, role) -> None:  # type: ignore[no-untyped-def]
    catalog = tmp_path / "loras.txt"
    catalog.write_text(f"paper={tmp_path}/empty\n")
    (tmp_path / "empty").mkdir()
    for flags, says in (
        (["--lora", "ink=/missing/path"], f"--lora ink=/missing/path: /missing/path does not exist on this {role}"),
        (
            ["--lora-catalog", str(catalog)],
            f"--lora-catalog {catalog}: paper={tmp_path}/empty: {tmp_path}/empty is a folder without a .safetensors",
        ),
    ):
        proc = serve("--model-path", str(tiny_models["tiny-flux"]), "--disagg-role", role, "--simulate",
                     "--disagg-server-addr", "tcp://127.0.0.1:1", "--disagg-transfer-listen-any", *flags)  # fmt: skip
        errors = [line for line in proc.stderr.splitlines() if line.startswith("triptych: error:")]
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert len(errors) == 1 and errors[0].startswith(f"triptych: error: {says}"), proc.stderr[-3000:]
        assert "give a folder holding pytorch_lora_weights.safetensors" in errors[0]
        assert "Traceback" not in proc.stderr


def test_monolithic_serve_refuses_a_missing_adapter_path_before_loading_the_model(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = serve("--model-path", str(tiny_models["tiny-flux"]), "--port", "1", "--output-path", str(tmp_path),
                 "--lora", "ink=/missing/path")  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("triptych: error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    says = "--lora ink=/missing/path: /missing/path does not exist on this monolithic process"
    assert len(errors) == 1 and errors[0].startswith(f"triptych: error: {says}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_a_deployment_with_local_adapter_paths_and_hub_ids_starts(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    good = adapter_folder(tmp_path / "adapters")
    one = safetensors(tmp_path / "adapters" / "paper.safetensors")
    catalog = tmp_path / "loras.txt"
    catalog.write_text(f"paper={one}\nhub=owner/not-downloaded-at-start\n")
    flags = ("--lora", f"ink={good}", "--lora-catalog", str(catalog))
    roles = {Role.ENCODER: flags, Role.DENOISER: flags}
    with deployment(
        tiny_models["tiny-flux"], tmp_path / "dep", simulate=True, head_flags=flags, role_flags=roles
    ) as dep:
        assert all(p.popen.poll() is None for p in dep.procs)  # every worker heartbeats: all started


@pytest.mark.parametrize("full_pipeline", [False, True], ids=["denoiser", "full-pipeline"])
def test_a_multi_device_worker_s_rank_0_resolves_with_the_checked_catalogue_and_logs_a_re_read_bad_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, full_pipeline: bool
) -> None:
    """--num-gpus 2: rank 0 alone resolves adapter names (the followers load the sources its jobs
    name, and never re-read their catalogue), with the catalogue the worker checked at start-up, so
    an entry a re-read brings without adapter weights is logged on rank 0, once. Before, rank 0
    resolved with a catalogue of its own that nothing had checked: the re-read logged nothing."""
    from triptych.cli import build_parser
    from triptych.config import ServeArgs
    from triptych_dev.null_pipeline import NullPipeline
    from triptych_worker.runtime import Worker

    good = adapter_folder(tmp_path)
    path = tmp_path / "loras.txt"
    path.write_text(f"ink={good}\n")
    given: list[LoraCatalog] = []

    def start(args: ServeArgs, lora_catalog: LoraCatalog) -> NullPipeline:
        given.append(lora_catalog)  # what rank 0's stages resolve adapter names with (parallel/ranks.py)
        return NullPipeline(Role.DENOISER, 1024)

    if full_pipeline:
        monkeypatch.setattr("triptych_worker.parallel.full.start_full_pipeline_ranks", start)
    else:
        monkeypatch.setattr("triptych_worker.parallel.ranks.start_ranks", start)
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--num-gpus", "2", "--lora-catalog", str(path),
            *(["--disagg-full-pipeline"] if full_pipeline else ["--disagg-transfer-pool-size", "4MiB"])]  # fmt: skip
    worker = Worker(ServeArgs.from_namespace(build_parser().parse_args(argv)))
    try:
        (catalog,) = given
        path.write_text(f"ink={good}\ngone=/nonexistent/adapter\n")
        os.utime(path, ns=(1, 1))  # a new stamp even within the file system's time resolution
        with caplog.at_level(logging.WARNING, logger="triptych.lora"):
            assert catalog.source("gone") == "/nonexistent/adapter"  # as rank 0 resolves a request's adapters
        (record,) = [r for r in caplog.records if "gone" in r.getMessage()]
        assert record.getMessage().startswith(
            f"--lora-catalog {path}: gone=/nonexistent/adapter: /nonexistent/adapter does not exist on this denoiser"
        )
    finally:
        worker.transport.close()


def test_a_follower_rank_never_reads_the_catalogue_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower of a multi-device denoiser starts with an empty catalogue: each job pins the sources
    rank 0 resolved, so it never reads --lora-catalog, and a file it cannot parse is logged by rank 0
    alone, not once per rank. Before, every follower read the file and logged it too."""
    from triptych.cli import build_parser
    from triptych.config import ServeArgs
    from triptych_worker.parallel import ranks

    path = tmp_path / "loras.txt"
    path.write_text("no equals sign here\n")
    given: list[LoraCatalog] = []

    class Started(Exception):
        pass

    def start(cls: type, args: ServeArgs, rank: int, lora_catalog: LoraCatalog) -> None:
        given.append(lora_catalog)
        raise Started  # the follower's model would load next

    monkeypatch.setattr(ranks.Rank, "start", classmethod(start))
    argv = ["serve", "--model-path", "m", "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1",
            "--device", "cpu", "--num-gpus", "2", "--lora-catalog", str(path)]  # fmt: skip
    args = ServeArgs.from_namespace(build_parser().parse_args(argv))
    with caplog.at_level(logging.WARNING, logger="triptych.lora"), pytest.raises(Started):
        ranks.follow(args, 1)
    (catalog,) = given
    assert not catalog and catalog.source("anything") is None
    assert [r.getMessage() for r in caplog.records] == []
    with caplog.at_level(logging.WARNING, logger="triptych.lora"):
        LoraCatalog.from_flags(args.lora, args.lora_catalog)  # what the worker (rank 0) builds
    assert [r.getMessage() for r in caplog.records if str(path) in r.getMessage()], "rank 0 logs it"
