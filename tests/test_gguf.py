"""GGUF single files (city96's layout: the original model's tensor names), kept quantized on every rank.

A tiny Flux.1 transformer in BFL's layout written as GGUF, its 2-D weights Q8_0 (rows of 32-value blocks),
the rest F32, as city96's convert script keeps small tensors: detected from the file's tensor table, loaded
with diffusers' GGUF support (GGUFParameter weights, layers that dequantize on the fly), and sampled under
Ulysses 2, Ring 2 and PipeFusion 2 (full warm-up) through contract E: equal within 1e-4 to diffusers'
single-process pipeline around a transformer read from the same file without the engine's loader
(tests/independent_readers.py: the gguf package reads the blocks, each block's fp16 scale times its int8 codes in
fp16 as ComfyUI-GGUF and diffusers' GGUF layers compute Q8_0, ComfyUI's own map to diffusers' names). Against the
gguf package's exact fp32 dequantization the result differs only by that fp16 rounding of the weights (measured
5e-4). Negative control: the unquantized weights give another result.
The same through a pool, whose status reports Q8_0 storage. Every type city96's files use (F16, BF16, Q8_0,
Q6_K, Q5_K, Q5_0, Q4_K, Q4_0) reads as written; Q4_K runs exactly on Ulysses 2 too. A LoRA applies on top of the
GGUF layers exactly as on the dequantized model. Refused in one line: GGUF with --shard-weights; named: a
quantization type diffusers cannot dequantize, a truncated file.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, diffusers_latents, flux_file_on_two_ranks, torchrun

gguf = pytest.importorskip("gguf")  # a pack requirement: always there where requirements.txt is installed

Q8_0 = gguf.GGMLQuantizationType.Q8_0
CALL = {"num_inference_steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}


def _quantizable(array) -> bool:
    return array.ndim == 2 and array.shape[-1] % 32 == 0


def _q8_0(tensor: torch.Tensor) -> torch.Tensor:
    """The values a Q8_0 copy of `tensor` holds (rows quantize independently, so row splits commute)."""
    array = tensor.float().numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(array, Q8_0), Q8_0).copy()).reshape(tensor.shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from original_layouts import original_layout
    from quantized_files import gguf_file

    root = tmp_path_factory.mktemp("gguf")
    pipeline = tiny_models.build_tiny_pipeline("flux", seed=3)
    gguf_file(original_layout("flux", pipeline.transformer), root / "flux1-dev-Q8_0.gguf", "flux")
    save_file(tiny_models.make_inputs("flux"), root / "in.safetensors")
    return {"gguf": root / "flux1-dev-Q8_0.gguf", "inputs": root / "in.safetensors", "plain": pipeline}


def independent_reference(comfyui_install, files, path, kind: str, work) -> torch.Tensor:
    """diffusers' own pipeline, single process, in fp32, around a transformer holding what the GGUF file means, read
    without the engine's loader (tests/independent_readers.py; `kind` "gguf-Q8_0-fp16" or the exact "gguf")."""
    from independent_readers import flux_transformer

    pipeline = tiny_models.build_tiny_pipeline("flux", seed=3)
    pipeline.transformer = flux_transformer(comfyui_install, path, kind, dict(files["plain"].transformer.config), work)
    return diffusers_latents(pipeline, "flux", **load_file(files["inputs"]), **CALL)


@pytest.fixture(scope="module")
def reference(comfyui_install, files, tmp_path_factory):
    return independent_reference(comfyui_install, files, files["gguf"], "gguf-Q8_0-fp16", tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def exact_reference(comfyui_install, files, tmp_path_factory):
    return independent_reference(comfyui_install, files, files["gguf"], "gguf", tmp_path_factory.mktemp("exact"))


def test_detected_and_kept_quantized_with_the_written_values(files):
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from parallel.loading.checkpoints.detect import CheckpointFile, detect_checkpoint
    from parallel.loading.checkpoints.load import load_single_file_pipeline

    checkpoint = CheckpointFile(files["gguf"])
    assert detect_checkpoint(checkpoint).variant == "flux1-dev"
    assert checkpoint.shapes["double_blocks.0.img_attn.qkv.weight"] == (192, 64)  # logical, not bytes
    transformer = load_single_file_pipeline(files["gguf"], dtype=torch.float32).transformer
    layer = transformer.transformer_blocks[0].attn.to_q
    assert type(layer).__name__ == "GGUFLinear" and layer.weight.quant_type == Q8_0
    plain = files["plain"].transformer.state_dict()
    stored = sum(p.numel() * p.element_size() for p in transformer.parameters())
    assert stored < 0.4 * sum(v.numel() * 4 for v in plain.values())  # 8.5 bits per weight, not 32
    for name, weight in transformer.named_parameters():  # Q8_0 of the written weights (scales are fp16)
        value = dequantize_gguf_tensor(weight).float().reshape(plain[name].shape) if hasattr(weight, "quant_type") else weight
        expected = _q8_0(plain[name]) if _quantizable(plain[name].numpy()) else plain[name]
        assert (value - expected).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("layout", [("--ulysses-degree", "2"), ("--ring-degree", "2"),
                                    ("--pipefusion-degree", "2", "--warmup-steps", "4")],
                         ids=["ulysses2", "ring2", "pipefusion2"])
def test_gguf_equals_diffusers_single_process(files, reference, exact_reference, tmp_path, layout):
    parallel = flux_file_on_two_ranks(files["gguf"], files["inputs"], tmp_path / "out.safetensors", *layout)
    assert (parallel - reference).abs().max().item() <= TOLERANCE
    assert (parallel - exact_reference).abs().max().item() < 2e-3  # only the fp16 rounding of the Q8_0 products
    unquantized = diffusers_latents(files["plain"], "flux", **load_file(files["inputs"]), **CALL)
    assert (unquantized - parallel).abs().max().item() > 10 * TOLERANCE  # the quantization is real


def test_a_gguf_pool_keeps_q8_0_and_equals_diffusers(files, reference, tmp_path):
    from pool_helpers import serving

    job = {"steps": 4, "guidance_scale": 3.5, "height": 64, "width": 64}
    with serving(files["gguf"], tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--dtype", "fp32") as client:
        status = client.status()
        got = client.sample(load_file(files["inputs"]), job)
    assert "Q8_0" in status["storage"]
    assert (got - reference).abs().max().item() <= TOLERANCE


def test_gguf_with_shard_weights_is_refused_in_one_line(files, tmp_path):
    run = torchrun(2, "-m", "parallel.run", "--model", str(files["gguf"]), "--inputs", str(files["inputs"]),
                   "--output", str(tmp_path / "out.safetensors"), "--steps", "2", "--guidance-scale", "3.5",
                   "--height", "64", "--width", "64", "--ulysses-degree", "2", "--shard-weights")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and "GGUF-quantized" in errors[0] and "--shard-weights" in errors[0]


def test_the_pool_node_lists_gguf_files_comfyui_itself_does_not(files, tmp_path, monkeypatch):
    import shutil

    from test_single_file import _pool_node_module

    folder = tmp_path / "unet" / "flux"
    folder.mkdir(parents=True)
    shutil.copy(files["gguf"], folder / "flux1-dev-Q8_0.gguf")
    node = _pool_node_module(monkeypatch, {"diffusion_models": [tmp_path / "unet"]})
    node.folder_paths.get_filename_list = lambda name: []  # ComfyUI lists its own extensions only
    listed = [m for m in node.diffusers_models() if m.startswith(node.FILE_PREFIX)]
    assert listed == ["file: diffusion_models/flux/flux1-dev-Q8_0.gguf"]
    assert node.model_path(listed[0]) == str(folder / "flux1-dev-Q8_0.gguf")


def test_lora_on_gguf_layers_equals_lora_on_the_dequantized_model(files, tmp_path):
    """ComfyUI applies LoRAs on top of GGUF layers; so does the pack (PEFT around diffusers' GGUF linear)."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from parallel.loading.checkpoints.load import load_single_file_pipeline

    from test_lora import peft_lora

    lora = {k.removeprefix("transformer."): v for k, v in load_file(peft_lora(tmp_path / "lora.safetensors", 5)).items()}
    quantized = load_single_file_pipeline(files["gguf"], dtype=torch.float32)
    plain = tiny_models.build_tiny_pipeline("flux", seed=3)
    plain.transformer.load_state_dict({name: dequantize_gguf_tensor(weight).float().reshape(weight.quant_shape)
                                       if hasattr(weight, "quant_type") else weight
                                       for name, weight in quantized.transformer.state_dict().items()})
    on_gguf = tiny_models.build_tiny_pipeline("flux", seed=3)
    on_gguf.transformer = quantized.transformer
    outputs = []
    for pipeline in (plain, on_gguf):
        pipeline.transformer.load_lora_adapter(dict(lora), adapter_name="style", prefix=None)
        outputs.append(diffusers_latents(pipeline, "flux", **load_file(files["inputs"]), **CALL))
    assert type(on_gguf.transformer.transformer_blocks[0].attn.to_q.base_layer).__name__ == "GGUFLinear"
    assert (outputs[0] - outputs[1]).abs().max().item() <= TOLERANCE


def test_unsupported_quantization_and_truncated_gguf_are_named(files, tmp_path):
    import numpy as np

    from original_layouts import original_layout

    from parallel.loading.pipelines import load_pipeline

    kind = gguf.GGMLQuantizationType.IQ2_XXS  # no dequantizer in diffusers
    writer = gguf.GGUFWriter(str(tmp_path / "flux1-dev-IQ2_XXS.gguf"), "flux")
    for name, tensor in original_layout("flux", files["plain"].transformer).items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[-1] % 256 == 0:
            shape = gguf.quants.quant_shape_to_byte_shape(array.shape, kind)
            writer.add_tensor(name, np.zeros(shape, dtype=np.uint8), raw_dtype=kind, raw_shape=shape)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"flux1-dev-IQ2_XXS.gguf: tensor \S+ is GGUF IQ2_XXS, a quantization type this "
                                         r"pack cannot dequantize \(it reads F32, F16, BF16, .*Q8_0"):
        load_pipeline(tmp_path / "flux1-dev-IQ2_XXS.gguf")
    data = files["gguf"].read_bytes()
    (tmp_path / "flux1-dev-Q8_0.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="flux1-dev-Q8_0.gguf cannot be read as a .gguf checkpoint.*truncated"):
        load_pipeline(tmp_path / "flux1-dev-Q8_0.gguf")


KINDS = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0")


@pytest.mark.parametrize("kind", KINDS)
def test_every_quant_type_reads_as_written_and_runs_exactly(request, files, tmp_path, kind):
    """Each GGUF type city96's files use: the layers hold what the gguf package reads from the file (within the
    fp16 rounding of diffusers' dequantizers) and stay in that type; on Ulysses 2 (a K-quant here, Q8_0 above)
    the result equals diffusers' single-process pipeline around the same GGUF transformer, and differs from a
    transformer of the gguf package's exact dequantization of the file (read without the engine's loader) only by
    that fp16 rounding (measured 1.8e-3, against 7 for the unquantized weights)."""
    from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

    from original_layouts import original_layout
    from quantized_files import gguf_file

    from parallel.loading.checkpoints.fp8 import storage_of
    from parallel.loading.checkpoints.load import load_single_file_pipeline

    path = tmp_path / f"flux1-dev-{kind}.gguf"
    meant = gguf_file(original_layout("flux", files["plain"].transformer), path, "flux", kind)
    transformer = load_single_file_pipeline(path, dtype=torch.float32).transformer
    assert ("float32" if kind == "F16" else kind) in storage_of(transformer)  # F16 is plain: cast like an fp16 file
    checked = 0
    for name, value in {"img_in.weight": transformer.x_embedder.weight,
                        "double_blocks.0.img_mlp.2.weight": transformer.transformer_blocks[0].ff.net[2].weight}.items():
        got = dequantize_gguf_tensor(value).float().reshape(meant[name].shape)
        assert (got - meant[name]).abs().max().item() <= 1e-3 * meant[name].abs().max().item() + 1e-6, name
        checked += 1
    assert checked == 2
    if kind != "Q4_K":  # the layers are diffusers' GGUF layers whatever the type: one more type on ranks is enough
        return
    reference = tiny_models.build_tiny_pipeline("flux", seed=3)
    reference.transformer = transformer
    want = diffusers_latents(reference, "flux", **load_file(files["inputs"]), **CALL)
    got = flux_file_on_two_ranks(path, files["inputs"], tmp_path / "out.safetensors", "--ulysses-degree", "2")
    assert (got - want).abs().max().item() <= TOLERANCE
    exact = independent_reference(request.getfixturevalue("comfyui_install"), files, path, "gguf", tmp_path)
    assert (got - exact).abs().max().item() < 1e-2  # the fp16 rounding of the dequantized K-quant weights
    assert (got - diffusers_latents(files["plain"], "flux", **load_file(files["inputs"]), **CALL)).abs().max().item() > 1.0
