"""Wan2.1 text-to-video (WanPipeline) split into role stages.

Crosses encoder -> denoiser (tensors): prompt_embeds [n, L, D], latents [n, C, T', H', W'] (float32),
and negative_prompt_embeds [n, L, D] when guidance_scale > 1 (classifier-free guidance, as the
stock pipeline decides); (meta): timesteps (list of float), the encoder's schedule, which the
denoiser's own scheduler must reproduce.
Crosses denoiser -> decoder (tensors): latents [n, C, T', H', W'].
Decoder output: pixels uint8 [n, num_frames, H, W, 3]; meta fps.

Wan2.2 packages (two experts via boundary_ratio, or expand_timesteps) are rejected at load.
torch and diffusers are imported inside methods so the head can validate without importing them.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from triptych.families.wan import FPS, WanRules
from triptych.families.wan import uses_cfg as _uses_cfg
from triptych.params import GenerationParams
from triptych_worker import resume
from triptych_worker.adapters.base import FamilyAdapter, pixels_uint8
from triptych_worker.preview import as_numpy
from triptych_worker.stages import PIXELS

if TYPE_CHECKING:
    import torch

    from triptych_worker.stages import StageBatch


class WanAdapter(FamilyAdapter[WanRules]):
    stage_components: ClassVar[dict[str, frozenset[str]]] = {
        "TextEncodingStage": frozenset({"text_encoder", "tokenizer"}),
        "TimestepPreparationStage": frozenset({"scheduler"}),
        "DenoisingStage": frozenset({"transformer", "scheduler"}),
        "DecodingStage": frozenset({"vae"}),
    }

    def load(self, components: set[str], given: Mapping[str, Any] | None = None) -> None:
        from diffusers import WanPipeline

        self.pipe = self._load_stock(WanPipeline, components, given)
        self.pipe.vae_scale_factor_spatial = self.rules.scale_spatial
        self.pipe.vae_scale_factor_temporal = self.rules.scale_temporal

    def encode_texts(self, params: Sequence[GenerationParams]) -> dict[str, torch.Tensor]:
        p = params[0]  # compatible requests: the same guidance, outputs and sequence length
        prompt_embeds, negative_embeds = self.pipe.encode_prompt(
            prompt=[q.prompt for q in params],
            negative_prompt=[q.negative_prompt or "" for q in params],  # the stock default for None
            do_classifier_free_guidance=_uses_cfg(p),
            num_videos_per_prompt=p.num_outputs,
            max_sequence_length=p.max_sequence_length,
            device=self.device,
        )
        if negative_embeds is None:
            return {"prompt_embeds": prompt_embeds}
        return {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_embeds}

    def text_encoding_key(self, params: GenerationParams) -> tuple[Hashable, ...]:
        # The negative prompt is encoded only when classifier-free guidance runs (guidance_scale > 1).
        p = params
        return p.prompt, p.negative_prompt, _uses_cfg(p), p.num_outputs, p.max_sequence_length

    def prepare_latents(self, batch: StageBatch) -> None:
        import torch

        p = batch.params
        # A CPU generator, as in the stock reference call, makes the noise the same on every device.
        generator = torch.Generator("cpu").manual_seed(p.seed)
        batch.tensors["latents"] = self.pipe.prepare_latents(
            p.num_outputs,
            self.rules.latent_channels,
            p.height,
            p.width,
            p.num_frames,
            torch.float32,
            torch.device(self.device),
            generator,
        )

    def prepare_timesteps(self, batch: StageBatch) -> None:
        self.pipe.scheduler.set_timesteps(batch.params.num_inference_steps, device=self.device)
        batch.meta["timesteps"] = [float(t) for t in self.pipe.scheduler.timesteps]

    def denoise(self, batch: StageBatch) -> None:
        p, t, transformer, scheduler = batch.params, self.on_device(batch), self.pipe.transformer, self.pipe.scheduler
        scheduler.set_timesteps(p.num_inference_steps, device=self.device)
        timesteps = scheduler.timesteps
        if [float(x) for x in timesteps] != batch.meta["timesteps"]:
            raise ValueError(
                "the denoiser's scheduler disagrees with the encoder's timesteps; "
                "run every role from the same model package"
            )
        dtype = transformer.dtype
        prompt_embeds = t["prompt_embeds"].to(dtype)
        negative_embeds = t["negative_prompt_embeds"].to(dtype) if _uses_cfg(p) else None
        latents = t["latents"]
        first = resume.start(scheduler, batch, t)
        for i in range(first, len(timesteps)):
            if batch.should_hand_off():
                resume.suspend(scheduler, batch, i, latents)
                return
            step_t = timesteps[i]
            self.pipe._current_timestep = step_t  # as the stock loop: what a step cache hook reads (step_cache.py)
            model_input = latents.to(dtype)
            timestep = step_t.expand(latents.shape[0])
            cache = {"step_index": i, "sigma": float(scheduler.sigmas[i]), "num_inference_steps": len(timesteps)}
            predict = functools.partial(self._predict, model_input, timestep, cache)
            branches = [functools.partial(predict, "cond", prompt_embeds)]
            if negative_embeds is not None:
                branches.append(functools.partial(predict, "uncond", negative_embeds))
            noise_pred, *uncond = self.run_branches(branches)
            if uncond:
                noise_pred = uncond[0] + p.guidance_scale * (noise_pred - uncond[0])
            latents = scheduler.step(noise_pred, step_t, latents, return_dict=False)[0]
            batch.report_progress(i + 1, len(timesteps), latents)
        self.pipe._current_timestep = None
        batch.tensors = {"latents": latents}

    def _predict(
        self,
        model_input: torch.Tensor,
        timestep: torch.Tensor,
        cache: dict[str, float],
        name: str,
        embeds: torch.Tensor,
    ) -> torch.Tensor:
        """One transformer pass of one guidance branch ("cond" or "uncond")."""
        transformer = self.pipe.transformer
        with transformer.cache_context(name, **cache):
            return cast(
                "torch.Tensor",
                transformer(
                    hidden_states=model_input, timestep=timestep, encoder_hidden_states=embeds, return_dict=False
                )[0],
            )

    def latent_grid(self, latents: Any, params: GenerationParams) -> np.ndarray:
        # [N, C, F, h, w]: the middle latent frame of the first video.
        return as_numpy(latents[0, :, latents.shape[2] // 2])

    def decode(self, batch: StageBatch) -> None:
        import torch

        vae = self.pipe.vae
        latents = cast("torch.Tensor", batch.tensors["latents"]).to(vae.device, dtype=vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")  # [n, F, H, W, 3] in [0, 1]
        batch.tensors = {PIXELS: pixels_uint8(frames)}
        batch.meta["fps"] = FPS
