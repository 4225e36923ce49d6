"""A random-weight diffusers package of the Wan2.1-T2V-1.3B shape, created locally (no download).

    python bench/random_wan.py --out .models/random-wan-1.3b [--num-layers 30] [--dtype bfloat16]

The transformer and the VAE have the configuration of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (30
layers, 12 heads of 128, FFN 8960, text dim 4096; the 16-channel VAE with its latent statistics),
the scheduler its UniPC flow-matching settings. The text encoder is a UMT5 of the real width
(d_model 4096) but 2 layers and the tiny packages' tokenizer: the benchmarks this serves time the
denoiser and the VAE, which are real-size. Weights are random from fixed seeds, so pixels are
noise (the same for a given device). `--num-layers` shrinks the transformer (a quick check of the script).
"""

from __future__ import annotations

import argparse
from pathlib import Path

WAN_1_3B_TRANSFORMER = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}


def write_random_wan(out: Path, num_layers: int = 30, dtype: str = "float32") -> Path:
    """Write the package to `out` (once: an existing one with a transformer config is kept)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from triptych_dev.tiny_models.text_tokenizers import t5_encoder_shape, train_t5_tokenizer

    if (out / "transformer" / "config.json").exists():
        return out
    torch_dtype = getattr(torch, dtype)
    tokenizer = train_t5_tokenizer()
    # Initialising 1.3B random weights takes seconds on a GPU, minutes on a busy CPU.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        torch.manual_seed(0)
        text_shape = t5_encoder_shape(tokenizer, 4096) | {"d_kv": 64, "num_heads": 64, "d_ff": 10240}
        text_encoder = UMT5EncoderModel(UMT5Config(**text_shape)).to(torch_dtype)
        torch.manual_seed(1)
        transformer = WanTransformer3DModel(**(WAN_1_3B_TRANSFORMER | {"num_layers": num_layers})).to(torch_dtype)
        torch.manual_seed(2)
        vae = AutoencoderKLWan()  # the class defaults are Wan2.1's VAE (z_dim 16, base_dim 96)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, num_train_timesteps=1000,
        solver_order=2, predict_x0=True, solver_type="bh2", lower_order_final=True, final_sigmas_type="zero",
    )  # fmt: skip
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-layers", type=int, default=30)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    opts = parser.parse_args()
    print(write_random_wan(opts.out, opts.num_layers, opts.dtype))


if __name__ == "__main__":
    main()
