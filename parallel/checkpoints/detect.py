"""Which model a single-file checkpoint holds, from its tensor names and shapes alone.

Reads a .safetensors header (no tensor data) or a .pth/.pt/.ckpt pickle (torch.load with weights_only=True,
memory-mapped), recognises the original layouts ComfyUI users keep (BFL for Flux, SAI for SD3/SD3.5, the
PixArt repository's own), and derives the config values the weights pin down. Values the weights cannot
show come from the shipped config of the detected variant. No diffusers import here: the ComfyUI process
calls this to list checkpoints.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".pth", ".pt", ".ckpt", ".bin")
# A whole-model checkpoint (ComfyUI's `checkpoints` folder, SAI's sd3.5_large.safetensors) keeps the
# transformer under this prefix next to the VAE and text encoders; only the transformer is read.
TRANSFORMER_PREFIX = "model.diffusion_model."
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SUPPORTED = {  # variant: (family, what users call it, the layout marker)
    "flux1-dev": ("flux", "Flux.1 dev", "BFL keys double_blocks.*, with guidance_in.*"),
    "flux1-schnell": ("flux", "Flux.1 schnell", "BFL keys double_blocks.*, no guidance_in.*"),
    "sd3-medium": ("sd3", "SD3 medium", "SAI keys joint_blocks.*, no q/k norm"),
    "sd3.5-medium": ("sd3", "SD3.5 medium", "SAI keys joint_blocks.*, q/k norm, x_block.attn2"),
    "sd3.5-large": ("sd3", "SD3.5 large", "SAI keys joint_blocks.*, q/k norm, no attn2"),
    "pixart-alpha-1024": ("pixart-alpha", "PixArt-α XL-2 1024-MS", "PixArt keys blocks.*.cross_attn, 120 tokens"),
    "pixart-sigma-1024": ("pixart-sigma", "PixArt-Σ XL-2 1024-MS", "PixArt keys blocks.*.cross_attn, 300 tokens"),
}
# Head sizes fixed by the architectures where no weight shows them: SAI's MMDiT sets hidden = 64 x depth,
# heads = depth (head size 64) unless q/k norms show it; PixArt-XL is 16 heads of 72.
SD3_HEAD_DIM, PIXART_HEAD_DIM = 64, 72
PIXART_CAPTION_TOKENS = {120: "pixart-alpha-1024", 300: "pixart-sigma-1024"}  # T5 lengths: α 120, Σ 300


def supported_list() -> str:
    return "; ".join(f"{name} ({marker})" for _, name, marker in SUPPORTED.values())


@dataclass
class Detected:
    """A recognised checkpoint: its variant, the shipped config folder and the values read from the weights."""

    path: Path
    variant: str
    overrides: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return SUPPORTED[self.variant][0]

    @property
    def config_dir(self) -> Path:
        return CONFIGS / self.variant

    def describe(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{SUPPORTED[self.variant][1]} ({self.variant}: {dims})"


class CheckpointFile:
    """A checkpoint's transformer tensors: shapes without loading data, tensors on request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint {self.path} does not exist (or is not a file)")
        if self.path.suffix.lower() not in CHECKPOINT_SUFFIXES:
            raise ValueError(f"{self.path}: not a checkpoint file; expected one of {', '.join(CHECKPOINT_SUFFIXES)}")
        self._pickled: dict[str, torch.Tensor] | None = None
        names = self._read_safetensors_header() if self._is_safetensors() else self._read_pickle()
        self.prefix = TRANSFORMER_PREFIX if any(k.startswith(TRANSFORMER_PREFIX) for k in names) else ""
        self.shapes = {k[len(self.prefix):]: s for k, s in names.items() if k.startswith(self.prefix)}

    def _is_safetensors(self) -> bool:
        return self.path.suffix.lower() in (".safetensors", ".sft")

    def _broken(self, error: Exception | str) -> ValueError:
        return ValueError(f"{self.path} cannot be read as a {self.path.suffix} checkpoint: {error}. The file is "
                          f"corrupted or truncated (an interrupted download?); download it again")

    def _read_safetensors_header(self) -> dict[str, tuple[int, ...]]:
        try:
            with safe_open(self.path, framework="pt") as handle:
                return {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        except (SafetensorError, OSError) as error:
            raise self._broken(error) from None

    def _read_pickle(self) -> dict[str, tuple[int, ...]]:
        # weights_only: a pickle can run code; this one only rebuilds tensors and plain containers.
        try:
            data = torch.load(self.path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(self.path))
        except pickle.UnpicklingError as error:  # torch's weights-only unpickler, for garbage too
            lines = [line.strip() for line in str(error).splitlines()]
            refused = next((line for line in lines if "Unsupported global" in line), None)
            if refused is None:  # torch's own text would suggest weights_only=False: only the cause is kept
                raise self._broken(next((line for line in lines if line.startswith("Unsupported")),
                                        "not a torch pickle")) from None
            raise ValueError(f"{self.path} holds more than tensors, so it was not unpickled (that could run "
                             f"code): {refused.split('. Please')[0]}") from None
        except Exception as error:  # torch raises RuntimeError, EOFError, OSError, ... for a damaged file
            raise self._broken(error) from None
        while isinstance(data, dict) and isinstance(data.get("state_dict"), dict):  # PixArt's {"state_dict": ...}
            data = data["state_dict"]
        if not isinstance(data, dict):
            raise ValueError(f"{self.path} holds a {type(data).__name__}, not a state dict of tensors")
        self._pickled = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        return {k: tuple(v.shape) for k, v in self._pickled.items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The transformer's tensors, under their original names without the whole-checkpoint prefix."""
        if self._pickled is not None:
            return {k: self._pickled[self.prefix + k] for k in self.shapes}
        try:
            with safe_open(self.path, framework="pt") as handle:
                return {k: handle.get_tensor(self.prefix + k) for k in self.shapes}
        except (SafetensorError, OSError) as error:
            raise self._broken(error) from None


def _count(shapes: dict, pattern: str) -> list[int]:
    """Sorted indices N of keys matching `pattern` (a regex with one (\\d+) group)."""
    found = {int(m.group(1)) for k in shapes if (m := re.match(pattern, k))}
    return sorted(found)


class _Shapes:
    """Shape lookups that fail with the file, the family and the missing key."""

    def __init__(self, checkpoint: CheckpointFile, family: str):
        self.checkpoint, self.family = checkpoint, family

    def __call__(self, key: str) -> tuple[int, ...]:
        try:
            return self.checkpoint.shapes[key]
        except KeyError:
            raise ValueError(f"{self.checkpoint.path} looks like a {self.family} checkpoint but has no tensor {key!r}: "
                             "the file is incomplete or a variant this pack does not support") from None

    def blocks(self, pattern: str) -> int:
        indices = _count(self.checkpoint.shapes, pattern)
        if indices != list(range(len(indices))):
            raise ValueError(f"{self.checkpoint.path}: {self.family} block indices {indices} are not 0..N-1: the file "
                             "is incomplete")
        return len(indices)

    def heads(self, hidden: int, head_dim: int) -> int:
        if hidden % head_dim:
            raise ValueError(f"{self.checkpoint.path}: {self.family} hidden size {hidden} is not a multiple of its "
                             f"head size {head_dim}")
        return hidden // head_dim


def _flux(checkpoint: CheckpointFile) -> Detected:
    shape = _Shapes(checkpoint, "Flux.1")
    hidden, in_channels = shape("img_in.weight")
    out_channels = shape("final_layer.linear.weight")[0]
    if in_channels != out_channels:
        raise ValueError(f"{checkpoint.path}: a Flux.1 transformer with {in_channels} input and {out_channels} output "
                         "channels (Fill / Depth / Canny); only text-to-image Flux.1 dev and schnell are supported")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    guidance = "guidance_in.in_layer.weight" in checkpoint.shapes
    return Detected(checkpoint.path, "flux1-dev" if guidance else "flux1-schnell", {
        "in_channels": in_channels, "attention_head_dim": head_dim,
        "num_attention_heads": shape.heads(hidden, head_dim),
        "num_layers": shape.blocks(r"double_blocks\.(\d+)\."),
        "num_single_layers": shape.blocks(r"single_blocks\.(\d+)\."),
        "joint_attention_dim": shape("txt_in.weight")[1],
        "pooled_projection_dim": shape("vector_in.in_layer.weight")[1],
        "guidance_embeds": guidance, "axes_dims_rope": _flux_rope_axes(head_dim),
    })


def _flux_rope_axes(head_dim: int) -> list[int]:
    """RoPE has no weights; Flux.1 splits its 128 head dims 16 (index) + 56 + 56 (rows, columns).

    Other head sizes keep those proportions: each spatial axis 7/16 of the head, rounded down to even.
    """
    spatial = head_dim * 7 // 16 // 2 * 2
    return [head_dim - 2 * spatial, spatial, spatial]


def _sd3(checkpoint: CheckpointFile) -> Detected:
    shape = _Shapes(checkpoint, "SD3")
    hidden, in_channels, patch, _ = shape("x_embedder.proj.weight")
    qk_norm = "joint_blocks.0.x_block.attn.ln_q.weight" in checkpoint.shapes
    dual = _count(checkpoint.shapes, r"joint_blocks\.(\d+)\.x_block\.attn2\.")
    variant = "sd3.5-medium" if dual else "sd3.5-large" if qk_norm else "sd3-medium"
    head_dim = shape("joint_blocks.0.x_block.attn.ln_q.weight")[0] if qk_norm else SD3_HEAD_DIM
    caption_dim, joint_dim = shape("context_embedder.weight")
    return Detected(checkpoint.path, variant, {
        "in_channels": in_channels, "out_channels": shape("final_layer.linear.weight")[0] // patch**2,
        "patch_size": patch, "attention_head_dim": head_dim, "num_attention_heads": shape.heads(hidden, head_dim),
        "num_layers": shape.blocks(r"joint_blocks\.(\d+)\."), "caption_projection_dim": caption_dim,
        "joint_attention_dim": joint_dim, "pooled_projection_dim": shape("y_embedder.mlp.0.weight")[1],
        "pos_embed_max_size": math.isqrt(shape("pos_embed")[1]), "dual_attention_layers": dual,
        "qk_norm": "rms_norm" if qk_norm else None,
    })


def _pixart(checkpoint: CheckpointFile) -> Detected:
    shape = _Shapes(checkpoint, "PixArt")
    keys = checkpoint.shapes
    if any(".q_norm." in k or ".k_norm." in k or ".sr." in k for k in keys):
        raise ValueError(f"{checkpoint.path}: a PixArt with q/k norm or KV compression, which diffusers' PixArt "
                         "transformer does not implement; supported: " + supported_list())
    micro = "csize_embedder.mlp.0.weight" in keys
    if "y_embedder.y_embedding" in keys:
        tokens = shape("y_embedder.y_embedding")[0]
        if tokens not in PIXART_CAPTION_TOKENS:
            raise ValueError(f"{checkpoint.path}: a PixArt with {tokens} caption tokens; known are "
                             f"{ {v: k for k, v in PIXART_CAPTION_TOKENS.items()} }")
        variant = PIXART_CAPTION_TOKENS[tokens]
    else:  # no caption null-embedding saved: ComfyUI's rule, α-1024 has micro-conditions and Σ has none
        variant = "pixart-alpha-1024" if micro else "pixart-sigma-1024"
    hidden, in_channels, patch, _ = shape("x_embedder.proj.weight")
    overrides = {
        "in_channels": in_channels, "out_channels": shape("final_layer.linear.weight")[0] // patch**2,
        "patch_size": patch, "attention_head_dim": PIXART_HEAD_DIM,
        "num_attention_heads": shape.heads(hidden, PIXART_HEAD_DIM), "num_layers": shape.blocks(r"blocks\.(\d+)\."),
        "cross_attention_dim": hidden, "caption_channels": shape("y_embedder.y_proj.fc1.weight")[1],
        "use_additional_conditions": micro,
    }
    if "pos_embed" in keys:  # the saved sin-cos table gives the training resolution (latent side = grid x patch)
        sample_size = math.isqrt(shape("pos_embed")[1]) * patch
        # PixArt's pe_interpolation is resolution / 512 (1 at 512 px, 2 at 1024, 4 at 2K)
        overrides.update(sample_size=sample_size, interpolation_scale=max(sample_size // 64, 1))
    return Detected(checkpoint.path, variant, overrides)


# Weights stored with per-tensor scales (ComfyUI's fp8_scaled) or bitsandbytes blocks would load unscaled.
QUANTIZED_MARKERS = ("scaled_fp8", ".scale_weight", ".weight_scale", ".absmax", ".quant_map", ".quant_state")

LAYOUTS = (  # the key that marks each original layout, and its reader
    ("double_blocks.0.img_attn.qkv.weight", _flux),
    ("joint_blocks.0.x_block.attn.qkv.weight", _sd3),
    ("blocks.0.cross_attn.q_linear.weight", _pixart),
)


def detect_checkpoint(path: str | Path | CheckpointFile) -> Detected:
    """The supported variant in the file at `path`, or one error saying what the file is not."""
    checkpoint = path if isinstance(path, CheckpointFile) else CheckpointFile(path)
    quantized = next((k for k in checkpoint.shapes if any(m in k for m in QUANTIZED_MARKERS)), None)
    if quantized:
        raise ValueError(f"{checkpoint.path} is a quantized checkpoint (tensor {quantized!r}: fp8-scaled or "
                         "bitsandbytes), which would load without its scales; use the bf16, fp16 or plain fp8 file")
    for marker, reader in LAYOUTS:
        if marker in checkpoint.shapes:
            return reader(checkpoint)
    sample = sorted(checkpoint.shapes)[:5]
    raise ValueError(f"{checkpoint.path} is not a supported single-file transformer checkpoint (first tensors: "
                     f"{sample}). Supported: {supported_list()}. A diffusers-format model goes under "
                     "models/diffusers as the whole pipeline folder")


def checkpoint_variant(path: str | Path) -> str | None:
    """The supported variant in `path`, or None; cached per file version, for listing model folders.

    A pickle that is not a zip archive (legacy torch.save) cannot be memory-mapped and would be read whole,
    so listing skips it; loading it by path still works.
    """
    stat = os.stat(path)
    return _cached_variant(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _cached_variant(path: str, mtime_ns: int, size: int) -> str | None:
    pickled = not path.lower().endswith((".safetensors", ".sft"))
    if pickled and not zipfile.is_zipfile(path):
        return None
    try:
        return detect_checkpoint(path).variant
    except (ValueError, OSError):
        return None
