"""Which model a single-file checkpoint holds, from its tensor names and shapes alone.

Reads a .safetensors header (no tensor data), a GGUF file's tensor table (memory-mapped: city96's files
keep the original layout's names, their quantized shapes are read as the logical ones) or a .pth/.pt/.ckpt
pickle (torch.load with weights_only=True, memory-mapped) and asks each family that declares a single-file layout (`Family.single_file`, the original
layouts ComfyUI users keep: BFL for Flux, SAI for SD3/SD3.5, the PixArt repository's own) whether its
marker is there; that family's reader names the variant and derives the config values the weights pin
down. Values the weights cannot show come from the shipped config of the detected variant. No diffusers
import here: the ComfyUI process calls this to list checkpoints.
"""

from __future__ import annotations

import functools
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

from .shapes import Shapes

if TYPE_CHECKING:
    from ...families import SingleFile

CHECKPOINT_SUFFIXES = (".safetensors", ".sft", ".gguf", ".pth", ".pt", ".ckpt", ".bin")
# A whole-model checkpoint (ComfyUI's `checkpoints` folder, SAI's sd3.5_large.safetensors) keeps the
# transformer under this prefix next to the VAE and text encoders; only the transformer is read.
TRANSFORMER_PREFIX = "model.diffusion_model."
CONFIGS = Path(__file__).resolve().parent / "configs"


def _single_files() -> list:
    from ...families import FAMILIES

    return [family.single_file for family in FAMILIES if family.single_file is not None]


def supported_variants() -> dict:
    """variant → Variant(model, title, marker), for every family's single-file layout."""
    return {name: variant for single_file in _single_files() for name, variant in single_file.variants.items()}


def supported_list() -> str:
    return "; ".join(f"{title} ({marker})" for _, title, marker in supported_variants().values())


@dataclass
class Detected:
    """A recognised checkpoint: its variant, the shipped config folder and the values read from the weights."""

    path: Path
    variant: str
    overrides: dict
    single_file: SingleFile  # the declaration of the family whose layout this is (its titles, its converter)

    @property
    def family(self) -> str:
        return self.single_file.variants[self.variant].model

    @property
    def config_dir(self) -> Path:
        return CONFIGS / self.variant

    def expert(self) -> tuple[Path, str]:
        """(the file the model loads from, the pipeline's transformer this file is): a file that is one expert of a
        pair (Wan 2.2 A14B, its partner beside it) names the pair's first file and its own expert, so both files
        load one pool; any other file names itself and ""."""
        pair = self.single_file.experts
        files = pair.files(self.path) if pair and self.variant in pair.variants else None
        if files is None:
            return self.path, ""
        return files[0], "transformer" if self.path == files[0] else "transformer_2"

    def describe(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        return f"{self.single_file.variants[self.variant].title} ({self.variant}: {dims})"


class CheckpointFile:
    """A checkpoint's transformer tensors: shapes without loading data, tensors on request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"checkpoint {self.path} does not exist (or is not a file)")
        if self.path.suffix.lower() not in CHECKPOINT_SUFFIXES:
            raise ValueError(f"{self.path}: not a checkpoint file; expected one of {', '.join(CHECKPOINT_SUFFIXES)}")
        self._pickled: dict[str, torch.Tensor] | None = None
        self.quantization: dict[str, int] = {}  # GGUF: tensor name -> its GGML type, for the quantized ones
        if self.is_gguf:
            names = self._read_gguf_header()
        else:
            names = self._read_safetensors_header() if self._is_safetensors() else self._read_pickle()
        self.prefix = TRANSFORMER_PREFIX if any(k.startswith(TRANSFORMER_PREFIX) for k in names) else ""
        self.shapes = {k[len(self.prefix):]: s for k, s in names.items() if k.startswith(self.prefix)}

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix.lower() == ".gguf"

    def _read_gguf_header(self) -> dict[str, tuple[int, ...]]:
        import gguf

        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError) as error:
            raise self._broken(error) from None
        plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
        self.quantization = {t.name: int(t.tensor_type) for t in reader.tensors if t.tensor_type not in plain}
        return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}  # GGML order is reversed

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
        if self.is_gguf:  # quantized tensors stay quantized: diffusers' GGUFParameter
            from diffusers.models.model_loading_utils import load_gguf_checkpoint

            self._check_gguf_types()
            tensors = load_gguf_checkpoint(str(self.path), return_tensors=True)
            return {k: tensors[self.prefix + k] for k in self.shapes}
        try:
            with safe_open(self.path, framework="pt") as handle:
                return {k: handle.get_tensor(self.prefix + k) for k in self.shapes}
        except (SafetensorError, OSError) as error:
            raise self._broken(error) from None

    def _check_gguf_types(self) -> None:
        """One error naming a tensor whose GGUF type diffusers cannot dequantize, and the types it can."""
        import gguf
        from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

        name, kind = next(((n, k) for n, k in self.quantization.items() if k not in SUPPORTED_GGUF_QUANT_TYPES),
                          (None, None))
        if name is not None:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_GGUF_QUANT_TYPES))
            raise ValueError(f"{self.path}: tensor {name} is GGUF {gguf.GGMLQuantizationType(kind).name}, a quantization "
                             f"type this pack cannot dequantize (it reads F32, F16, {supported}); use another "
                             "quantization of the model, e.g. Q8_0, Q6_K, Q5_K_M or Q4_K_M")


# bitsandbytes blocks would load without their state (ComfyUI's scaled fp8 is read: scaled.py).
QUANTIZED_MARKERS = (".absmax", ".quant_map", ".quant_state")


def detect_checkpoint(path: str | Path | CheckpointFile) -> Detected:
    """The supported variant in the file at `path`, or one error saying what the file is not."""
    checkpoint = path if isinstance(path, CheckpointFile) else CheckpointFile(path)
    quantized = next((k for k in checkpoint.shapes if any(m in k for m in QUANTIZED_MARKERS)), None)
    if quantized:
        raise ValueError(f"{checkpoint.path} is a bitsandbytes-quantized checkpoint (tensor {quantized!r}), which "
                         "this pack does not read; use the bf16, fp16, fp8 (scaled too) or GGUF file")
    for single_file in _single_files():
        if single_file.marker in checkpoint.shapes:
            variant, overrides = single_file.read(Shapes(checkpoint.path, checkpoint.shapes, single_file.title))
            return Detected(checkpoint.path, variant, overrides, single_file)
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
    pickled = not path.lower().endswith((".safetensors", ".sft", ".gguf"))
    if pickled and not zipfile.is_zipfile(path):
        return None
    try:
        return detect_checkpoint(path).variant
    except (ValueError, OSError):
        return None
