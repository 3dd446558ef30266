"""fp8 single files kept in fp8 on every rank (parallel/loading/checkpoints/fp8.py).

A tiny Flux.1 [dev] in BFL's layout written the three ways fp8 files come (ComfyUI's `*_fp8_scaled` with the
`scaled_fp8` marker, its per-layer `comfy_quant` metadata, and plain fp8 without scales; 2-D weights fp8, per-tensor
scales), and the two ways of the int8 files of the 2026 templates (`int8_tensorwise`, one scale a tensor, or one a
row after ConvRot's Hadamard rotation; dequantized at load, on Ulysses 2): through contract E with `--dtype fp32` on Ulysses 2 and on PipeFusion 2 with full warm-up,
and through a pool, the result equals diffusers' single-process pipeline on the weights the file means within
1e-4, read without the engine's loader (tests/independent_readers.py: ComfyUI's own loading and `comfy.ops`
dequantization of the same file, in the test bed's python), and misses the unquantized model's result by far more,
so a loader that dropped the scales would fail (with --shard-weights the file is dequantized at load: FSDP shards plain tensors). The pool reports
the storage format; a rank holds ≤ 0.55× the bf16 parameter bytes, a PipeFusion stage only its blocks' share;
a LoRA applies on top of the fp8 layers exactly as on the dequantized ones.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints.fp8 import Fp8Linear, storage_of
from parallel.loading.pipelines import load_pipeline

from original_layouts import original_layout
from quantized_files import fp8_scaled, int8_tensorwise
from pool_helpers import serving
from test_lora import peft_lora
from xdit_test_helpers import TOLERANCE, diffusers_latents, flux_file_on_two_ranks

CALL = {"num_inference_steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}
JOB = {"steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}


STYLES = ("scaled_fp8", "comfy_quant", "unscaled")  # ComfyUI's marker + scale_weight, per-layer metadata, plain fp8
INT8 = ("int8", "int8_convrot")  # the 2026 templates' `*_int8` files: dequantized at load (their rotation undone)


def fp8_plain(weights: dict) -> tuple[dict, dict]:
    """A plain fp8 file (`flux1-dev-fp8.safetensors`): 2-D weights cast to float8_e4m3fn, no scales; and what it means."""
    stored = {k: v.to(torch.float8_e4m3fn) if k.endswith(".weight") and v.ndim == 2 else v for k, v in weights.items()}
    return stored, {k: v.float() for k, v in stored.items()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    weights = original_layout("flux", tiny_models.build_tiny_pipeline("flux", seed=3).transformer)
    paths = {"plain": root / "flux1-dev.safetensors", "inputs": root / "in.safetensors"}
    for style in STYLES:
        stored, meant = fp8_plain(weights) if style == "unscaled" else fp8_scaled(weights, per_layer=style == "comfy_quant")
        paths[style], paths[f"{style}-meant"] = root / f"flux1-dev-{style}.safetensors", root / f"{style}-meant.safetensors"
        save_file(stored, paths[style])
        save_file({k: v.contiguous() for k, v in meant.items()}, paths[f"{style}-meant"])
    for style in INT8:
        paths[style] = root / f"flux1-dev-{style}.safetensors"
        save_file(int8_tensorwise(weights, convrot=style == "int8_convrot"), paths[style])
    paths["fp8"], paths["meant"] = paths["scaled_fp8"], paths["scaled_fp8-meant"]
    save_file({k: v.contiguous() for k, v in weights.items()}, paths["plain"])
    save_file(tiny_models.make_inputs("flux"), paths["inputs"])
    return paths


def _latents(path, inputs) -> torch.Tensor:
    return diffusers_latents(load_pipeline(path, dtype="fp32"), "flux", **load_file(inputs), **CALL)


@pytest.fixture(scope="module")
def references(comfyui_install, files, tmp_path_factory):
    """diffusers' pipeline, one process, on the weights each fp8 file means as ComfyUI itself dequantizes the file
    (stored · scale, as fp32)."""
    from independent_readers import flux_transformer

    work, config = tmp_path_factory.mktemp("ref"), dict(tiny_models.build_tiny_pipeline("flux", seed=3).transformer.config)
    out = {}
    for style in STYLES + INT8:
        pipeline = tiny_models.build_tiny_pipeline("flux", seed=3)
        pipeline.transformer = flux_transformer(comfyui_install, files[style], "fp8", config, work)
        out[style] = diffusers_latents(pipeline, "flux", **load_file(files["inputs"]), **CALL)
    return out


@pytest.fixture(scope="module")
def reference(references):
    return references["scaled_fp8"]


ULYSSES2, PIPEFUSION2 = ("--ulysses-degree", "2"), ("--pipefusion-degree", "2", "--warmup-steps", "4")
CASES = {f"{style}-{name}": (style, layout) for style in STYLES for name, layout in
         (("ulysses2", ULYSSES2), ("pipefusion2", PIPEFUSION2))}
CASES.update({f"{style}-ulysses2": (style, ULYSSES2) for style in INT8})
CASES["scaled_fp8-ulysses2-shard-weights"] = ("scaled_fp8", (*ULYSSES2, "--shard-weights"))  # dequantized at load
CASES["scaled_fp8-ulysses2-fp8-matmul"] = ("scaled_fp8", (*ULYSSES2, "--fp8-matmul"))  # no fp8 tensor cores: dequantized


@pytest.mark.parametrize("case", CASES)
def test_fp8_file_equals_diffusers_on_its_dequantized_weights(files, references, tmp_path, case):
    style, layout = CASES[case]
    parallel = flux_file_on_two_ranks(files[style], files["inputs"], tmp_path / "out.safetensors", *layout)
    assert (parallel - references[style]).abs().max().item() <= TOLERANCE
    unquantized = _latents(files["plain"], files["inputs"])
    assert (unquantized - parallel).abs().max().item() > 10 * TOLERANCE  # the fp8 (and its scales) are real


def test_a_pool_keeps_fp8_and_reports_its_storage(files, reference, tmp_path):
    bf16 = sum(storage_of(load_pipeline(files["meant"], dtype="bf16").transformer).values())
    with serving(files["fp8"], tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--dtype", "fp32") as client:
        status = client.status()
        got = client.sample(load_file(files["inputs"]), JOB)
    assert set(status["storage"]) == {"float8_e4m3fn", "float32"}
    assert status["fp8_matmul"] == 0  # a ComfyUI fast-fp8 file, but CPU ranks have no fp8 matmuls (test_fp8_matmul.py)
    assert all(row["parameter_bytes"] == sum(status["storage"].values()) for row in status["memory"])
    assert (got - reference).abs().max().item() <= TOLERANCE
    whole = sum(storage_of(load_pipeline(files["fp8"]).transformer).values())  # bf16 compute, the default for fp8
    assert whole <= 0.55 * bf16
    with serving(files["fp8"], tmp_path, "--nproc", "2", "--pipefusion-degree", "2") as client:
        staged = client.status()
    assert set(staged["storage"]) == {"float8_e4m3fn", "bfloat16"}
    shares = [row["parameter_bytes"] / whole for row in staged["memory"]]
    assert all(share < 0.75 for share in shares), shares  # each PipeFusion stage keeps only its blocks, in fp8


def test_lora_on_fp8_layers_equals_lora_on_the_dequantized_model(files, tmp_path):
    lora = load_file(peft_lora(tmp_path / "lora.safetensors", seed=5))
    weights = {k.removeprefix("transformer."): v for k, v in lora.items()}
    outputs = []
    for path in (files["fp8"], files["meant"]):
        pipeline = load_pipeline(path, dtype="fp32")
        pipeline.transformer.load_lora_adapter(dict(weights), adapter_name="style", prefix=None)
        outputs.append(diffusers_latents(pipeline, "flux", **load_file(files["inputs"]), **CALL))
    kept = load_pipeline(files["fp8"], dtype="fp32").transformer.transformer_blocks[0].attn.to_q
    assert isinstance(kept, Fp8Linear)
    assert (outputs[0] - outputs[1]).abs().max().item() <= TOLERANCE
    without = _latents(files["meant"], files["inputs"])
    assert (outputs[1] - without).abs().max().item() > 10 * TOLERANCE  # the LoRA changes the result


def test_a_converter_joining_two_scales_dequantizes_that_weight_element_by_element():
    """Where a family's converter joins fp8 tensors of different scales, that weight cannot keep one scale: it loads
    dequantized, each part with its own; a weight renamed whole stays fp8 with its scale."""
    from parallel.loading.checkpoints.fp8 import converted_scales, load_keeping_fp8

    parts = {name: torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) for seed, name in enumerate("ab")}
    scales = {name: part.abs().max() / 448 for name, part in parts.items()}
    weights = {name: (part / scales[name]).to(torch.float8_e4m3fn) for name, part in parts.items()}
    weights["c"], scales["c"] = weights["a"], scales["a"]

    def convert(state, config):
        return {"joined.weight": torch.cat([state.pop("a"), state.pop("b")]), "single.weight": state.pop("c")}

    converted = convert(dict(weights), {})
    model = torch.nn.Module()
    model.joined, model.single = (torch.nn.Linear(8, rows, bias=False, device="meta") for rows in (8, 4))
    model = load_keeping_fp8(model, converted, converted_scales(convert, weights, scales, {}, converted), torch.float32)
    meant = {name: weights[name].float() * scales[name] for name in "ab"}
    assert type(model.joined) is torch.nn.Linear and torch.equal(model.joined.weight, torch.cat([meant["a"], meant["b"]]))
    assert isinstance(model.single, Fp8Linear) and torch.equal(model.single.dequantized(), meant["a"])
