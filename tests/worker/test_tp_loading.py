"""A TP rank reads only its cut of the transformer, straight onto its device (parallel/tp_load.py).

Loaded whole first, every rank would hold the whole transformer in host memory (a bfloat16 checkpoint
cast to float32 parameters: twice its file) and, loaded on its device, there too, which defeats TP for
a model larger than one device. Here the cut transformer equals the whole one cut in memory, tensor
for tensor; on torch's `meta` device (tensors without storage, standing in for a GPU: what reaches it
leaves host memory) the load's peak host memory is about one tensor, against the whole model for the
stock `from_pretrained`; and checkpoints it cannot read are refused naming what is wrong. The real TP
ranks' pixels are tests/e2e/test_parallel_ranks.py's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_parallel_ranks import tp_shard_bytes
from triptych.families.package import ModelPackage
from triptych.roles import Role
from triptych_worker.parallel.tensor import keep_shard, plan_cuts
from triptych_worker.parallel.tp_load import load_transformer_cut
from triptych_worker.pipeline import load_role_pipeline

TP = 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("package", ["tiny-flux", "tiny-wan"])
def test_a_rank_s_transformer_read_cut_is_the_whole_one_cut_and_its_pipeline_uses_it(  # type: ignore[no-untyped-def]
    tiny_models, package, dtype
) -> None:
    """In bfloat16 too: Wan keeps some modules in float32 (`_keep_in_fp32_modules`), as from_pretrained does."""
    family = package.removeprefix("tiny-")
    _, shard = tp_shard_bytes(tiny_models[package], family, TP)
    for index in range(TP):
        cut = load_transformer_cut(ModelPackage.read(tiny_models[package]), family, TP, index, "cpu", dtype)
        whole = load_role_pipeline(tiny_models[package], Role.DENOISER, dtype=dtype).adapter.pipe.transformer
        for name, how in plan_cuts(whole, family, TP, index).items():
            keep_shard(whole.get_submodule(name), how)
        read, expected = cut.state_dict(), whole.state_dict()
        assert read.keys() == expected.keys()
        assert all(read[key].dtype == expected[key].dtype and torch.equal(read[key], expected[key]) for key in read)
        assert {str(t.dtype) for t in read.values()} >= {f"torch.{dtype}"}
        buffers = dict(whole.named_buffers())
        assert all(torch.equal(b, buffers[n]) and b.dtype == buffers[n].dtype for n, b in cut.named_buffers())
        if dtype == "float32":
            assert sum(p.numel() * p.element_size() for p in cut.parameters()) == shard
    pipeline = load_role_pipeline(tiny_models[package], Role.DENOISER, given={"transformer": cut}, dtype=dtype)
    assert pipeline.adapter.pipe.transformer is cut


# Run in a process of its own: the peak of its anonymous memory (resident less file-backed pages: the
# safetensors file's mapped pages are the page cache's) over a load, sampled every 0.5 ms; freed
# buffers go back to the system at once (MALLOC_MMAP_THRESHOLD_ below), so the peak is what was live.
PROBE = """
import json, os, sys, threading, time
import accelerate, diffusers, safetensors.torch, torch
from diffusers import FluxTransformer2DModel
from triptych.families.package import ModelPackage
from triptych_worker.parallel.tp_load import load_transformer_cut

def anonymous():
    _, resident, shared = map(int, open("/proc/self/statm").read().split()[:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")

base = anonymous()
peak, done = [base], [False]
def watch():
    while not done[0]:
        peak[0] = max(peak[0], anonymous())
        time.sleep(0.0005)
watcher = threading.Thread(target=watch)
watcher.start()
if sys.argv[1] == "cut":
    model = load_transformer_cut(ModelPackage.read(sys.argv[2]), "flux", 2, 1, "meta")
else:
    model = FluxTransformer2DModel.from_pretrained(sys.argv[2] + "/transformer")
done[0] = True
watcher.join()
print(json.dumps({"peak": peak[0] - base, "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))
"""


@pytest.fixture(scope="module")
def bfloat16_flux(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A FLUX-shaped package whose transformer (~320 MB as float32 parameters) is stored in bfloat16."""
    from diffusers import FluxTransformer2DModel

    out = tmp_path_factory.mktemp("bf16-flux")
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=64,
        num_attention_heads=12, joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(8, 28, 28),
    )  # fmt: skip
    model.to(torch.bfloat16).save_pretrained(out / "transformer")
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}
    (out / "model_index.json").write_text(json.dumps(index))
    return out


def probe(how: str, package: Path) -> dict[str, int]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, how, str(package)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_rank_holds_about_one_tensor_in_host_memory_while_it_loads(bfloat16_flux) -> None:  # type: ignore[no-untyped-def]
    from safetensors import safe_open

    with safe_open(str(bfloat16_flux / "transformer/diffusion_pytorch_model.safetensors"), "pt") as f:
        largest = max(math.prod(f.get_slice(key).get_shape()) for key in f.keys()) * 4  # as float32
    whole, cut = probe("whole", bfloat16_flux), probe("cut", bfloat16_flux)
    # The stock load holds every float32 parameter at once (the sampling may miss the last few pages).
    assert whole["peak"] >= 0.9 * whole["bytes"] and whole["bytes"] > 300e6, whole
    # Its cut on the device; in host memory a tensor's bfloat16 read and its float32 cast at a time.
    assert cut["peak"] <= 2 * largest + (8 << 20), (cut, largest)
    assert cut["bytes"] < 0.7 * whole["bytes"]


def test_a_checkpoint_a_rank_cannot_read_is_refused_naming_what_is_wrong(tiny_models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    package = tmp_path / "flux"
    shutil.copytree(tiny_models["tiny-flux"], package)
    transformer = package / "transformer"
    config = json.loads((transformer / "config.json").read_text())
    (transformer / "config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    with pytest.raises(ValueError, match=r"transformer: no weights for transformer_blocks\.\d+\."):
        load_transformer_cut(ModelPackage.read(package), "flux", TP, 0, "cpu")
    (transformer / "config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] - 1}))
    with pytest.raises(ValueError, match=r"tensor transformer_blocks\.\d+\.\S+ is not a parameter of the model"):
        load_transformer_cut(ModelPackage.read(package), "flux", TP, 0, "cpu")
    (transformer / "config.json").write_text(json.dumps(config))
    (transformer / "diffusion_pytorch_model.safetensors").rename(transformer / "diffusion_pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no diffusion_pytorch_model\.safetensors .*safetensors files only"):
        load_transformer_cut(ModelPackage.read(package), "flux", TP, 0, "cpu")
