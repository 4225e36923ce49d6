"""Tiny FLUX.1-dev-shaped packages: `tiny-flux` (FluxPipeline) and `tiny-flux-kontext` (FluxKontextPipeline).

Same component classes and configuration keys as black-forest-labs/FLUX.1-dev, shrunk. The VAE has
three blocks, so its vae_scale_factor is 4, not the 8 that FluxPipeline falls back to when it is
built without a VAE: code that forgets to read the factor from vae/config.json produces the
wrong latent grid and fails.
"""

from __future__ import annotations

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
)
from diffusers.pipelines.pipeline_utils import DiffusionPipeline
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from triptych_dev.tiny_models.text_tokenizers import t5_encoder_shape, train_clip_tokenizer, train_t5_tokenizer

TEXT_DIM = 32
LATENT_CHANNELS = 4


def build_flux(kontext: bool = False) -> DiffusionPipeline:
    """The tiny FLUX pipeline in memory, random weights from fixed seeds."""
    tokenizer, tokenizer_2 = train_clip_tokenizer(), train_t5_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=TEXT_DIM,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=tokenizer.model_max_length,
            projection_dim=TEXT_DIM,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(1)
    text_encoder_2 = T5EncoderModel(T5Config(**t5_encoder_shape(tokenizer_2, TEXT_DIM)))
    torch.manual_seed(2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=LATENT_CHANNELS * 4,  # 2x2 packed latent patches
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=True,  # like FLUX.1-dev: guidance_scale is embedded, not classifier-free
        axes_dims_rope=(4, 6, 6),
    )
    torch.manual_seed(3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    # FLUX.1-dev's scheduler settings: resolution-dependent shift (mu) computed by the pipeline.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    pipeline_class = FluxKontextPipeline if kontext else FluxPipeline
    return pipeline_class(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
