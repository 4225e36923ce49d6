"""FLUX.1 (FluxPipeline) and FLUX.1 Kontext (FluxKontextPipeline): request rules and tensor shapes."""

from __future__ import annotations

from triptych.families.package import ModelPackage
from triptych.families.rules import FamilyRules
from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec

KONTEXT = "FluxKontextPipeline"


class FluxRules(FamilyRules):
    kind = "image"
    negative_prompt = False  # embedded guidance (guidance_scale), not classifier-free guidance

    def __init__(self, package: ModelPackage):
        super().__init__(package)
        transformer, vae = package.config("transformer"), package.config("vae")
        # The same formula FluxPipeline applies to a loaded VAE, read here from its config.
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = int(transformer["in_channels"]) // 4
        self.guidance_embeds = bool(transformer.get("guidance_embeds", False))
        self.max_steps = int(package.config("scheduler").get("num_train_timesteps", 1000))
        self.text_dim = int(package.config("text_encoder_2")["d_model"])  # T5
        self.pooled_dim = int(package.config("text_encoder")["hidden_size"])  # CLIP's pooled output
        self.takes_reference = package.class_name == KONTEXT
        self.size_multiple = self.vae_scale_factor * 2  # latents are packed in 2x2 patches

    def _sequence(self, params: GenerationParams) -> int:
        return (params.height // self.size_multiple) * (params.width // self.size_multiple)

    def text_outputs(self, params: GenerationParams) -> list[TensorSpec]:
        n, length = params.num_outputs, params.max_sequence_length
        return [
            TensorSpec("prompt_embeds", "float32", (n, length, self.text_dim)),
            TensorSpec("pooled_prompt_embeds", "float32", (n, self.pooled_dim)),
            TensorSpec("text_ids", "float32", (length, 3)),
        ]

    def latent_spec(self, params: GenerationParams) -> TensorSpec:
        return TensorSpec("latents", "float32", (params.num_outputs, self._sequence(params), self.latent_channels * 4))
