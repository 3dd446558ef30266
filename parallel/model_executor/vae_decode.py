"""Decode latents with the pipeline's VAE across ranks: diffusers' own tiled decode, its tiles spread out.

diffusers' `tiled_decode` cuts the latents into overlapping tiles, decodes each with `vae.decoder` (a
video VAE calls it once per latent frame of a tile, with a causal cache) and blends the overlaps.
Every rank runs that same function with the decoder swapped for a dispatcher: the calls of the tiles a
rank owns (tile t → rank t mod world) decode for real, the others only take their output's shape (the
decoder run on the meta device: no compute, no memory) and give zeros. The owners then send their tiles to rank 0, which
runs `tiled_decode` once more with a decoder that hands back the decoded tiles in call order — so the
tiling, blending, cropping and clamping are diffusers' own and the image equals the single-process
tiled decode exactly. With tiles sized so that each rank owns about one (`fit_tiles`), a rank holds
about 1/world of a plain decode's activations.

Latents are in the VAE's own space (ComfyUI's LATENT; a pipeline's output after its own
un-normalisation); the result is the VAE's sample (in [-1, 1]; MiniMax-H3's ImageNet-normalised RGB, which its
pipeline wrapper turns into that). MiniMax-H3's VAE tiles each 17-frame chunk itself: every decoder call (a spatial
tile of a chunk) is a tile here.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.func import functional_call


class TilingError(ValueError):
    """A VAE without diffusers tiling, or tile settings it cannot use; one line naming the fix."""


OVERLAP = 8  # a tile overlaps its neighbour by 1/OVERLAP of its side (a power of 2: diffusers' int() stays exact)


def fit_tiles(vae, latents: torch.Tensor, world: int, tile: int = 0) -> int:
    """Set `vae`'s tiles for these latents and return how many there are. `tile`: the tile side in latent
    pixels (a multiple of 8; an eighth of it overlaps its neighbour); 0: tiles of about 1/⌈√world⌉ of the
    longer side (square, as every diffusers VAE takes them), at least one per rank."""
    height, width = latents.shape[-2:]
    if tile:
        if tile % OVERLAP:
            raise TilingError(f"tile {tile} must be a multiple of {OVERLAP} latent pixels (an eighth of it overlaps)")
        unit = tile // OVERLAP
    else:  # at least ceil(√world) strides along the longer side, fewer tiles only while every rank gets one
        side = math.ceil(math.sqrt(world))
        unit = max(1, max(height, width) // ((OVERLAP - 1) * side))
        while unit > 1 and _count(height, width, unit) < world:
            unit -= 1
        if OVERLAP * unit >= max(height, width):  # one tile holds it all: no slivers beside it
            unit = math.ceil(max(height, width) / (OVERLAP - 1))
    stride, size = (OVERLAP - 1) * unit, OVERLAP * unit
    if vae.config.get("timestep_conditioning"):
        raise TilingError(f"this {type(vae).__name__} decodes conditioned on a timestep, which the pool's decode does not "
                          "give yet; decode with ComfyUI's VAE Decode")
    scale = _spatial_scale(vae)
    if hasattr(vae, "tile_sample_stride_height"):  # video VAEs (Wan, HunyuanVideo, ...): size and stride
        vae.enable_tiling(tile_sample_min_height=size * scale, tile_sample_min_width=size * scale,
                          tile_sample_stride_height=stride * scale, tile_sample_stride_width=stride * scale)
    elif hasattr(vae, "tile_overlap_factor"):  # AutoencoderKL: a size and the overlapping fraction
        vae.enable_tiling()
        vae.tile_sample_min_size, vae.tile_latent_min_size = size * scale, size
        vae.tile_overlap_factor = 1 / OVERLAP
    elif hasattr(vae, "tile_sample_min_overlap_height"):  # MiniMax-H3: a size and a least overlap, per 17-frame chunk
        overlap = (size - stride) * scale
        vae.enable_tiling(tile_sample_min_height=size * scale, tile_sample_min_width=size * scale,
                          tile_sample_min_overlap_height=overlap, tile_sample_min_overlap_width=overlap)
        return _chunked_calls(vae, latents)
    else:
        raise TilingError(f"{type(vae).__name__} has no tiled decode in diffusers; decode with ComfyUI's VAE Decode")
    return _count(height, width, unit)


def _chunked_calls(vae, latents: torch.Tensor) -> int:
    """Decoder calls of a VAE that tiles each temporal chunk itself (MiniMax-H3's `decode`): its own spatial tiles
    (it widens the overlaps to cover the frame exactly) times its chunks, each call a tile of the dispatch."""
    scale = vae.spatial_compression_ratio
    rows, cols = (len(vae._split_tiles(side * scale, size, overlap)[0]) for side, size, overlap in (
        (latents.shape[-2], vae.tile_sample_min_height, vae.tile_sample_min_overlap_height),
        (latents.shape[-1], vae.tile_sample_min_width, vae.tile_sample_min_overlap_width)))
    drop = vae.config.token_drop
    chunks = math.ceil((latents.shape[2] + drop) / vae.tokens_chunk_size) - int(drop > 0)
    return rows * cols * chunks


def tiled_decode(vae, latents: torch.Tensor, rank: int, world: int, group=None,
                 on_tile: Callable[[int], None] | None = None) -> torch.Tensor | None:
    """diffusers' tiled decode of `latents` (configured by `fit_tiles`), its tiles decoded over the
    ranks of `group`; rank 0 returns the image, the others None. Every rank must call it alike.
    `on_tile(t)`: called as each tile this rank decodes begins."""
    with torch.no_grad():
        owned = _Dispatch(vae.decoder, lambda tile: tile % world == rank, on_tile)
        with _decoder(vae, owned):
            _tiled_decode(vae, latents)
        outputs = _collect(owned, rank, world, group, latents.device)
        if rank != 0:
            return None
        with _decoder(vae, _Replay(outputs)):
            return _tiled_decode(vae, latents)


def _tiled_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """diffusers' tiled decode; LTX-2's VAE also takes a timestep embedding, none without timestep conditioning;
    MiniMax-H3's `decode` tiles by itself (tiling on)."""
    if not hasattr(vae, "tiled_decode"):
        return vae.decode(latents, return_dict=False)[0]
    temb = {"temb": None} if "temb" in inspect.signature(vae.tiled_decode).parameters else {}
    return vae.tiled_decode(latents, **temb, return_dict=False)[0]


class _Dispatch(torch.nn.Module):
    """Stands in for `vae.decoder`: decodes the calls of the tiles this rank owns, shapes the others.

    A tile begins with a call without `first_chunk` (image VAEs: one call per tile) or with
    first_chunk=True (video VAEs: the first latent frame of a tile)."""

    def __init__(self, decoder: torch.nn.Module, mine: Callable[[int], bool], on_tile: Callable[[int], None] | None):
        super().__init__()
        self.decoder, self.mine, self.on_tile = decoder, mine, on_tile
        self.tile, self.calls = -1, []  # per call: (tile, output or its shape and dtype)
        state = {**dict(decoder.named_parameters()), **dict(decoder.named_buffers())}
        self._meta = {name: torch.empty_like(t, device="meta") for name, t in state.items()}

    def forward(self, *args, **kwargs):
        if kwargs.get("first_chunk", True):
            self.tile += 1
            if self.on_tile is not None and self.mine(self.tile):
                self.on_tile(self.tile)
        if self.mine(self.tile):
            out = self.decoder(*args, **kwargs)
            self.calls.append((self.tile, out))
            return out.clone()  # tiled_decode blends its tiles in place
        # Another rank's tile: its shape only. A video VAE's causal cache (a kwarg, filled in place) then
        # holds meta tensors until diffusers clears it for the next tile.
        meta = functional_call(self.decoder, self._meta, tuple(a.to("meta") if torch.is_tensor(a) else a for a in args), kwargs)
        self.calls.append((self.tile, (tuple(meta.shape), meta.dtype)))
        return torch.zeros(meta.shape, dtype=meta.dtype, device=args[0].device)


class _Replay(torch.nn.Module):
    """Stands in for `vae.decoder` on rank 0's second pass: the decoded calls, in order."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs = iter(outputs)

    def forward(self, *args, **kwargs):
        return next(self.outputs)


def _collect(owned: _Dispatch, rank: int, world: int, group, device: torch.device) -> list[torch.Tensor]:
    """Every call's output on rank 0, sent there by the rank that decoded it (in call order)."""
    outputs = []
    host = device.type != "cpu" and dist.get_backend(group) == "gloo"  # gloo sends host memory only (--share-gpus)
    for tile, value in owned.calls:
        owner = tile % world
        if rank == 0:
            if owner == 0:
                outputs.append(value)
            else:
                shape, dtype = value
                buffer = torch.empty(shape, dtype=dtype, device="cpu" if host else device)
                dist.recv(buffer, src=dist.get_global_rank(group, owner) if group else owner, group=group)
                outputs.append(buffer.to(device))
        elif owner == rank:
            dist.send((value.cpu() if host else value).contiguous(), dst=dist.get_global_rank(group, 0) if group else 0,
                      group=group)
    return outputs


@contextlib.contextmanager
def _decoder(vae, stand_in: torch.nn.Module):
    original = vae.decoder
    vae.decoder = stand_in
    try:
        yield
    finally:
        vae.decoder = original


def _spatial_scale(vae) -> int:
    """Sample pixels per latent pixel as the VAE's tiled_decode counts them."""
    scale = getattr(vae, "spatial_compression_ratio", None)
    return int(scale) if scale else 2 ** (len(vae.config.block_out_channels) - 1)


def _count(height: int, width: int, unit: int) -> int:
    stride = (OVERLAP - 1) * unit
    return math.ceil(height / stride) * math.ceil(width / stride)
