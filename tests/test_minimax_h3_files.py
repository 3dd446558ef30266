"""MiniMax-H3 single files kept quantized on the ranks: ComfyUI's scaled fp8 (`scaled_fp8` marker, per-tensor
`scale_weight`) and city96's GGUF Q8_0 of a tiny transformer in Comfy-Org's layout (written by ComfyUI's own
MiniMaxH3Model: tests/test_comfyui_loader_minimax_h3.py), both files in one torchrun launch on Ulysses 2 in fp32
compute (tests/engine_cases.py: the engine's loader and layout, as contract E runs them).

Each file's video and audio latents equal diffusers' own single-process MiniMaxH3 modular pipeline (124 frames at
64×64, 4 steps) around a transformer diffusers itself loads (`from_single_file`, its converter) from the weights the
file means: stored · scale for fp8 (tests/quantized_files.py), and for Q8_0 the gguf package's dequantization
rounded once to fp16, as diffusers' GGUF layers compute each block's fp16 scale times its int8 codes (the
unrounded fp32 dequantization's result differs by that rounding alone: measured 1.2e-3). Every rank
holds the layers quantized (float8_e4m3fn, Q8_0) in at most 0.55× the fp32 parameter bytes. Negative control: the
unquantized weights' result misses each by far more than the tolerance, so a loader that dropped the scales or the
quantization would fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models

from quantized_files import fp8_scaled, gguf_file
from test_comfyui_loader_minimax_h3 import CONFIG, _comfyui_file
from xdit_test_helpers import TOLERANCE, case_errors, modular_latents, run_engine_cases

CALL = {"num_inference_steps": 4, "height": 64, "width": 64}
PREFIX = "model.diffusion_model."
# diffusers' MiniMaxH3Transformer3DModel sizes of ComfyUI's MiniMaxH3Model keywords (the rest: diffusers' defaults)
SIZES = dict(hidden_size=CONFIG["hidden_size"], num_layers=CONFIG["num_layers"],
             num_refiner_layers=CONFIG["token_refiner_num_layers"], num_attention_heads=CONFIG["num_attention_heads"],
             attention_head_dim=CONFIG["attention_head_dim"], ffn_dim=CONFIG["ffn_hidden_size"],
             in_channels=CONFIG["latents_dim"], audio_in_channels=CONFIG["audio_latents_dim"], text_dim=CONFIG["text_dim"],
             freq_dim=CONFIG["timestep_input_dim"], time_embed_hidden_dim=CONFIG["time_embed_hidden_size"],
             time_embed_dim=CONFIG["time_embed_dim"], rope_freq_dim=CONFIG["rope_inv_freq_len"])
STORAGE = {"fp8": "float8_e4m3fn", "gguf": "Q8_0"}


@pytest.fixture(scope="module")
def files(comfyui_install, tmp_path_factory):
    """The Comfy-Org-layout file, its scaled fp8 and Q8_0 GGUF copies, each one's meant weights (unprefixed), and
    the inputs."""
    comfyui, python = comfyui_install
    root = tmp_path_factory.mktemp("h3files")
    _comfyui_file(python, comfyui, root / "minimax-h3.safetensors")
    weights = load_file(root / "minimax-h3.safetensors")
    stored, meant = fp8_scaled(weights, per_layer=False)
    save_file(stored, root / "minimax-h3-fp8_scaled.safetensors")
    plain = {k.removeprefix(PREFIX): v for k, v in weights.items()}
    quantized = gguf_file(plain, root / "minimax-h3-Q8_0.gguf", "minimax_h3", as_diffusers=True)
    inputs = tiny_models.make_inputs("minimax-h3", batch=1, height=64, width=64, num_frames=124)
    save_file(inputs, root / "in.safetensors")
    return {"paths": {"fp8": root / "minimax-h3-fp8_scaled.safetensors", "gguf": root / "minimax-h3-Q8_0.gguf"},
            "meant": {"fp8": {k.removeprefix(PREFIX): v for k, v in meant.items() if not k.endswith("scaled_fp8")},
                      "gguf": quantized, "plain": plain},
            "inputs": root / "in.safetensors", "root": root}


def diffusers_result(weights: dict, inputs: dict, work) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' MiniMaxH3 modular pipeline, one process, fp32, its transformer loaded by diffusers' own
    single-file loader from `weights` (Comfy-Org's names), its schedulers the tiny model's (shift 12 and 3)."""
    from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3ModularPipeline

    (work / "config").mkdir(exist_ok=True)
    MiniMaxH3Transformer3DModel.from_config(SIZES).save_config(work / "config")
    save_file({k: v.contiguous() for k, v in weights.items()}, work / "weights.safetensors")
    transformer = MiniMaxH3Transformer3DModel.from_single_file(
        str(work / "weights.safetensors"), config=str(work / "config"), local_files_only=True, torch_dtype=torch.float32)
    pipeline = MiniMaxH3ModularPipeline()
    pipeline.update_components(transformer=transformer, scheduler=MiniMaxH3Scheduler(shift=12.0),
                               audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    video, audio = modular_latents(pipeline, outputs=("latents", "audio_latents"), **CALL, latents=inputs["latents"],
                                   audio_latents=inputs["audio_latents"][0], prompt_embeds=inputs["prompt_embeds"],
                                   text_token_tags=inputs["text_token_tags"])
    return video, audio[None]


@pytest.fixture(scope="module")
def runs(files):
    """Both files in one launch of 2 ranks, Ulysses 2, fp32 compute: {kind: (outputs, each rank's storage)}."""
    root, specs = files["root"], []
    for kind, path in files["paths"].items():
        specs.append({"name": kind, "model": str(path), "inputs": str(files["inputs"]), "dtype": "fp32",
                      "output": str(root / f"out-{kind}.safetensors"), "layout": {"ulysses_degree": 2}, "call": CALL,
                      "report_storage": True})
    run_engine_cases(2, specs, root)
    out = {}
    for spec in specs:
        errors = case_errors(spec["output"])
        assert not errors, errors[-3000:]
        out[spec["name"]] = (load_file(spec["output"]), json.loads(open(spec["output"] + ".storage.json").read()))
    return out


@pytest.fixture(scope="module")
def references(files, tmp_path_factory):
    inputs = load_file(files["inputs"])
    return {kind: diffusers_result(weights, inputs, tmp_path_factory.mktemp(kind))
            for kind, weights in files["meant"].items()}


@pytest.mark.parametrize("kind", list(STORAGE))
def test_a_quantized_h3_file_on_ulysses_2_equals_diffusers_on_the_weights_it_means(files, runs, references, kind):
    output, storage = runs[kind]
    want_video, want_audio = references[kind]
    errors = [(output["latents"] - want_video).abs().max().item(), (output["audio"] - want_audio).abs().max().item()]
    assert max(errors) <= TOLERANCE, errors
    plain_video, plain_audio = references["plain"]  # negative control: the unquantized weights' result
    misses = [(output["latents"] - plain_video).abs().max().item(), (output["audio"] - plain_audio).abs().max().item()]
    assert min(misses) > 10 * TOLERANCE, misses
    fp32 = sum(v.numel() * 4 for k, v in files["meant"]["plain"].items() if k != "rope.inv_freq")  # rope: a buffer
    assert len(storage) == 2 and all(STORAGE[kind] in rank for rank in storage), storage
    assert all(sum(rank.values()) <= 0.55 * fp32 for rank in storage), (storage, fp32)

