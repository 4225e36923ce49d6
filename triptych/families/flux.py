"""FLUX.1 (FluxPipeline) and FLUX.1 Kontext (FluxKontextPipeline): request rules and tensor shapes."""

from __future__ import annotations

from triptych.families.package import ModelPackage
from triptych.families.rules import FamilyRules
from triptych.params import GenerationParams
from triptych.protocol.tensors import TensorSpec

KONTEXT = "FluxKontextPipeline"
# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS (width, height): a reference is encoded at the one
# nearest its aspect ratio. Copied so the head and simulated workers need no diffusers (a test holds it equal).
KONTEXT_RESOLUTIONS = (
    (672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184), (944, 1104),
    (1024, 1024),
    (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752), (1456, 720), (1504, 688), (1568, 672),
)  # fmt: skip


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

    def text_outputs(self, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        n, length = params.num_outputs, params.max_sequence_length
        return [
            TensorSpec("prompt_embeds", dtype, (n, length, self.text_dim)),
            TensorSpec("pooled_prompt_embeds", dtype, (n, self.pooled_dim)),
            TensorSpec("text_ids", dtype, (length, 3)),
        ]

    def image_outputs(self, params: GenerationParams, dtype: str = "float32") -> list[TensorSpec]:
        """Kontext's encoded reference: image_latents [n, S', 4C] and image_ids [S', 3]."""
        if not self.takes_reference:
            return []
        width, height = self.reference_area(params)
        sequence = (height // self.size_multiple) * (width // self.size_multiple)
        return [
            TensorSpec("image_latents", dtype, (params.num_outputs, sequence, self.latent_channels * 4)),
            TensorSpec("image_ids", dtype, (sequence, 3)),
        ]

    def reference_area(self, params: GenerationParams) -> tuple[int, int]:
        """The (width, height) the request's reference is encoded at. A reference given by URL is not
        fetched here: the output's aspect ratio stands in for its own."""
        return self.encode_area(
            *(_image_size(params.image) if params.image is not None else (params.width, params.height))
        )

    def encode_area(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) a reference of `width` x `height` is encoded at, as FluxKontextPipeline
        picks it: the Kontext resolution nearest its aspect ratio (its sides rounded down to whole
        patches first), rounded down to whole patches."""
        multiple = self.size_multiple
        width, height = max(width - width % multiple, 1), max(height - height % multiple, 1)
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
        return width // multiple * multiple, height // multiple * multiple

    def latent_spec(self, params: GenerationParams, dtype: str = "float32") -> TensorSpec:
        """In the model's dtype: FluxPipeline makes its noise in the prompt embeddings' (the text encoder's)."""
        return TensorSpec("latents", dtype, (params.num_outputs, self._sequence(params), self.latent_channels * 4))


def _image_size(data: bytes) -> tuple[int, int]:
    """An image's (width, height) from its header (nothing decoded); (1, 1) for bytes PIL cannot read,
    which the loaded image encoder refuses anyway."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception:
        return 1, 1
