"""A full-pipeline worker over N devices: rank 0 encodes and decodes, every rank denoises.

A full-pipeline worker (--disagg-full-pipeline) runs every stage of a request. With --num-gpus N
its denoising is a multi-device denoiser's (ranks.py: the transformer split by the parallel degrees
over N rank processes), while the text (and reference) encoders and the VAE decode run on rank 0
alone, on its device: the followers load the transformer only, and a request's embeddings reach
them with its job, as a denoiser's inputs do. The stages are the disaggregated roles' (encoder,
denoiser, decoder), so the pixels are a one-device full-pipeline worker's where the degrees give
one rank's bytes (docs/parallelism.md).

    # rank 0, inside `triptych serve --num-gpus N --disagg-full-pipeline`:
    pipeline = start_full_pipeline_ranks(args, catalog)
    pipeline.run(batch)  # encode here, denoise on every rank, decode here
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from triptych.config import ServeArgs
from triptych.lora import LoraCatalog
from triptych.roles import Role
from triptych_worker.batching import run_in_turn
from triptych_worker.parallel.ranks import ParallelPipeline, rank_device, start_ranks
from triptych_worker.stages import StageBatch

if TYPE_CHECKING:
    from triptych.params import GenerationParams
    from triptych_worker.encoder_cache import EncoderCache
    from triptych_worker.lora import LoraAdapters
    from triptych_worker.pipeline import RolePipeline
    from triptych_worker.preview import LatentPreviewer
    from triptych_worker.step_cache import StepCaching

log = logging.getLogger(__name__)


class FullPipelineRanks:
    """What a full-pipeline worker with several devices runs: its encoder and decoder stages on rank
    0, its denoiser stages on every rank."""

    hands_off = False  # a full-pipeline worker hands on pixels, never a denoising state

    def __init__(self, encode: RolePipeline, denoise: ParallelPipeline, decode: RolePipeline):
        self.encode, self.denoise, self.decode = encode, denoise, decode

    def validate(self, params: GenerationParams) -> None:
        """Raise ValueError naming the field when the model cannot serve `params` (one family: any part's check)."""
        self.encode.validate(params)

    def run(self, batch: StageBatch) -> StageBatch:
        self.denoise.check(batch)  # before encoding: what the ranks cannot run is refused first
        self.encode.run(batch)
        self.denoise.run(batch)
        return self.decode.run(batch)

    def run_many(self, batches: list[StageBatch]) -> list[Exception | None]:
        """Compatible requests through the three parts, each as one batched forward; a request that
        fails in one part leaves the group there (per request, the exception or None)."""
        refused = self.denoise.refusals(batches)  # before encoding: what the ranks cannot run is refused first
        return run_in_turn([self.encode.run_many, self.denoise.run_many, self.decode.run_many], batches, refused)

    @property
    def encoder_cache(self) -> EncoderCache | None:
        return self.encode.encoder_cache

    @property
    def loras(self) -> LoraAdapters | None:
        """The denoising ranks' adapters (an adapter's transformer part, the costly one to load), which the
        heartbeats report; rank 0's encoding holds the text-encoder parts apart."""
        return self.denoise.loras

    @property
    def step_cache(self) -> StepCaching | None:
        return self.denoise.step_cache

    def previewer(self) -> LatentPreviewer | None:
        return self.denoise.previewer()

    def describe(self) -> str:
        ranks = self.denoise.rank.mesh.world_size
        return (
            f"full pipeline on {ranks} ranks: encode and decode on rank 0 ({self.encode.describe()}; "
            f"{self.decode.describe()}), denoise on every rank"
        )


def start_full_pipeline_ranks(args: ServeArgs, lora_catalog: LoraCatalog) -> FullPipelineRanks:
    """Rank 0: start the denoising ranks (the followers load the denoiser's stages only), then load
    the encoder's and decoder's stages here, on rank 0's device. `lora_catalog`: the worker's,
    checked at its start, which rank 0's encoding and denoising share (ranks.py)."""
    from triptych_worker.pipeline import load_role_pipeline

    denoise = start_ranks(args, lora_catalog)
    device = rank_device(args, 0)
    encode = load_role_pipeline(
        args.model_path,
        Role.ENCODER,
        device,
        encoder_cache_bytes=args.encoder_cache_bytes,
        lora_catalog=lora_catalog,
        lora_cache_bytes=args.lora_cache_bytes,
        dtype=args.compute_dtype(device),
    )
    decode = load_role_pipeline(args.model_path, Role.DECODER, device, dtype=args.compute_dtype(device))
    pipeline = FullPipelineRanks(encode, denoise, decode)
    log.info("%s", pipeline.describe())
    return pipeline
