"""FLUX.1 (FluxPipeline) and FLUX.1 Kontext (FluxKontextPipeline, text-to-image and image edits) as role stages.

Crosses prompt encoder -> (image encoder ->) denoiser (tensors): prompt_embeds [n, L, D],
pooled_prompt_embeds [n, P], text_ids [L, 3]; with a reference image (Kontext) also
image_latents [n, S', 4C] (the VAE-encoded reference, packed 2x2) and image_ids [S', 3].
The denoiser makes latents [n, S, 4C] from the seed and its schedule (sigmas, mu, guidance) itself.
Crosses denoiser -> decoder (tensors): latents [n, S, 4C].
Decoder output: pixels uint8 [n, 1, H, W, 3].

FLUX.1-dev embeds guidance_scale in the transformer instead of running classifier-free guidance,
so a negative prompt is rejected rather than silently ignored (the stock pipeline ignores it).
Kontext's edits follow FluxKontextPipeline.__call__ with max_area = width x height (the size
asked for is the size returned): the reference is resized to the preferred Kontext resolution
nearest its aspect ratio, rounded down to whole latent patches, and VAE-encoded (argmax).

torch and diffusers are imported inside methods so the head can validate without importing them.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from triptych.families.flux import KONTEXT, FluxRules
from triptych.params import GenerationParams
from triptych_worker import resume
from triptych_worker.adapters.base import FamilyAdapter, pixels_uint8
from triptych_worker.preview import as_numpy
from triptych_worker.stages import PIXELS

if TYPE_CHECKING:
    import torch

    from triptych_worker.stages import StageBatch

TEXT = frozenset({"text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"})


class FluxAdapter(FamilyAdapter[FluxRules]):
    shared_tensors: ClassVar[frozenset[str]] = frozenset({"text_ids", "latent_image_ids", "image_ids"})
    stage_components: ClassVar[dict[str, frozenset[str]]] = {
        "TextEncodingStage": TEXT,
        "ImageEncodingStage": frozenset({"vae"}),  # Kontext only (FamilyAdapter.components_for)
        "TimestepPreparationStage": frozenset({"scheduler"}),
        "DenoisingStage": frozenset({"transformer", "scheduler"}),
        "DecodingStage": frozenset({"vae"}),
    }

    def load(self, components: set[str], given: Mapping[str, Any] | None = None) -> None:
        import diffusers
        from diffusers.image_processor import VaeImageProcessor

        self.pipe = self._load_stock(getattr(diffusers, self.package.class_name), components, given)
        # Without its VAE the stock pipeline falls back to a factor of 8; the package may differ.
        self.pipe.vae_scale_factor = self.rules.vae_scale_factor
        self.pipe.image_processor = VaeImageProcessor(vae_scale_factor=self.rules.vae_scale_factor * 2)

    def encode_texts(self, params: Sequence[GenerationParams]) -> dict[str, torch.Tensor]:
        p = params[0]  # compatible requests: the same outputs and sequence length
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=[q.prompt for q in params],
            device=self.device,
            num_images_per_prompt=p.num_outputs,
            max_sequence_length=p.max_sequence_length,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled, "text_ids": text_ids}

    def text_encoding_key(self, params: GenerationParams) -> tuple[Hashable, ...]:
        # No negative prompt (rejected) and no guidance: FLUX.1 embeds guidance in the transformer.
        return params.prompt, params.num_outputs, params.max_sequence_length

    def encode_image(self, batch: StageBatch) -> None:
        import torch

        from triptych.reference import reference_image

        p, pipe = batch.params, self.pipe
        image = reference_image(p.image, p.image_url)
        width, height = self.rules.encode_area(*image.size)
        pixels = pipe.image_processor.preprocess(pipe.image_processor.resize(image, height, width), height, width)
        # Its own VAE's dtype (the stock call takes the prompt's, the same in one process): a split image
        # encoder's prompt embeddings come from a prompt encoder that may run in another --dtype.
        dtype = pipe.vae.dtype
        pixels = pixels.to(device=self.device, dtype=dtype)
        latents = pipe._encode_vae_image(image=pixels, generator=None)  # argmax: no randomness
        latents = torch.cat([latents] * p.num_outputs, dim=0)
        lh, lw = latents.shape[2:]
        packed = pipe._pack_latents(latents, p.num_outputs, self.rules.latent_channels, lh, lw)
        ids = pipe._prepare_latent_image_ids(p.num_outputs, lh // 2, lw // 2, torch.device(self.device), dtype)
        ids[..., 0] = 1  # the reference's tokens: the latents' ids with the first coordinate 1
        batch.tensors.update(image_latents=packed, image_ids=ids)

    def prepare_latents(self, batch: StageBatch) -> None:
        import torch

        p = batch.params
        # A CPU generator, as in the stock reference call, makes the noise the same on every device.
        generator = torch.Generator("cpu").manual_seed(p.seed)
        args: tuple[Any, ...] = (
            p.num_outputs,
            self.rules.latent_channels,
            p.height,
            p.width,
            batch.tensors["prompt_embeds"].dtype,
            torch.device(self.device),
            generator,
        )
        if self.package.class_name == KONTEXT:
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
            sigmas=sigmas, mu=float(mu), guidance=float(p.guidance_scale) if self.rules.guidance_embeds else None
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
        image_latents = t.get("image_latents")
        img_ids = t["latent_image_ids"] if image_latents is None else torch.cat([t["latent_image_ids"], t["image_ids"]])
        guidance = None
        if meta["guidance"] is not None:
            guidance = torch.full([1], meta["guidance"], device=latents.device, dtype=torch.float32)
            guidance = guidance.expand(latents.shape[0])
        first = resume.start(scheduler, batch, t)
        for i in range(first, len(timesteps)):
            if batch.should_hand_off():
                resume.suspend(scheduler, batch, i, latents)
                return
            step_t = timesteps[i]
            self.pipe._current_timestep = step_t  # as the stock loop: what a step cache hook reads (step_cache.py)
            timestep = step_t.expand(latents.shape[0]).to(latents.dtype)
            with transformer.cache_context("cond"):
                noise_pred = transformer(
                    hidden_states=latents if image_latents is None else torch.cat([latents, image_latents], dim=1),
                    timestep=timestep / 1000,
                    guidance=guidance,
                    pooled_projections=t["pooled_prompt_embeds"],
                    encoder_hidden_states=t["prompt_embeds"],
                    txt_ids=t["text_ids"],
                    img_ids=img_ids,
                    joint_attention_kwargs={},
                    return_dict=False,
                )[0][:, : latents.size(1)]
            latents = scheduler.step(noise_pred, step_t, latents, return_dict=False)[0]
            batch.report_progress(i + 1, len(timesteps), latents)
        self.pipe._current_timestep = None
        batch.tensors = {"latents": latents}

    def latent_grid(self, latents: Any, params: GenerationParams) -> np.ndarray:
        # Packed [N, h/2 * w/2, C * 4] (2x2 patches, as FluxPipeline._pack_latents) -> [C, h, w].
        h, w = params.height // self.rules.vae_scale_factor, params.width // self.rules.vae_scale_factor
        packed = as_numpy(latents[0]).reshape(h // 2, w // 2, self.rules.latent_channels, 2, 2)
        return packed.transpose(2, 0, 3, 1, 4).reshape(self.rules.latent_channels, h, w)

    def decode(self, batch: StageBatch) -> None:
        p, vae = batch.params, self.pipe.vae
        latents = self.pipe._unpack_latents(
            self.on_device(batch)["latents"], p.height, p.width, self.rules.vae_scale_factor
        )
        latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
        image = vae.decode(latents.to(vae.device), return_dict=False)[0]
        images = self.pipe.image_processor.postprocess(image, output_type="np")  # [n, H, W, 3] in [0, 1]
        batch.tensors = {PIXELS: pixels_uint8(images)[:, None]}
