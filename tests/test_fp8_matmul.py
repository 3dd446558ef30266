"""`--fp8-matmul` (parallel/loading/checkpoints/fp8_matmul.py) on the CPU, where torch 2.13's own `torch._scaled_mm` takes
float8_e4m3fn with per-tensor and per-row scales, so the code path the GPUs run is run here, `_scaled_mm` included
(the engine never picks it on the CPU: it has no fp8 tensor cores to be faster with).

- A layer: `_scaled_mm` on the quantized activations equals the reference formula (activations q · their scale,
  weights stored · scale, in fp32) to rounding, and the dequantized layer (Fp8Linear's default) within the error of
  quantizing the activations to fp8 (4e-2 relative L2, measured 2.3e-2 per row and per tensor; per row keeps tokens
  far smaller than the largest precise). Negative control: the weight's scale left out misses by far.
- A pipeline: the tiny Flux from a ComfyUI scaled-fp8 file sampled with every fp8 layer multiplying in fp8 stays
  within 5e-2 (relative L2; measured 2.1e-2, bf16 after dequantizing 1.7e-2) of diffusers' fp32 pipeline on the
  file's dequantized weights; weights rescaled by 2 miss.
- Which layers and when: `--fp8-matmul` / `--no-fp8-matmul` / the default (ComfyUI's choice: its scaled-fp8 marker
  or per-layer metadata), the hardware (compute capability 8.9: per tensor; 9.0+: per row; below and CPU: none,
  the queries stubbed), e5m2 weights and sides that are not multiples of 16 (dequantized).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints import fp8_matmul, scaled
from parallel.loading.checkpoints.fp8 import Fp8Linear, use_fp8_matmul
from parallel.loading.checkpoints.fp8_matmul import hardware_mode, linear, quantize
from parallel.loading.pipelines import load_pipeline

from original_layouts import original_layout
from quantized_files import fp8_scaled
from xdit_test_helpers import diffusers_latents

BOUND = {"row": 4e-2, "tensor": 4e-2}  # relative L2 of one layer from the dequantized layer (measured 2.3e-2 both)
CALL = {"num_inference_steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}


def relative_l2(result: torch.Tensor, reference: torch.Tensor) -> float:
    return ((result.float() - reference.float()).norm() / reference.float().norm()).item()


def fp8_layer(out_features: int = 96, in_features: int = 64, dtype=torch.float8_e4m3fn, seed: int = 0) -> Fp8Linear:
    """An Fp8Linear as a scaled-fp8 file gives it: weight / scale in fp8, per-tensor scale, bf16 bias."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    scale = weight.abs().max() / torch.finfo(dtype).max
    layer = Fp8Linear.replacing(torch.nn.Linear(in_features, out_features, device="meta"), dtype)
    layer.weight = torch.nn.Parameter((weight / scale).to(dtype).view(torch.int8), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(out_features, generator=gen).to(torch.bfloat16), requires_grad=False)
    layer.scale = scale.float()
    return layer


def activations(seed: int = 1) -> torch.Tensor:
    """[batch 2, 40 tokens, 64] in bf16, rows of very different size (as tokens are), some outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 40, 64, generator=gen) * torch.logspace(-2, 1, 40).view(1, 40, 1)
    x[0, 3, 7] = 60.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("mode", fp8_matmul.MODES)
def test_scaled_mm_equals_its_reference_formula_and_the_dequantized_layer(mode):
    layer, x = fp8_layer(), activations()
    reference_layer = layer(x)  # matmul None: dequantized to bf16, then F.linear
    layer.matmul = mode
    ours = layer(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == (2, 40, 96)
    q, x_scale = quantize(x.reshape(-1, 64), mode)
    assert x_scale.shape == ((80, 1) if mode == "row" else ())
    formula = (q.float() * x_scale) @ (layer.weight.view(torch.float8_e4m3fn).float() * layer.scale).T + layer.bias.float()
    assert relative_l2(ours.reshape(80, 96), formula) < 4e-3  # bf16 output rounding only
    assert relative_l2(ours, reference_layer) < BOUND[mode]
    unscaled = linear(x, layer.weight.view(torch.float8_e4m3fn), torch.ones(()), layer.bias, mode)
    assert relative_l2(unscaled, reference_layer) > 100 * BOUND[mode]  # negative control: the weight scale matters


def test_per_row_scaling_keeps_small_rows_precise():
    """One scale per token: tokens 2^16 times smaller than the largest keep their precision per row; per tensor they
    fall below e4m3's smallest values (2^-9 of the scale) and lose it."""
    layer, x = fp8_layer(), activations()
    x[:, :8] *= 2.0 ** -10
    dequantized = layer(x)
    errors = {}
    for mode in fp8_matmul.MODES:
        layer.matmul = mode
        errors[mode] = relative_l2(layer(x)[:, :8], dequantized[:, :8])  # the smallest tokens
    assert errors["row"] < 0.1 * errors["tensor"], errors


def test_an_empty_token_stream_passes_through():
    layer = fp8_layer()
    layer.matmul = "row"
    assert layer(torch.zeros(1, 0, 64, dtype=torch.bfloat16)).shape == (1, 0, 96)


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    """The tiny Flux as ComfyUI's scaled-fp8 file, the weights it means, and inputs."""
    root = tmp_path_factory.mktemp("fp8_matmul")
    weights = original_layout("flux", tiny_models.build_tiny_pipeline("flux", seed=3).transformer)
    stored, meant = fp8_scaled(weights, per_layer=False)
    paths = {"file": root / "flux1-dev-fp8_scaled.safetensors", "meant": root / "meant.safetensors",
             "inputs": root / "in.safetensors"}
    save_file(stored, paths["file"])
    save_file({k: v.contiguous() for k, v in meant.items()}, paths["meant"])
    save_file(tiny_models.make_inputs("flux"), paths["inputs"])
    return paths


def test_a_pipeline_multiplying_in_fp8_stays_near_diffusers_on_the_dequantized_weights(flux_file):
    inputs = load_file(flux_file["inputs"])
    reference = diffusers_latents(load_pipeline(flux_file["meant"], dtype="fp32"), "flux", **inputs, **CALL)
    pipeline = load_pipeline(flux_file["file"], dtype="bf16")
    kept = [m for m in pipeline.transformer.modules() if isinstance(m, Fp8Linear)]
    assert use_fp8_matmul(pipeline, True) == 0  # the CPU: no fp8 tensor cores, dequantized as before
    assert use_fp8_matmul(pipeline, True, mode="row") == len(kept) > 0
    bf16 = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
    ours = diffusers_latents(pipeline, "flux", **bf16, **CALL)
    assert relative_l2(ours, reference) < 5e-2
    use_fp8_matmul(pipeline, False)
    dequantized = diffusers_latents(pipeline, "flux", **bf16, **CALL)
    for layer in kept:  # negative control: a matmul that rescales the weights wrong by 2
        layer.matmul, layer.scale = "row", layer.scale * 2
    assert relative_l2(diffusers_latents(pipeline, "flux", **bf16, **CALL), reference) > 0.2
    print(f"relative L2 from fp32 on the dequantized weights: fp8 matmul {relative_l2(ours, reference):.3g}, "
          f"bf16 after dequantizing {relative_l2(dequantized, reference):.3g}")


def test_which_layers_multiply_in_fp8():
    e4m3, e5m2, narrow = fp8_layer(), fp8_layer(dtype=torch.float8_e5m2), fp8_layer(out_features=24)
    module = torch.nn.Module()
    module.transformer = torch.nn.ModuleList([e4m3, e5m2, narrow])
    assert use_fp8_matmul(module, True, mode="tensor") == 1 and e4m3.matmul == "tensor"
    assert e5m2.matmul is None and narrow.matmul is None  # dequantized: e5m2, and 24 is no multiple of 16
    assert use_fp8_matmul(module, None, mode="tensor") == 0 and e4m3.matmul is None  # default: not a ComfyUI fast file
    e4m3.comfy_fast = True
    assert use_fp8_matmul(module, None, mode="tensor") == 1
    assert use_fp8_matmul(module, False, mode="tensor") == 0 and e4m3.matmul is None


def test_the_hardware_decides_the_scaling(monkeypatch):
    assert hardware_mode(torch.device("cpu")) is None
    for capability, mode in (((8, 6), None), ((8, 9), "tensor"), ((9, 0), "row"), ((10, 0), "row"), ((12, 0), "row")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert hardware_mode(torch.device("cuda", 0)) == mode, capability


def test_comfyui_runs_these_files_fast():
    quant = lambda layout: torch.tensor(list(json.dumps(layout).encode()), dtype=torch.uint8)  # noqa: E731
    assert scaled.comfy_fast({"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)})
    assert not scaled.comfy_fast({"scaled_fp8": torch.zeros(2, dtype=torch.float8_e4m3fn)})  # ComfyUI's "no" marker
    assert scaled.comfy_fast({"a.comfy_quant": quant({"format": "float8_e4m3fn"})})
    assert not scaled.comfy_fast({"a.comfy_quant": quant({"format": "float8_e4m3fn", "full_precision_matrix_mult": True})})
    assert not scaled.comfy_fast({"a.weight": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)})  # plain fp8: opt-in only
