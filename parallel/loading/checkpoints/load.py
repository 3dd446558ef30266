"""A diffusers pipeline from a single-file transformer checkpoint and the configs shipped in parallel/loading/checkpoints/configs.

The transformer is converted with its family's converter (`SingleFile.convert`, parallel/families/),
checked against the config the detection derived, and loaded with `from_single_file(..., config=<shipped folder>, local_files_only=True)`:
nothing comes from a model hub. The pipeline has the transformer and the shipped scheduler; VAE and text
encoders are None, because the pool samples from ComfyUI's embeddings and latents.

A GGUF file stays quantized in memory: its quantized tensors are diffusers' GGUFParameter, converted
like any other (row splits and joins of their blocks), and diffusers' GGUF quantizer swaps the linear
layers that hold them for ones that dequantize on the fly, in the compute dtype (--dtype; bf16 by
default). Every parallel layout runs on such layers unchanged; weight sharding does not (see loading.py).

An fp8 file (plain fp8, or ComfyUI's scaled fp8) stays fp8 in memory too: its linear layers keep the stored
weight and its scale and dequantize when they run (fp8.py). With weight sharding (`keep_fp8=False`: FSDP
shards plain tensors of one dtype) the weights are dequantized at load instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections import Counter
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

from ...pipeline_transformers import EXPERTS
from . import fp8, scaled
from .detect import CheckpointFile, Detected, detect_checkpoint
from .vae import load_vae

log = logging.getLogger(__name__)


def _weights_dtype(state_dict: dict) -> torch.dtype:
    """The dtype most of the weights are stored in; fp8 storage computes in bf16."""
    counts = Counter()
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    dtype = counts.most_common(1)[0][0] if counts else torch.float32
    return torch.bfloat16 if dtype.itemsize == 1 else dtype


def _logical_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A tensor's shape as the model sees it: a GGUF-quantized one holds bytes per row."""
    quant_type = getattr(tensor, "quant_type", None)
    if quant_type is None:
        return tuple(tensor.shape)
    import gguf

    return tuple(gguf.quants.quant_shape_from_byte_shape(tuple(tensor.shape), quant_type))


def _check_fits(model: torch.nn.Module, state_dict: dict, detected: Detected) -> None:
    """One error naming what differs between the converted weights and the model the config describes."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - state_dict.keys())
    unexpected = sorted(state_dict.keys() - expected.keys())
    wrong = [f"{k} {_logical_shape(state_dict[k])} (expected {expected[k]})"
             for k in sorted(expected.keys() & state_dict.keys()) if _logical_shape(state_dict[k]) != expected[k]]
    if missing or unexpected or wrong:
        found = (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", wrong))
        problems = [f"{len(v)} {what}: {v[:4]}{' ...' if len(v) > 4 else ''}" for what, v in found if v]
        raise ValueError(f"{detected.path} does not fit the {detected.describe()} transformer: "
                         f"{'; '.join(problems)}. The file is damaged or a variant this pack does not support")


def _dequantized_outside_linears(model: torch.nn.Module, state_dict: dict) -> dict:
    """diffusers' GGUF quantizer swaps the linear layers for ones that dequantize as they run; a quantized tensor
    anywhere else (Z-Image's pad tokens, [1, dim]) is dequantized at load, to the values those layers compute."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    linear = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    return {name: dequantize_gguf_tensor(tensor) if getattr(tensor, "quant_type", None) is not None and name not in linear
            else tensor for name, tensor in state_dict.items()}


def load_transformer(detected: Detected, checkpoint: CheckpointFile, index: dict, dtype: torch.dtype | None,
                     keep_fp8: bool = True, subfolder: str = "transformer"):
    cls = getattr(diffusers, index[subfolder][1])
    config = {**cls.load_config(detected.config_dir, subfolder=subfolder, local_files_only=True),
              **detected.overrides}
    original = checkpoint.state_dict()
    dtype = dtype or (torch.bfloat16 if checkpoint.is_gguf else _weights_dtype(original))
    fast = scaled.is_scaled(original) and scaled.comfy_fast(original)
    original, scales = scaled.read(original, detected.path, dtype)
    keep_fp8 = keep_fp8 and any(fp8.is_fp8(tensor) for tensor in original.values())
    if scales and not keep_fp8:
        original = scaled.dequantize(original, scales)
    quantized = {}
    if checkpoint.is_gguf:
        if cls.__name__ not in SINGLE_FILE_LOADABLE_CLASSES:
            raise ValueError(f"{detected.path}: GGUF files load for the families diffusers' single-file loader "
                             f"takes (Flux, SD3, ...), not {cls.__name__}; use its .safetensors file")
        from diffusers import GGUFQuantizationConfig

        quantized = {"quantization_config": GGUFQuantizationConfig(compute_dtype=dtype)}
    try:
        state_dict = detected.single_file.convert(dict(original), config)  # converters pop what they take
    except KeyError as error:
        raise ValueError(f"{detected.path} looks like {detected.describe()} but lacks tensor {error}: the file is "
                         "incomplete or a variant this pack does not support") from None
    except (ValueError, RuntimeError) as error:  # fused tensors that do not split as the shapes say
        raise ValueError(f"{detected.path} does not convert as {detected.describe()}: {error}") from None
    with init_empty_weights():
        model = cls.from_config(config)
    adapted = detected.single_file.adapt is not None and detected.single_file.adapt(model, state_dict)
    if adapted and checkpoint.is_gguf:
        raise ValueError(f"{detected.path}: a GGUF file of a {detected.describe()} form diffusers' own class does not "
                         "have (its modules swapped at load) does not load through diffusers' GGUF loader; use its "
                         ".safetensors file")
    if checkpoint.is_gguf:
        state_dict = _dequantized_outside_linears(model, state_dict)
    _check_fits(model, state_dict, detected)
    if keep_fp8:
        layer_scales = fp8.converted_scales(detected.single_file.convert, original, scales, config, state_dict)
        return fp8.load_keeping_fp8(model, state_dict, layer_scales, dtype, comfy_fast=fast)
    if cls.__name__ in SINGLE_FILE_LOADABLE_CLASSES and not adapted:  # diffusers' own loader (GGUF too)
        return cls.from_single_file(state_dict, config=str(detected.config_dir), subfolder=subfolder,
                                    local_files_only=True, torch_dtype=dtype, **quantized, **detected.overrides)
    # an adapted model loads here, its class's float32 modules kept float32 where diffusers' own loader keeps them
    fp32 = set(cls._keep_in_fp32_modules or ()) if adapted and dtype == torch.float16 else set()
    state_dict = {k: v.to(torch.float32 if fp32 & set(k.split(".")) else dtype) if v.is_floating_point() else v
                  for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=True, assign=True)
    return model.eval()


def expert_files(detected: Detected, checkpoint: CheckpointFile) -> dict[str, tuple[Detected, CheckpointFile]]:
    """The transformers a file loads as: itself, or (Wan 2.2 A14B) both experts, the partner file found beside it."""
    pair = detected.single_file.experts
    files = pair.files(detected.path) if pair and detected.variant in pair.variants else None
    if files is None:
        return {"transformer": (detected, checkpoint)}
    variant = pair.variants[detected.variant]
    title = detected.single_file.variants[variant].title
    if missing := next((f for f in files if not f.is_file()), None):
        raise ValueError(f"{detected.path.name} is one expert of {title}, named so; its partner {missing.name} is not "
                         f"beside it in {missing.parent}: put both expert files in one folder (or rename a file that "
                         "is not an expert)")
    experts = {}
    for name, path in zip(EXPERTS, files):
        one = checkpoint if path == detected.path else CheckpointFile(path)
        found = detected if path == detected.path else detect_checkpoint(one)
        if (found.single_file, found.variant, found.overrides) != (detected.single_file, detected.variant, detected.overrides):
            raise ValueError(f"{files[0].name} and {files[1].name} are not the two experts of one {title}: "
                             f"{detected.describe()} beside {found.describe()}")
        experts[name] = (dataclasses.replace(found, variant=variant), one)
    return experts


def load_single_file_pipeline(path: str | Path, *, dtype: torch.dtype | None = None, keep_fp8: bool = True,
                              vae: str | Path | None = None) -> diffusers.DiffusionPipeline:
    """The detected family's diffusers pipeline around the file's transformer (dtype None: as stored; fp8
    files compute in bf16 then, from weights that stay fp8 unless `keep_fp8` is off); a file that is one of
    two experts brings its partner file (`expert_files`); `vae`: the VAE file that goes with it (vae.py),
    which the variants whose shipped model_index.json lists a `vae` need to sample (a pool serving model calls
    alone needs none: `missing_vae` says why its sampling runs are refused)."""
    checkpoint = CheckpointFile(path)
    experts = expert_files(detect_checkpoint(checkpoint), checkpoint)
    detected = experts["transformer"][0]
    log.info("single-file checkpoint %s: %s", path, detected.describe())
    index = json.loads((detected.config_dir / "model_index.json").read_text())
    title = detected.single_file.variants[detected.variant].title
    if "transformer_2" in index and "transformer_2" not in experts:
        words = " / ".join(f"{a} and {b}" for a, b in detected.single_file.experts.words)
        raise ValueError(f"{Path(path).name} is one expert of {title}, but its name does not say which: keep the "
                         f"two files as released, named {words}, side by side")
    components = {name: load_transformer(found, file, index, dtype, keep_fp8, subfolder=name)
                  for name, (found, file) in experts.items()}
    if detected.single_file.components is not None:  # parts the same file holds (LTX-2's connectors, VAE statistics)
        components.update(detected.single_file.components(
            detected.path, detected.config_dir, dtype or components["transformer"].dtype))
    missing_vae = None
    if vae is not None:
        components["vae"] = load_vae(vae, detected, dtype or components["transformer"].dtype)
    elif "vae" in index and "vae" not in components:  # model calls need none; sampling runs are refused with this (missing_vae)
        layout = detected.single_file.vae
        missing_vae = (f"{Path(path).name} is {title}, which needs its VAE file beside it to sample ({layout.needed}): "
                       f"choose the {layout.title} as the pool's vae (--vae FILE, from ComfyUI's models/vae); its "
                       "model calls (Load Diffusion Model (xDiT Pool)) need none") if layout else (
                       f"{Path(path).name} is {title}, whose VAE file does not load beside it yet: its pool serves model "
                       "calls (Load Diffusion Model (xDiT Pool)); sample it with xDiT Sampler from its diffusers folder")
        if layout is None:  # the pipeline reads its VAE's config: one without weights (meta) stands in
            with init_empty_weights():
                components["vae"] = getattr(diffusers, index["vae"][1]).from_config(
                    getattr(diffusers, index["vae"][1]).load_config(detected.config_dir, subfolder="vae"))
    for name in ("scheduler", "audio_scheduler", "guider"):  # configs without weights (HunyuanVideo 1.5's guider)
        if name in index:
            components[name] = getattr(diffusers, index[name][1]).from_pretrained(
                detected.config_dir, subfolder=name, local_files_only=True)
    pipeline_cls = getattr(diffusers, index["_class_name"])
    if issubclass(pipeline_cls, diffusers.ModularPipeline):  # FLUX 3: its blocks make the other components as none
        pipeline = pipeline_cls()
        pipeline.update_components(**components)
        return pipeline
    modules, optional = pipeline_cls._get_signature_keys(pipeline_cls)
    absent = {name: None for name in modules if name not in components}
    settings = {name: index[name] for name in optional if name in index and not isinstance(index[name], list)}
    pipeline = pipeline_cls(**absent, **settings, **components)  # settings: e.g. Wan 2.2's boundary_ratio
    pipeline.register_to_config(_name_or_path=str(path))
    pipeline._xdit_missing_vae = missing_vae
    return pipeline


def missing_vae(pipeline) -> str | None:
    """Why this single-file pipeline cannot sample without the VAE file it was loaded without; None: it can."""
    return getattr(pipeline, "_xdit_missing_vae", None)
