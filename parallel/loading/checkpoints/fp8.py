"""fp8 checkpoints kept in fp8: each linear layer holds the file's fp8 weight and its scale, and computes
with stored · scale in the input's dtype when it runs, as ComfyUI's own fp8 layers do (comfy/ops.py).

A rank then holds about the file's size, not the bf16 size. The scales reach the converted layers by
running the family's converter a second time over the scales expanded to each weight's shape (views of
one number, no memory): renames, row splits and chunks carry them along; a converted weight whose scale
is not one number (a join of layers with different scales) is dequantized instead, element by element with
its own scale, as is every fp8 tensor that is not a linear layer's weight.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...pipeline_transformers import TRANSFORMERS
from .fp8_matmul import hardware_mode, linear, takes

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES


class Fp8Linear(torch.nn.Linear):
    """nn.Linear whose weight stays fp8; `scale` (fp32, one number) turns it into the weight it means.

    The fp8 bytes are held as int8, so diffusers and PEFT take the model's dtype from its other tensors (the
    compute dtype, never fp8), and code that casts inputs to a layer's weight dtype skips it as it skips int8
    quantized weights (Wan's time embedder)."""

    fp8_dtype: torch.dtype
    comfy_fast: bool = False  # the file is one ComfyUI runs with fp8 matmuls where the card has them (scaled.comfy_fast)
    matmul: str | None = None  # "row" / "tensor": multiply in fp8 (fp8_matmul.py, --fp8-matmul); None: dequantize

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """stored · scale in `dtype`: exactly what a load that dequantized in fp32 and cast to `dtype` holds.

        Looked up in a table of the 256 fp8 values, each computed that way: 3.7× faster on CPU than converting
        every weight (which has no vectorised fp8 path there)."""
        key = (dtype, self.weight.device)
        if (table := self._tables.get(key)) is None:
            codes = torch.arange(256, dtype=torch.int32, device=self.weight.device).to(torch.uint8)
            table = self._tables[key] = (codes.view(self.fp8_dtype).to(torch.float32) * self.scale).to(dtype)
        return table.index_select(0, self.weight.view(torch.uint8).reshape(-1).int()).view(self.weight.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return linear(x, self.weight.view(self.fp8_dtype), self.scale, self.bias, self.matmul)
        return F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @classmethod
    def replacing(cls, layer: torch.nn.Linear, fp8_dtype: torch.dtype) -> "Fp8Linear":
        """An Fp8Linear in `layer`'s place, on the meta device like it: the weights are assigned at load."""
        kept = cls(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        kept.weight = torch.nn.Parameter(torch.empty_like(kept.weight, dtype=torch.int8), requires_grad=False)
        kept.register_buffer("scale", torch.ones((), dtype=torch.float32), persistent=False)
        kept.fp8_dtype = fp8_dtype
        kept._tables = {}  # (dtype, device) → the 256 fp8 values dequantized
        return kept


def converted_scales(convert: Callable[[dict, dict], dict], weights: dict[str, torch.Tensor],
                     scales: dict[str, torch.Tensor], config: dict, converted: dict[str, torch.Tensor]
                     ) -> dict[str, torch.Tensor]:
    """The scale of each fp8 tensor of `converted` (= convert(weights)): one fp32 number (0-d), or, where the
    converter joined tensors of different scales, each element's own (a tensor of the weight's shape)."""
    expanded = {name: scales.get(name, torch.ones(())).float().reshape(()).expand(tensor.shape)
                if is_fp8(tensor) else tensor for name, tensor in weights.items()}
    out = {}
    for name, scale in convert(expanded, config).items():
        if is_fp8(converted[name]):
            first = scale[(0,) * scale.ndim] if scale.numel() else torch.ones(())
            one_number = all(stride == 0 for stride in scale.stride()) or bool((scale == first).all())
            out[name] = first.clone() if one_number else scale.contiguous()
    return out


def load_keeping_fp8(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], scales: dict[str, torch.Tensor],
                     dtype: torch.dtype, comfy_fast: bool = False) -> torch.nn.Module:
    """`model` (on the meta device) with its fp8 linear weights of one scale kept as Fp8Linear (`comfy_fast`: from a
    file ComfyUI multiplies in fp8 where it can); every other tensor (other fp8 ones dequantized, stored · scale) in
    `dtype`."""
    kept = {}
    for name, layer in list(model.named_modules()):
        weight, scale = state_dict.get(f"{name}.weight"), scales.get(f"{name}.weight")
        if type(layer) is torch.nn.Linear and weight is not None and scale is not None and scale.ndim == 0:
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(child, Fp8Linear.replacing(layer, weight.dtype))
            kept[name] = scale
    cast = {}
    for name, tensor in state_dict.items():
        if name.endswith(".weight") and name.removesuffix(".weight") in kept:
            cast[name] = tensor.view(torch.int8)
        elif is_fp8(tensor):  # not a linear layer's weight, or a join of several scales
            cast[name] = (tensor.to(torch.float32) * scales[name]).to(dtype)
        else:
            cast[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(cast, strict=True, assign=True)
    for name, scale in kept.items():
        model.get_submodule(name).scale = scale.clone()
        model.get_submodule(name).comfy_fast = comfy_fast
    return model.eval()


def storage_of(module: torch.nn.Module) -> dict[str, int]:
    """Parameter bytes per storage format ("float8_e4m3fn", "bfloat16", a GGUF type such as "Q8_0")."""
    out: dict[str, int] = {}
    for layer in module.modules():
        for name, parameter in layer.named_parameters(recurse=False):
            quant = getattr(parameter, "quant_type", None)
            if quant is not None:
                kind = getattr(quant, "name", str(quant))
            elif isinstance(layer, Fp8Linear) and name == "weight":
                kind = str(layer.fp8_dtype)
            else:
                kind = str(parameter.dtype)
            kind = kind.removeprefix("torch.")
            out[kind] = out.get(kind, 0) + parameter.numel() * parameter.element_size()
    return out


def use_fp8_matmul(pipeline, requested: bool | None, mode: str | None = None) -> int:
    """Set every fp8 linear layer of the pipeline's transformer(s) to multiply in fp8 or to dequantize: `requested`
    True (--fp8-matmul), False (--no-fp8-matmul) or None (where ComfyUI would); `mode`: the activation scaling,
    default the hardware's (tests give one to run the path on the CPU). The number of layers multiplying in fp8."""
    count = 0
    for name in TRANSFORMERS:
        transformer = getattr(pipeline, name, None)
        for layer in transformer.modules() if transformer is not None else ():
            if isinstance(layer, Fp8Linear):
                wanted = layer.comfy_fast if requested is None else requested
                chosen = (mode or hardware_mode(layer.weight.device)) if wanted and takes(layer) else None
                layer.matmul = chosen
                count += chosen is not None
    return count
