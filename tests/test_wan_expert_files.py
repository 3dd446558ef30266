"""Wan 2.2 T2V A14B from its two expert files, as Comfy-Org, city96 and Kijai ship them
(`wan2.2_t2v_high_noise_14B_*` / `..._low_noise_...`, `..._HIGH_...` / `..._LOW_...`).

Either file loads the pair: the high-noise expert as `transformer`, the low-noise one as `transformer_2`,
with Wan 2.2 A14B's boundary and scheduler (parallel/loading/checkpoints/configs/wan2.2-t2v-a14b). Through contract E on
Ulysses 2 the result equals diffusers' single-process pipeline on the same files, which equals the tiny
two-expert pipeline the files were written from (its scheduler set to the shipped one); with the experts
swapped it does not. A missing partner or a partner of another model is one clear error.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints.load import load_single_file_pipeline
from parallel.loading.pipelines import load_pipeline

from original_layouts import original_layout
from quantized_files import fp8_scaled
from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY = "wan22"
CALL = {"num_inference_steps": 4, "guidance_scale": tiny_models.MODELS[FAMILY].guidance, "height": 64, "width": 64,
        "num_frames": 5}
HEADS = {"num_attention_heads": 2, "attention_head_dim": 128}  # Wan's head size is 128 in every released model


def _experts_pipeline():
    """The tiny Wan 2.2 A14B-style pipeline with head size 128 in both experts (seeds 3 and 6)."""
    pipe = tiny_models.build_tiny_pipeline(FAMILY, seed=3)
    experts = {}
    for name, seed in (("transformer", 3), ("transformer_2", 6)):
        config = {k: v for k, v in getattr(pipe, name).config.items() if not k.startswith("_")}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            experts[name] = type(pipe.transformer).from_config({**config, **HEADS}).eval()
        tiny_models._peak_attention(experts[name], tiny_models.QK_SCALE)
    return type(pipe)(**{**pipe.components, **experts}, boundary_ratio=pipe.config.boundary_ratio)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_experts")
    pipe = _experts_pipeline()
    out = {"pipe": pipe, "inputs": root / "in.safetensors"}
    for kind, expert in (("high", pipe.transformer), ("low", pipe.transformer_2)):
        weights = original_layout("wan", expert)
        out[kind] = root / f"wan2.2_t2v_{kind}_noise_14B_fp16.safetensors"
        save_file({k: v.contiguous() for k, v in weights.items()}, out[kind])
        out[f"{kind}_fp8"] = root / "fp8" / f"Wan2_2-T2V-A14B_{kind.upper()}_fp8_e4m3fn_scaled_KJ.safetensors"
        out[f"{kind}_fp8"].parent.mkdir(exist_ok=True)
        save_file(fp8_scaled(weights, per_layer=False)[0], out[f"{kind}_fp8"])
    save_file(tiny_models.make_inputs(FAMILY, num_frames=5), out["inputs"])
    return out


def _latents(pipeline, inputs) -> torch.Tensor:
    return diffusers_latents(pipeline, FAMILY, **load_file(inputs), **CALL)


@pytest.mark.parametrize("chosen", ["high", "low"])
def test_either_expert_file_loads_the_pair_in_order(files, chosen):
    pipeline = load_single_file_pipeline(files[chosen], dtype=torch.float32)
    assert pipeline.config.boundary_ratio == 0.875 and pipeline.scheduler.config.flow_shift == 12.0
    for name in ("transformer", "transformer_2"):
        loaded, written = getattr(pipeline, name).state_dict(), getattr(files["pipe"], name).state_dict()
        assert loaded.keys() == written.keys() and all(torch.equal(loaded[k], written[k]) for k in written), name


def test_the_pair_through_contract_e_equals_diffusers(files, tmp_path):
    output = tmp_path / "out.safetensors"
    run = torchrun(2, "-m", "parallel.run", "--model", str(files["low"]), "--inputs", str(files["inputs"]),
                   "--output", str(output), "--dtype", "fp32", "--steps", "4", "--guidance-scale",
                   str(CALL["guidance_scale"]), "--height", "64", "--width", "64", "--num-frames", "5",
                   "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    got = load_file(output)["latents"]
    from_files = load_pipeline(files["high"], dtype="fp32")
    assert (got - _latents(from_files, files["inputs"])).abs().max().item() <= TOLERANCE
    written = files["pipe"]
    written.scheduler = from_files.scheduler  # the shipped A14B scheduler (flow shift 12)
    assert (got - _latents(written, files["inputs"])).abs().max().item() <= TOLERANCE
    swapped = type(written)(**{**written.components, "transformer": written.transformer_2,
                                "transformer_2": written.transformer}, boundary_ratio=written.config.boundary_ratio)
    assert (got - _latents(swapped, files["inputs"])).abs().max().item() > 10 * TOLERANCE  # the experts' order matters


def test_scaled_fp8_expert_files_stay_fp8(files):
    from parallel.loading.checkpoints.fp8 import storage_of

    pipeline = load_pipeline(files["high_fp8"])
    assert storage_of(pipeline.transformer).keys() == storage_of(pipeline.transformer_2).keys() == {
        "float8_e4m3fn", "bfloat16"}


def test_a_missing_or_foreign_partner_is_named(files, tmp_path):
    alone = tmp_path / "wan2.2_t2v_high_noise_14B_fp16.safetensors"
    alone.write_bytes(files["high"].read_bytes())
    with pytest.raises(ValueError, match="is one expert of Wan 2.2 T2V A14B, named so; its partner "
                                         "wan2.2_t2v_low_noise_14B_fp16.safetensors is not beside it"):
        load_pipeline(alone)
    config = {k: v for k, v in files["pipe"].transformer.config.items() if not k.startswith("_")}
    foreign = original_layout("wan", type(files["pipe"].transformer).from_config({**config, "num_layers": 1}))
    save_file({k: v.contiguous() for k, v in foreign.items()}, tmp_path / "wan2.2_t2v_low_noise_14B_fp16.safetensors")
    with pytest.raises(ValueError, match="are not the two experts of one Wan 2.2 T2V A14B"):
        load_pipeline(alone)
