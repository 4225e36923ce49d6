"""`--decoder-sp N` for Wan video: the VAE decode split over ranks by rows of every frame, exactly.

Each rank decodes one horizontal band of the latent frames (latent rows / N of them) through the
stock `AutoencoderKLWan` decoder, frame after frame with its own causal feature cache, as one
rank does for the whole frame. What one band cannot compute alone it gets from its neighbours:

- every 3x3(x3) convolution first takes the rows its kernel reaches across the band's edges
  (halo exchange, send/recv with the band above and below; zeros at the frame's edges, exactly
  the padding one rank applies there), so each output row sees the inputs it sees on one rank;
- the decoder's one attention block (per frame, over all pixels, at the lowest resolution) runs
  on the all-gathered frame and keeps its own band;
- everything else in the decoder is per pixel (RMS norm over channels, SiLU, 1x1 convolutions,
  nearest 2x upsampling, the causal time convolutions), so a band's rows are the frame's rows.

A time split would not do: the decoder's causal convolutions cache the previous frames' features,
so a rank starting mid-video would need every earlier frame decoded first. A tile split with
overlap and blending (the stock tiled decode) changes the pixels; this split does not: each output
pixel is computed from the same inputs by the same layers. The pixels equal the 1-rank decoder's
byte for byte when a band's convolutions run the kernel the whole frame's run (on CPU, PyTorch
picks oneDNN or its own im2col path by tensor size: at 256x256 the tiny Wan's bands and frames
agree, tests/e2e/test_parallel_roles.py; at 64x64 some layers switch and values differ by ~1e-6).
"""

from __future__ import annotations

from types import MethodType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from triptych_worker.parallel.mesh import RankMesh

ROWS = 3  # the height dimension of the decoder's [B, C, T, H, W] activations


class RowParallelDecoder:
    """This rank's band of rows through the Wan VAE decoder; `work` counts the output pixels it decoded."""

    kind = "decode"

    def __init__(self, mesh: RankMesh):
        self.mesh = mesh
        self.ranks = mesh.sp_ranks
        self.index = self.ranks.index(mesh.rank)
        self.work = 0

    # --- installing -------------------------------------------------------------------------

    def install(self, vae: Any) -> None:
        """Make `vae.decode` decode this rank's band and return the whole frame on every rank."""
        import torch.nn as nn
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d

        if vae.config.patch_size is not None:
            raise ValueError("--decoder-sp: patchified Wan VAEs (Wan2.2) are not supported")
        if vae.use_tiling:
            raise ValueError("--decoder-sp: the VAE decodes in tiles already; it splits untiled decodes only")
        for module in vae.decoder.modules():
            if isinstance(module, WanCausalConv3d):
                module.forward = MethodType(self._causal_conv, module)
            elif isinstance(module, nn.Conv2d) and module.padding not in ((0, 0), "valid"):
                module.forward = MethodType(self._conv2d, module)  # type: ignore[method-assign]
            elif isinstance(module, WanAttentionBlock):
                module.forward = MethodType(self._whole_frame(type(module).forward), module)
        vae.post_quant_conv.register_forward_hook(lambda m, a, out: out.chunk(len(self.ranks), dim=ROWS)[self.index])
        vae.decoder.register_forward_hook(self._join)

    def rows_divide(self, latent_rows: int) -> bool:
        return latent_rows % len(self.ranks) == 0

    # --- the decoder's layers on a band ------------------------------------------------------

    def _causal_conv(self, conv: Any, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        """WanCausalConv3d.forward with the rows across the band's edges taken from the neighbours."""
        import torch
        import torch.nn.functional as F

        padding = list(conv._padding)  # (w, w, h, h, t_before, 0)
        if cache_x is not None and padding[4] > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            padding[4] -= cache_x.shape[2]
        x = self._with_halo(x, padding[2], ROWS)
        padding[2] = padding[3] = 0
        return conv._conv_forward(F.pad(x, padding), conv.weight, conv.bias)

    def _conv2d(self, conv: Any, x: torch.Tensor) -> torch.Tensor:
        """nn.Conv2d.forward (the upsamplers' 3x3) over the band plus its halo rows."""
        import torch.nn.functional as F

        x = self._with_halo(x, conv.padding[0], 2)
        return F.conv2d(x, conv.weight, conv.bias, conv.stride, (0, conv.padding[1]), conv.dilation, conv.groups)

    def _whole_frame(self, forward: Any) -> Any:
        def run(block: Any, x: torch.Tensor) -> torch.Tensor:
            whole = self.mesh.all_gather_cat(x, self.mesh.sp_group, dim=ROWS)
            return forward(block, whole).chunk(len(self.ranks), dim=ROWS)[self.index]

        return run

    def _join(self, module: Any, args: Any, band: torch.Tensor) -> torch.Tensor:
        self.work += band.shape[0] * band.shape[2] * band.shape[3] * band.shape[4]
        return self.mesh.all_gather_cat(band, self.mesh.sp_group, dim=ROWS)

    # --- halo exchange ------------------------------------------------------------------------

    def _with_halo(self, x: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
        """`x` with `rows` rows of the band above before it and of the band below after it (zeros at the
        frame's edges)."""
        import torch

        if rows == 0:
            return x
        if x.shape[dim] < rows:
            raise ValueError(f"a band of {x.shape[dim]} rows is thinner than the {rows}-row halo it must lend")
        above, below = self.mesh.exchange_edges(
            x.narrow(dim, 0, rows),
            x.narrow(dim, x.shape[dim] - rows, rows),
            self.ranks,
        )
        return torch.cat([above, x, below], dim=dim)
