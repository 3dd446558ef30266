"""Quantized files as users download them, written from weights in a file's original layout (original_layouts.py):
ComfyUI's scaled fp8 and int8 and city96's GGUF (fp8 and GGUF with the weights they mean as their own loaders compute
them; the int8 files' are read by ComfyUI itself, tests/independent_readers.py)."""

from __future__ import annotations

import json

import torch


def fp8_scaled(weights: dict, per_layer: bool) -> tuple[dict, dict]:
    """ComfyUI's scaled fp8 file of `weights` (its 2-D weights fp8 with a per-tensor scale: the `scaled_fp8`
    marker with `scale_weight`, or per-layer `comfy_quant` JSON with `weight_scale`), and the weights it
    means, stored · scale, as ComfyUI's loader computes them."""
    stored, meant = {}, {}
    for name, weight in weights.items():
        if name.endswith(".weight") and weight.ndim == 2:
            scale = weight.abs().max().float() / 448
            fp8 = (weight.float() / scale).to(torch.float8_e4m3fn)
            layer = name.removesuffix(".weight")
            stored[name] = fp8
            if per_layer:
                stored[layer + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                              dtype=torch.uint8)
                stored[layer + ".weight_scale"], stored[layer + ".input_scale"] = scale, torch.tensor(1.0)
            else:
                stored[layer + ".scale_weight"], stored[layer + ".scale_input"] = scale, torch.tensor(1.0)
            meant[name] = fp8.float() * scale
        else:
            stored[name] = meant[name] = weight
    if not per_layer:  # under the weights' whole-checkpoint prefix, where ComfyUI looks for it
        prefix = "model.diffusion_model." if all(k.startswith("model.diffusion_model.") for k in weights) else ""
        stored[prefix + "scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return stored, meant


def int8_tensorwise(weights: dict, convrot: bool) -> dict:
    """ComfyUI's int8 file (`*_int8`, comfy_quant `int8_tensorwise`) of `weights`: 2-D weights int8 with one scale a
    tensor, or, for ConvRot, each row's scale after turning every 16 input columns by the regular Hadamard matrix
    (ComfyUI reads groups of a power of 4); everything else as it is."""
    from parallel.loading.checkpoints.scaled import hadamard

    stored = {}
    for name, weight in weights.items():
        if not (name.endswith(".weight") and weight.ndim == 2):
            stored[name] = weight
            continue
        layer, weight = name.removesuffix(".weight"), weight.float()
        layout = {"format": "int8_tensorwise"}
        if convrot:
            layout.update(convrot=True, convrot_groupsize=16)
            rows, columns = weight.shape
            weight = (weight.reshape(rows, columns // 16, 16) @ hadamard(16).T).reshape(rows, columns)
            scale = weight.abs().amax(dim=1, keepdim=True) / 127
        else:
            scale = weight.abs().max() / 127
        stored[name] = (weight / scale).round().clamp(-127, 127).to(torch.int8)
        stored[layer + ".weight_scale"] = scale
        stored[layer + ".comfy_quant"] = torch.tensor(list(json.dumps(layout).encode()), dtype=torch.uint8)
    return stored


def gguf_file(weights: dict, path, arch: str, kind: str = "Q8_0", as_diffusers: bool = False) -> dict:
    """A GGUF file of `weights` as city96's convert script writes one: the original names, 2-D weights whose rows
    divide into the type's blocks as `kind` (Q8_0, Q6_K, ...; F16 and BF16 for every 2-D weight), the rest F32.
    Returns the weights the file holds, as the gguf package dequantizes them (fp32), or with `as_diffusers`
    (Q8_0) as diffusers' GGUF layers do: each block's fp16 scale times its int8 values, rounded once to fp16.

    The gguf package quantizes only some types; the K-quants (Q6_K, Q5_K, Q4_K) get valid blocks of random codes
    with small fp16 scales instead: a file of that type, though not a quantization of `weights`."""
    import gguf
    import numpy as np

    quant = gguf.GGMLQuantizationType[kind]
    values_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[quant]
    writer = gguf.GGUFWriter(str(path), arch)
    meant = {}
    rng = np.random.default_rng(0)
    for name, tensor in weights.items():
        array = tensor.float().numpy()
        if array.ndim != 2 or array.shape[-1] % values_per_block:
            writer.add_tensor(name, array)
            meant[name] = tensor.float()
            continue
        try:
            blocks = gguf.quants.quantize(array, quant)
        except NotImplementedError:  # K-quants: random codes, then each block's fp16 scales (d, and dmin) made small
            shape = gguf.quants.quant_shape_to_byte_shape(array.shape, quant)
            blocks = rng.integers(0, 256, size=shape, dtype=np.uint8)
            per_block = blocks.reshape(-1, bytes_per_block)
            scale = np.float16(1e-3).tobytes()
            offsets = [bytes_per_block - 2] if kind == "Q6_K" else [0, 2]  # where d (and dmin) sit in the block
            for offset in offsets:
                per_block[:, offset:offset + 2] = np.frombuffer(scale, dtype=np.uint8)
        raw = {"raw_dtype": quant} if blocks.dtype == np.uint8 else {}
        writer.add_tensor(name, blocks, **raw, raw_shape=gguf.quants.quant_shape_to_byte_shape(array.shape, quant)
                          if raw else None)
        meant[name] = torch.from_numpy(gguf.quants.dequantize(blocks, quant).astype(np.float32)).reshape(tensor.shape)
        if as_diffusers:
            meant[name] = meant[name].to(torch.float16).float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant
