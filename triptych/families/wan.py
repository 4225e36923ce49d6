"""Wan2.1 text-to-video (WanPipeline): request rules and tensor shapes."""

from __future__ import annotations

from triptych.contract import MAX_FRAMES, MAX_SIDE
from triptych.families.package import ModelPackage, lcm
from triptych.families.rules import FamilyRules
from triptych.guidance import guided
from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec

FPS = 16  # Wan2.1's frame rate; the head uses it when it writes the video file


def uses_cfg(params: GenerationParams) -> bool:
    return guided(params.guidance_scale)


class WanRules(FamilyRules):
    kind = "video"
    # TaylorSeer's default patterns ("^blocks.*attn") match no Wan attention (attn1, attn2): it would skip nothing.
    step_cache_modes = ("first_block", "pyramid_attention_broadcast")

    def __init__(self, package: ModelPackage):
        super().__init__(package)
        index = package.index
        if index.get("boundary_ratio") is not None or index.get("expand_timesteps") or package.present("transformer_2"):
            raise ValueError(
                f"model path {package.path}: Wan2.2 packages (boundary_ratio, transformer_2, expand_timesteps) "
                "are not supported yet; use a Wan2.1 text-to-video package"
            )
        transformer, vae = package.config("transformer"), package.config("vae")
        # WanPipeline reads these from a loaded VAE and falls back to 8 and 4 without one.
        self.scale_spatial = int(vae.get("scale_factor_spatial", 8))
        self.scale_temporal = int(vae.get("scale_factor_temporal", 4))
        self.frame_step = self.scale_temporal  # WanPipeline wants 1 + a multiple of it frames
        self.latent_channels = int(transformer["in_channels"])
        patch = transformer["patch_size"]
        # check_inputs wants multiples of 16; patchification wants whole patches of latent pixels.
        self.size_multiple = lcm(16, lcm(self.scale_spatial * patch[1], self.scale_spatial * patch[2]))
        self.max_steps = int(package.config("scheduler").get("num_train_timesteps", 1000))
        # WanRotaryPosEmbed has positions for rope_max_seq_len patches along each axis: a larger latent
        # fails in the denoiser's first step, so the head refuses it at the door instead.
        rope = int(transformer.get("rope_max_seq_len", 1024))
        self.max_side = min(MAX_SIDE, rope * min(patch[1], patch[2]) * self.scale_spatial)
        self.max_frames = min(MAX_FRAMES, (rope * patch[0] - 1) * self.scale_temporal + 1)
        self.text_dim = int(package.config("text_encoder")["d_model"])  # UMT5

    def text_outputs(self, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        embeds = (params.num_outputs, params.max_sequence_length, self.text_dim)
        return [
            TensorSpec("prompt_embeds", dtype, embeds),
            *([TensorSpec("negative_prompt_embeds", dtype, embeds)] if uses_cfg(params) else []),
        ]

    def latent_spec(self, params: GenerationParams, dtype: str = "float32") -> TensorSpec:
        """float32 whatever the model's dtype: WanPipeline makes and steps its latents in float32 (the
        transformer gets a cast of them, the VAE another)."""
        p, s = params, self.scale_spatial
        frames = (p.num_frames - 1) // self.scale_temporal + 1
        return TensorSpec(
            "latents", "float32", (p.num_outputs, self.latent_channels, frames, p.height // s, p.width // s)
        )
