"""A LoRA adapter's factors cut as TP ranks cut the layers they adapt (worker/triptych_worker/parallel/tensor.py).

No ranks here: each rank's cut of a layer and of the adapter's factors is taken in turn, and the
ranks' outputs put together as the TP group does (column-parallel: concatenated, row-parallel:
summed, then the bias) equal the whole layer with the whole adapter. The two ranks' runs of the real
models are in tests/worker/test_ranks_adapters.py.
"""

from __future__ import annotations

import pytest
import torch

from triptych_worker.parallel.tensor import COLWISE, PACKED_ROWWISE, ROWWISE, TpCut, keep_shard, shard_lora_factors

TP = 2


class Layers(torch.nn.Module):
    """A column-parallel layer, a row-parallel one, a packed row-parallel one (two input blocks, as FLUX's
    single-block proj_out) and one TP leaves whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.to_q = torch.nn.Linear(8, 6)
        self.to_out = torch.nn.ModuleList([torch.nn.Linear(6, 5)])
        self.proj_out = torch.nn.Linear(10, 4)  # reads cat([4 features, 6 features])
        self.norm = torch.nn.Linear(5, 5)


CUTS = {"to_q": (COLWISE, ()), "to_out.0": (ROWWISE, (6,)), "proj_out": (PACKED_ROWWISE, (4, 6))}


def adapter(whole: Layers, rank: int = 3, bias: bool = False) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out = {}
    for path in (*CUTS, "norm"):
        layer = whole.get_submodule(path)
        out[f"transformer.{path}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=generator)
        out[f"transformer.{path}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=generator)
        if bias:
            out[f"transformer.{path}.lora_B.bias"] = torch.randn(layer.out_features, generator=generator)
    return out


def with_adapter(layer: torch.nn.Linear, factors: dict[str, torch.Tensor], path: str, x: torch.Tensor) -> torch.Tensor:
    """The layer's product (a row-parallel shard's: without its bias) plus the adapter's."""
    a, b = factors[f"transformer.{path}.lora_A.weight"], factors[f"transformer.{path}.lora_B.weight"]
    lora = (x @ a.T) @ b.T + factors.get(f"transformer.{path}.lora_B.bias", 0)
    cut = getattr(layer, "_tp_cut", None)
    bias = None if cut is not None and not cut.rows else layer.bias
    return torch.nn.functional.linear(x, layer.weight, bias) + lora


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "lora-bias"])
def test_each_rank_s_cut_of_the_layers_and_the_adapter_put_together_is_the_whole_layer_with_it(bias: bool) -> None:
    whole = Layers()
    factors = adapter(whole, bias=bias)
    x = {"to_q": torch.randn(3, 8), "to_out.0": torch.randn(3, 6), "proj_out": torch.randn(3, 10)}
    expected = {path: with_adapter(whole.get_submodule(path), factors, path, x[path]) for path in CUTS}
    parts: dict[str, list[torch.Tensor]] = {path: [] for path in CUTS}
    for index in range(TP):
        ranks = Layers()
        for path, (style, blocks) in CUTS.items():
            keep_shard(ranks.get_submodule(path), TpCut(TP, index, style, blocks))
        cut_factors = shard_lora_factors(factors, ranks)
        assert torch.equal(cut_factors["transformer.norm.lora_A.weight"], factors["transformer.norm.lora_A.weight"])
        for path in CUTS:
            layer = ranks.get_submodule(path)
            inputs = x[path] if layer._tp_cut.rows else layer._tp_cut.columns(x[path])  # its input features
            parts[path].append(with_adapter(layer, cut_factors, path, inputs))
    assert torch.allclose(torch.cat(parts["to_q"], dim=-1), expected["to_q"], atol=1e-5)
    for path in ("to_out.0", "proj_out"):
        summed = sum(parts[path]) + whole.get_submodule(path).bias  # the group's all-reduce, then the bias once
        assert torch.allclose(summed, expected[path], atol=1e-5), path


def test_factors_under_the_older_names_are_cut_too_and_alphas_are_left_alone() -> None:
    whole, ranks = Layers(), Layers()
    keep_shard(ranks.to_q, TpCut(TP, 1, COLWISE))
    factors = {
        "transformer.to_q.lora_down.weight": torch.randn(2, 8),
        "transformer.to_q.lora_up.weight": torch.randn(6, 2),
        "transformer.to_q.alpha": torch.tensor(4.0),
        "text_encoder.to_q.lora_A.weight": torch.randn(2, 8),  # not the transformer's
    }
    cut = shard_lora_factors(factors, ranks)
    assert torch.equal(cut["transformer.to_q.lora_down.weight"], factors["transformer.to_q.lora_down.weight"])
    assert torch.equal(cut["transformer.to_q.lora_up.weight"], factors["transformer.to_q.lora_up.weight"][3:])
    assert cut["transformer.to_q.alpha"] is factors["transformer.to_q.alpha"]
    assert cut["text_encoder.to_q.lora_A.weight"] is factors["text_encoder.to_q.lora_A.weight"]
    assert whole.to_q.weight.shape == (6, 8) and ranks.to_q.weight.shape == (3, 8)


def test_a_dora_adapter_on_a_sharded_layer_is_refused_naming_its_tensor() -> None:
    ranks = Layers()
    keep_shard(ranks.to_out[0], TpCut(TP, 0, ROWWISE, (6,)))
    factors = {**adapter(Layers()), "transformer.to_out.0.lora_magnitude_vector": torch.ones(5)}
    with pytest.raises(ValueError, match=r"^transformer\.to_out\.0\.lora_magnitude_vector: a DoRA adapter"):
        shard_lora_factors(factors, ranks)
    dora_elsewhere = {**adapter(Layers()), "transformer.norm.lora_magnitude_vector": torch.ones(5)}
    assert "transformer.norm.lora_magnitude_vector" in shard_lora_factors(dora_elsewhere, ranks)
