"""Multi-device roles: where each rank sits, and what a model family refuses to run (naming the flag)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from triptych.cli import build_parser
from triptych.config import ConfigError, ServeArgs
from triptych.parallelism import Parallelism
from triptych.params import GenerationParams
from triptych.roles import Role
from triptych_worker.adapters import adapter_for
from triptych_worker.parallel import families
from triptych_worker.parallel.layout import RankLayout


def serve_args(model: str, role: str, *flags: str) -> ServeArgs:
    argv = ["serve", "--model-path", model, "--disagg-role", role, "--disagg-server-addr", "tcp://127.0.0.1:1", *flags]
    return ServeArgs.from_namespace(build_parser().parse_args(argv))


def test_eight_ranks_split_cfg_then_ring_then_ulysses():
    layout = RankLayout(Parallelism(sp=4, ulysses=2, ring=2, cfg=2))
    assert layout.world_size == 8
    assert layout.sp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.ulysses_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.cfg_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [layout.shard(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert (layout.cfg_index(6), layout.ring_index(6), layout.ulysses_index(6)) == (1, 1, 0)


def test_tp_ranks_are_innermost_so_a_tp_group_is_neighbours():
    layout = RankLayout(Parallelism(tp=2, sp=2, ulysses=1, ring=2, cfg=2))
    assert layout.world_size == 8
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.sp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.ring_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.cfg_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [(layout.cfg_index(r), layout.shard(r), layout.tp_index(r)) for r in (0, 3, 6)] == [
        (0, 0, 0),
        (0, 1, 1),
        (1, 1, 0),
    ]


@pytest.mark.parametrize(
    ("package", "role", "flags", "named"),
    [
        ("tiny-flux", "denoiser", ("--num-gpus", "2", "--cfg-parallel-size", "2"), "--cfg-parallel-size 2: flux"),
        (
            "tiny-wan",
            "denoiser",
            ("--num-gpus", "4", "--denoiser-tp", "4"),
            "--denoiser-tp 4 does not divide the model's 2 attention heads",
        ),
        (
            "tiny-flux",
            "denoiser",
            ("--num-gpus", "4", "--denoiser-tp", "2", "--denoiser-ulysses", "2"),
            "--denoiser-ulysses 2 does not divide the model's 2 attention heads \\(1 per TP rank\\)",
        ),
        ("tiny-flux", "denoiser", ("--num-gpus", "4", "--denoiser-ulysses", "4"), "--denoiser-ulysses 4"),
        (
            "tiny-wan",
            "encoder",
            (
                "--num-gpus",
                "2",
            ),
            "--encoder-tp",
        ),
        ("tiny-flux", "decoder", ("--num-gpus", "2"), "--decoder-sp 2: flux decodes single images"),
        ("tiny-wan", "decoder", ("--num-gpus", "2", "--cfg-parallel-size", "2"), "--cfg-parallel-size 2: the decoder"),
    ],
    ids=["flux-cfg", "wan-tp", "tp-then-ulysses", "ulysses-over-heads", "encoder", "flux-decoder", "decoder-cfg"],
)
def test_a_combination_the_family_cannot_run_is_refused_naming_the_flag(tiny_models, package, role, flags, named):
    args = serve_args(str(tiny_models[package]), role, *flags)
    family, adapter = adapter_for(args.model_path)
    with pytest.raises(ConfigError, match=named):
        families.check_degrees(args, family, adapter)


@pytest.mark.parametrize(
    ("package", "flags", "degrees"),
    [
        ("tiny-wan", ("--num-gpus", "2", "--cfg-parallel-size", "2"), Parallelism(cfg=2)),
        ("tiny-flux", ("--num-gpus", "2"), Parallelism(sp=2, ulysses=2)),
        # Two heads: a derived sp of 4 is Ulysses 2 x Ring 2, not Ulysses 4.
        ("tiny-flux", ("--num-gpus", "4"), Parallelism(sp=4, ulysses=2, ring=2)),
        ("tiny-wan", ("--num-gpus", "4", "--denoiser-ring", "4"), Parallelism(sp=4, ulysses=1, ring=4)),
        ("tiny-wan", ("--num-gpus", "2", "--denoiser-tp", "2"), Parallelism(tp=2)),
        # TP takes the heads first: a derived sp of 2 over the one head left per rank is a ring.
        ("tiny-flux", ("--num-gpus", "4", "--denoiser-tp", "2"), Parallelism(tp=2, sp=2, ulysses=1, ring=2)),
        ("tiny-wan", ("--num-gpus", "4", "--denoiser-tp", "2", "--cfg-parallel-size", "2"), Parallelism(tp=2, cfg=2)),
    ],
)
def test_a_combination_the_family_runs_is_accepted(tiny_models, package, flags, degrees):
    args = serve_args(str(tiny_models[package]), "denoiser", *flags)
    family, adapter = adapter_for(args.model_path)
    assert families.check_degrees(args, family, adapter) == degrees


def test_the_wan_decoder_splits_over_sp_ranks(tiny_models):
    args = serve_args(str(tiny_models["tiny-wan"]), "decoder", "--num-gpus", "2")
    family, adapter = adapter_for(args.model_path)
    assert families.check_degrees(args, family, adapter) == Parallelism(sp=2, ulysses=2)


def test_a_video_whose_latent_rows_do_not_split_over_the_decoder_ranks_is_refused_naming_size(tiny_models):
    family, adapter = adapter_for(str(tiny_models["tiny-wan"]))
    m = adapter.rules.size_multiple
    rows = m // adapter.rules.scale_spatial  # latent rows of a video m pixels high
    video = GenerationParams(prompt="x", width=m, height=m, num_frames=5)
    with pytest.raises(ValueError, match=f"size: the request's height makes {rows} latent rows"):
        families.check_request(adapter, family, video, Parallelism(sp=rows + 1, ulysses=rows + 1), Role.DECODER)
    families.check_request(adapter, family, video, Parallelism(sp=rows, ulysses=rows), Role.DECODER)


def test_a_request_whose_tokens_do_not_split_over_the_ranks_is_refused_naming_the_field(tiny_models):
    family, adapter = adapter_for(str(tiny_models["tiny-flux"]))
    degrees = Parallelism(sp=4, ulysses=4)
    m = adapter.rules.size_multiple  # one image token per m x m pixels
    three = GenerationParams(prompt="x", width=3 * m, height=m, max_sequence_length=64)
    with pytest.raises(ValueError, match="size: the request makes 3 tokens"):
        families.check_request(adapter, family, three, degrees)
    four = GenerationParams(prompt="x", width=4 * m, height=m, max_sequence_length=64)
    families.check_request(adapter, family, four, degrees)
    with pytest.raises(ValueError, match="max_sequence_length: the request makes 6 tokens"):
        families.check_request(adapter, family, GenerationParams(prompt="x", width=4 * m, height=m,
                                                                 max_sequence_length=6), degrees)  # fmt: skip


def test_serve_exits_with_one_line_naming_the_flag_before_starting_any_rank(tiny_models):
    argv = [sys.executable, "-m", "triptych", "serve", "--model-path", str(tiny_models["tiny-flux"]),
            "--disagg-role", "denoiser", "--disagg-server-addr", "tcp://127.0.0.1:1", "--device", "cpu",
            "--num-gpus", "2", "--cfg-parallel-size", "2"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "triptych: error: --cfg-parallel-size 2: flux uses embedded guidance" in done.stderr
