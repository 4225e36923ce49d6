"""FLUX.1 (FluxPipeline) and FLUX.1 Kontext (FluxKontextPipeline, text-to-image) split into role stages.

Crosses encoder -> denoiser (tensors): prompt_embeds [n, L, D], pooled_prompt_embeds [n, P],
text_ids [L, 3], latents [n, S, 4C] (packed 2x2 patches), latent_image_ids [S, 3];
(meta): sigmas (list of float, or None when the scheduler makes its own), mu (float),
guidance (float, or None without guidance embeddings).
Crosses denoiser -> decoder (tensors): latents [n, S, 4C].
Decoder output: pixels uint8 [n, 1, H, W, 3].

FLUX.1-dev embeds guidance_scale in the transformer instead of running classifier-free guidance,
so a negative prompt is rejected rather than silently ignored (the stock pipeline ignores it).
Kontext runs text-to-image only: a request carries no reference image.

torch and diffusers are imported inside methods so the head can validate without importing them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec
from triptych_worker.adapters.base import FamilyAdapter, ModelPackage, check_common, pixels_uint8
from triptych_worker.preview import as_numpy
from triptych_worker.stages import PIXELS

if TYPE_CHECKING:
    from triptych_worker.stages import StageBatch

TEXT = frozenset({"text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"})


class FluxAdapter(FamilyAdapter):
    stage_components: ClassVar[dict[str, frozenset[str]]] = {
        "TextEncodingStage": TEXT,
        "TimestepPreparationStage": frozenset({"scheduler"}),
        "DenoisingStage": frozenset({"transformer", "scheduler"}),
        "DecodingStage": frozenset({"vae"}),
    }

    def __init__(self, package: ModelPackage, device: str = "cpu"):
        super().__init__(package, device)
        transformer, vae = package.config("transformer"), package.config("vae")
        # The same formula FluxPipeline applies to a loaded VAE, read here from its config.
        self.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)
        self.latent_channels = int(transformer["in_channels"]) // 4
        self.guidance_embeds = bool(transformer.get("guidance_embeds", False))
        self.max_steps = int(package.config("scheduler").get("num_train_timesteps", 1000))
        self.text_dim = int(package.config("text_encoder_2")["d_model"])  # T5
        self.pooled_dim = int(package.config("text_encoder")["hidden_size"])  # CLIP's pooled output

    def _encoder_outputs(self, params: GenerationParams) -> list[TensorSpec]:
        n, length = params.num_outputs, params.max_sequence_length
        seq = (params.height // self.size_multiple) * (params.width // self.size_multiple)
        return [
            TensorSpec("prompt_embeds", "float32", (n, length, self.text_dim)),
            TensorSpec("pooled_prompt_embeds", "float32", (n, self.pooled_dim)),
            TensorSpec("text_ids", "float32", (length, 3)),
            TensorSpec("latents", "float32", (n, seq, self.latent_channels * 4)),
            TensorSpec("latent_image_ids", "float32", (seq, 3)),
        ]

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2  # latents are packed in 2x2 patches

    def validate(self, params: GenerationParams) -> None:
        check_common(params, size_multiple=self.size_multiple, max_steps=self.max_steps)
        if params.num_frames != 1:
            raise ValueError(f"num_frames {params.num_frames} must be 1: {self.package.class_name} makes images")
        if params.negative_prompt:
            raise ValueError(
                "negative_prompt is not supported by FLUX.1: it uses embedded guidance (guidance_scale), "
                "not classifier-free guidance; leave negative_prompt empty"
            )

    def load(self, components: set[str]) -> None:
        import diffusers

        self.pipe = self._load_stock(getattr(diffusers, self.package.class_name), components)
        # Without its VAE the stock pipeline falls back to a factor of 8; the package may differ.
        self.pipe.vae_scale_factor = self.vae_scale_factor

    def encode_text(self, batch: StageBatch) -> None:
        p = batch.params
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=p.prompt,
            device=self.device,
            num_images_per_prompt=p.num_outputs,
            max_sequence_length=p.max_sequence_length,
        )
        batch.tensors.update(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled, text_ids=text_ids)

    def prepare_latents(self, batch: StageBatch) -> None:
        import torch

        p = batch.params
        # A CPU generator, as in the stock reference call, makes the noise the same on every device.
        generator = torch.Generator("cpu").manual_seed(p.seed)
        args: tuple[Any, ...] = (
            p.num_outputs,
            self.latent_channels,
            p.height,
            p.width,
            batch.tensors["prompt_embeds"].dtype,
            torch.device(self.device),
            generator,
        )
        if self.package.class_name == "FluxKontextPipeline":
            latents, _, latent_ids, _ = self.pipe.prepare_latents(None, *args)  # no reference image
        else:
            latents, latent_ids = self.pipe.prepare_latents(*args)
        batch.tensors.update(latents=latents, latent_image_ids=latent_ids)

    def prepare_timesteps(self, batch: StageBatch) -> None:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        p, config = batch.params, self.pipe.scheduler.config
        steps = p.num_inference_steps
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps).tolist()
        mu = calculate_shift(
            batch.tensors["latents"].shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        batch.meta.update(
            sigmas=sigmas, mu=float(mu), guidance=float(p.guidance_scale) if self.guidance_embeds else None
        )

    def denoise(self, batch: StageBatch) -> None:
        import torch
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        t, meta, transformer, scheduler = self.on_device(batch), batch.meta, self.pipe.transformer, self.pipe.scheduler
        # Rebuilt from meta alone: this process shares no state with the encoder that computed it.
        timesteps, _ = retrieve_timesteps(
            scheduler, batch.params.num_inference_steps, self.device, sigmas=meta["sigmas"], mu=meta["mu"]
        )
        latents = t["latents"]
        guidance = None
        if meta["guidance"] is not None:
            guidance = torch.full([1], meta["guidance"], device=latents.device, dtype=torch.float32)
            guidance = guidance.expand(latents.shape[0])
        scheduler.set_begin_index(0)
        for i, step_t in enumerate(timesteps):
            timestep = step_t.expand(latents.shape[0]).to(latents.dtype)
            with transformer.cache_context("cond"):
                noise_pred = transformer(
                    hidden_states=latents,
                    timestep=timestep / 1000,
                    guidance=guidance,
                    pooled_projections=t["pooled_prompt_embeds"],
                    encoder_hidden_states=t["prompt_embeds"],
                    txt_ids=t["text_ids"],
                    img_ids=t["latent_image_ids"],
                    joint_attention_kwargs={},
                    return_dict=False,
                )[0]
            latents = scheduler.step(noise_pred, step_t, latents, return_dict=False)[0]
            batch.report_progress(i + 1, len(timesteps), latents)
        batch.tensors = {"latents": latents}

    def latent_grid(self, latents: Any, params: GenerationParams) -> np.ndarray:
        # Packed [N, h/2 * w/2, C * 4] (2x2 patches, as FluxPipeline._pack_latents) -> [C, h, w].
        h, w = params.height // self.vae_scale_factor, params.width // self.vae_scale_factor
        packed = as_numpy(latents[0]).reshape(h // 2, w // 2, self.latent_channels, 2, 2)
        return packed.transpose(2, 0, 3, 1, 4).reshape(self.latent_channels, h, w)

    def decode(self, batch: StageBatch) -> None:
        p, vae = batch.params, self.pipe.vae
        latents = self.pipe._unpack_latents(batch.tensors["latents"], p.height, p.width, self.vae_scale_factor)
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(vae.device), return_dict=False)[0]
        images = self.pipe.image_processor.postprocess(image, output_type="np")  # [n, H, W, 3] in [0, 1]
        batch.tensors = {PIXELS: pixels_uint8(images)[:, None]}
