"""Tiny Wan2.1-T2V-shaped package `tiny-wan` (WanPipeline).

Same component classes and configuration keys as Wan-AI/Wan2.1-T2V-1.3B-Diffusers, shrunk,
including its UniPC flow-matching scheduler. The VAE compresses space by 4 (the real one by 8,
which is also WanPipeline's fallback without a VAE) and time by 4, so code that forgets to read
scale_factor_spatial from vae/config.json builds the wrong latent grid and fails.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from transformers import UMT5Config, UMT5EncoderModel

from triptych_dev.tiny_models.text_tokenizers import t5_encoder_shape, train_t5_tokenizer

TEXT_DIM = 32
Z_DIM = 4


def build_wan() -> DiffusionPipeline:
    """The tiny Wan pipeline in memory, random weights from fixed seeds."""
    tokenizer = train_t5_tokenizer()
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(**t5_encoder_shape(tokenizer, TEXT_DIM)))
    torch.manual_seed(1)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=Z_DIM,
        out_channels=Z_DIM,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=128,  # patches per axis: up to 1024 px (x2 patch, x4 VAE), 832x480 included
    )
    torch.manual_seed(2)
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[True, True],
        latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075],
        latents_std=[2.8184, 1.4541, 2.3275, 2.6558],
        scale_factor_spatial=4,
        scale_factor_temporal=4,
    )
    # Wan2.1-T2V-1.3B-Diffusers' scheduler_config.json.
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000,
        beta_start=0.0001,
        beta_end=0.02,
        beta_schedule="linear",
        solver_order=2,
        prediction_type="flow_prediction",
        thresholding=False,
        sample_max_value=1.0,
        predict_x0=True,
        solver_type="bh2",
        lower_order_final=True,
        disable_corrector=[],
        use_flow_sigmas=True,
        flow_shift=3.0,
        timestep_spacing="linspace",
        steps_offset=0,
        final_sigmas_type="zero",
    )
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
