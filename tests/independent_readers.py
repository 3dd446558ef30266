"""References for quantized single files that do not go through the engine's loader (parallel/checkpoints).

A test of an fp8 or GGUF file needs what the file means: its weights dequantized. Loading them with the engine's own
single-file loader would let a loader bug pass on both sides, so the file is read here by code we did not write, in
the ComfyUI test bed's python:

- fp8 (ComfyUI's `scaled_fp8` marker, per-layer `comfy_quant`, plain fp8): ComfyUI's own loading, `load_torch_file`,
  `convert_old_quants` and a `comfy.ops.mixed_precision_ops` Linear per layer, dequantized as ComfyUI dequantizes it;
- GGUF: the gguf package's own reader and `gguf.quants.dequantize` (exact in fp32), or, as ComfyUI-GGUF and
  diffusers' GGUF layers compute Q8_0 by default, each block's fp16 scale times its int8 codes in fp16 (`Q8_0-fp16`);

and the original (BFL) names become diffusers' with ComfyUI's own map, `comfy.utils.flux_to_diffusers` (FLUX.1), or
diffusers' own `convert_flux2_transformer_checkpoint_to_diffusers` (FLUX.2). diffusers' `from_single_file` cannot read
the tiny FLUX.1 files: its converter assumes FLUX.1's 3072 width. The tiny model's config (diffusers' own class) and
`load_state_dict(strict=True)` make the transformer.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from safetensors.torch import load_file

READER = r"""
import json, sys
path, kind, out, depth, single, hidden = sys.argv[1:7]
sys.argv = sys.argv[:1] + ["--cpu"]
import comfy.options; comfy.options.enable_args_parsing()
import numpy as np, torch
import comfy.model_detection, comfy.ops, comfy.utils
from safetensors.torch import save_file


def unprefixed(state):  # a whole checkpoint's prefix (Comfy-Org's model.diffusion_model.), as ComfyUI's loader drops it
    prefix = comfy.model_detection.unet_prefix_from_state_dict(state)
    if not all(name.startswith(prefix) for name in state):  # its fallback guess ("model.") for a file without one
        return state
    return comfy.utils.state_dict_prefix_replace(state, {prefix: ""}, filter_keys=True)

if kind.startswith("gguf"):
    import gguf
    original = {}
    for tensor in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        if kind == "gguf-Q8_0-fp16" and tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(-1, 34)
            scale, codes = blocks[:, :2].contiguous().view(torch.float16), blocks[:, 2:].contiguous().view(torch.int8)
            value = (scale * codes).float()  # ComfyUI-GGUF's default: in the scale's dtype, fp16
        else:
            value = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        original[tensor.name] = value.reshape(shape)
    original = unprefixed(original)
else:
    state, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    state, _ = comfy.utils.convert_old_quants(unprefixed(state), "", metadata)
    ops = comfy.ops.mixed_precision_ops({}, compute_dtype=torch.float32)
    original = {}
    for name, value in state.items():
        if not name.endswith(".weight") or value.ndim != 2:
            if not name.endswith((".comfy_quant", ".weight_scale", ".input_scale")):
                original.setdefault(name, value.float())
            continue
        layer = name[: -len(".weight")]
        linear = ops.Linear(value.shape[1], value.shape[0], bias=f"{layer}.bias" in state)
        linear.load_state_dict({k[len(layer) + 1:]: v for k, v in state.items() if k.startswith(layer + ".")}, strict=False)
        weight = linear.weight
        original[name] = (weight.dequantize() if hasattr(weight, "dequantize") else weight).float()
        if linear.bias is not None:
            original[f"{layer}.bias"] = linear.bias.float()

if hidden == "0":  # FLUX.2: the original names, for diffusers' own converter
    save_file({name: value.contiguous() for name, value in original.items()}, out)
    print("[]")
    sys.exit(0)
# BFL names a norm's weight `.scale`; ComfyUI's map (and its RMSNorm) call it `.weight`
original = {name[: -len(".scale")] + ".weight" if name.endswith("_norm.scale") else name: value
            for name, value in original.items()}
diffusers = {}
for key, source in comfy.utils.flux_to_diffusers({"depth": int(depth), "depth_single_blocks": int(single),
                                                  "hidden_size": int(hidden)}).items():
    name, narrow, convert = (source, None, None) if isinstance(source, str) else (*source, None)[:3]
    if name not in original:
        continue
    value = original[name]
    if narrow is not None:
        value = value.narrow(*narrow)
    diffusers[key] = (convert(value) if convert else value).clone()  # the map has aliases (LoKr, FLUX.2 names)
save_file(diffusers, out)
print(json.dumps(sorted(set(original) - {s if isinstance(s, str) else s[0] for s in comfy.utils.flux_to_diffusers(
    {"depth": int(depth), "depth_single_blocks": int(single), "hidden_size": int(hidden)}).values()})))
"""


def _read(comfyui_install: tuple[Path, Path], path: Path, kind: str, work: Path, *flux_shape: int) -> dict:
    comfy, python = comfyui_install
    out = work / f"{Path(path).stem}-{kind}-read.safetensors"
    run = subprocess.run([str(python), "-c", READER, str(path), kind, str(out), *map(str, flux_shape or (0, 0, 0))],
                         cwd=comfy, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]", f"original weights with no diffusers name: {run.stdout}"
    return load_file(out)


def flux_transformer(comfyui_install: tuple[Path, Path], path: Path, kind: str, config: dict, work: Path):
    """The tiny Flux transformer of diffusers' own class and `config`, holding the weights the fp8 (`kind` "fp8") or
    GGUF ("gguf": exact; "gguf-Q8_0-fp16": Q8_0 computed in fp16) file `path` means, as read by ComfyUI's code and the
    gguf package in the test bed's python."""
    from diffusers import FluxTransformer2DModel

    weights = _read(comfyui_install, path, kind, work, config["num_layers"], config["num_single_layers"],
                    config["num_attention_heads"] * config["attention_head_dim"])
    return _loaded(FluxTransformer2DModel.from_config(config).eval(), weights)


def flux2_transformer(comfyui_install: tuple[Path, Path], path: Path, kind: str, config: dict, work: Path):
    """The same for FLUX.2 ([klein]): read the same way, its original names converted by diffusers' own
    `convert_flux2_transformer_checkpoint_to_diffusers` (which, unlike FLUX.1's, takes any width)."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    weights = convert_flux2_transformer_checkpoint_to_diffusers(_read(comfyui_install, path, kind, work))
    return _loaded(Flux2Transformer2DModel.from_config(config).eval(), weights)


def _loaded(transformer, weights: dict):
    wanted = transformer.state_dict()
    assert set(wanted) <= set(weights), f"the file gives no {sorted(set(wanted) - set(weights))}"
    transformer.load_state_dict({name: weights[name] for name in wanted}, strict=True)
    return transformer
