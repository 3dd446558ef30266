"""Qwen-Image 2.1's edit mode: condition pictures as `image`, the prompts encoded with them, on sequence and CFG ranks.

The tiny model's prompts ("a cat on a mat" and the negative "blurry": prefixes of different lengths) are encoded with
one 80 × 48 picture by the engine's own encode (prompt_inputs, what a pool's rank 0 and make_inputs run: the
pipeline's encode_prompt with the picture as its `__call__` sizes it, ~1024², 1,025 slots of 2×2 latent tokens) into
contract E's IN: embeddings, each prompt's `image_pad_mask`, the picture. Through real ranks with the prefix K/V cache
on, Ulysses 2, Ring 2, CFG 2 and data parallel 2 (two samples sharing the picture) equal diffusers' own
single-process QwenImage21Pipeline called with the prompt strings and the PIL picture within 1e-4 in fp32; the same
pipeline with another picture, or none, misses by far more. Under Ulysses 2 each rank's cached prefix holds the
picture's tokens (its bytes count them) and is stored once per job. The same IN through `python -m parallel.run` on
Ulysses 2 equals it too.
Embeddings without their `image_pad_mask`, or encoded with a picture of another shape, are refused in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.families.base import pictures
from parallel.loading import tiny_models

from xdit_test_helpers import TOLERANCE, case_errors, diffusers_latents, one_rank, run_engine_cases, torchrun

FAMILY, PROMPT, NEGATIVE = "qwen-image-2.1", "a cat on a mat", "blurry"
CALL = {"num_inference_steps": 3, "true_cfg_scale": 4.0, "height": 64, "width": 96, "use_kv_cache": 1}
CASES = {  # name: (layout, what the IN holds instead of the encoded inputs, expected error or None)
    "ulysses2": ({"ulysses_degree": 2}, {}, None),
    "ring2": ({"ring_degree": 2}, {}, None),
    "cfg2": ({"cfg_degree": 2}, {}, None),
    "dp2": ({"dp_degree": 2}, {"batch": 2}, None),  # two samples, the picture shared
    "no-slots": ({"ulysses_degree": 2}, {"image_pad_mask": None},
                 "prompt_embeds come without image_pad_mask: encode the prompts with the condition pictures"),
    "other-picture": ({"ulysses_degree": 2}, {"image": "square"}, "image_pad_mask [1, "),
}


def picture(seed: int = 5) -> torch.Tensor:
    """An 8-bit picture of 80 × 48, [1, 3, H, W] in [0, 1]."""
    return torch.randint(0, 256, (1, 3, 48, 80), generator=torch.Generator().manual_seed(seed)).float() / 255


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor import wrap_pipeline
    from parallel.model_executor.prompt_inputs import prompt_inputs

    work = tmp_path_factory.mktemp("qwen21_edit")
    with one_rank(ParallelConfig()):
        wrapper = wrap_pipeline(load_pipeline(tiny_model_dirs[FAMILY], text_encoders=True))
        encoded = prompt_inputs(wrapper, PROMPT, NEGATIVE, 0, CALL["height"], CALL["width"], picture())
        wrapper.unwrap()
    specs = []
    for name, (layout, changes, _) in CASES.items():
        inputs = batched(encoded, changes["batch"]) if "batch" in changes else dict(encoded)
        inputs.update({key: torch.rand(1, 3, 64, 64) if value == "square" else value for key, value in changes.items()
                       if key != "batch"})
        given = work / f"{name}-in.safetensors"
        save_file({key: value for key, value in inputs.items() if value is not None}, given)
        specs.append({"name": name, "model": str(tiny_model_dirs[FAMILY]), "inputs": str(given),
                      "output": str(work / f"{name}.safetensors"), "layout": layout, "call": CALL,
                      "report_prefix_cache": name == "ulysses2"})
    run_engine_cases(2, specs, work)
    return work


def batched(encoded: dict, batch: int) -> dict:
    """The encoded prompts `batch` times (one picture for all), each sample its own noise."""
    out = {name: value if name == "image" else value.expand(batch, *value.shape[1:]).contiguous()
           for name, value in encoded.items()}
    out["latents"] = torch.randn(batch, *encoded["latents"].shape[1:], generator=torch.Generator().manual_seed(9))
    return out


def _diffusers(folder, latents, image):
    batch = latents.shape[0]
    return diffusers_latents(folder, FAMILY, prompt=[PROMPT] * batch, negative_prompt=[NEGATIVE] * batch,
                             latents=latents, **({} if image is None else {"image": pictures(image)[0]}), **CALL)


def _parallel(runs, name: str) -> torch.Tensor:
    errors = case_errors(runs / f"{name}.safetensors")
    assert not errors, errors[-3000:]
    return load_file(runs / f"{name}.safetensors")["latents"]


@pytest.mark.parametrize("name", ["ulysses2", "ring2", "cfg2", "dp2"])
def test_edit_equals_diffusers_from_the_prompt_strings_and_the_picture(runs, tiny_model_dirs, name):
    got = _parallel(runs, name)
    expected = _diffusers(tiny_model_dirs[FAMILY], load_file(runs / f"{name}-in.safetensors")["latents"], picture())
    assert got.shape == expected.shape and torch.isfinite(got).all()
    error = (got - expected).abs().max().item()
    assert error <= TOLERANCE, f"{name}: max |parallel - diffusers| = {error:.3g}"


def test_contract_e_takes_the_pictures_and_their_slots(runs, tiny_model_dirs):
    """The same IN through `python -m parallel.run` under torchrun (Ulysses 2): its inputs are the edit's own."""
    out = runs / "cli.safetensors"
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs[FAMILY]), "--inputs",
                   str(runs / "ulysses2-in.safetensors"), "--output", str(out), "--dtype", "fp32",
                   "--ulysses-degree", "2",
                   "--steps", str(CALL["num_inference_steps"]), "--guidance-scale", "1", "--true-cfg-scale", "4",
                   "--height", str(CALL["height"]), "--width", str(CALL["width"]))
    assert run.returncode == 0, run.stderr[-3000:]
    expected = _diffusers(tiny_model_dirs[FAMILY], load_file(runs / "ulysses2-in.safetensors")["latents"], picture())
    assert (load_file(out)["latents"] - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("image", [1 - picture(), None], ids=["another-picture", "no-picture"])
def test_negative_control_another_picture_or_none_misses(runs, tiny_model_dirs, image):
    got = _parallel(runs, "ulysses2")
    other = _diffusers(tiny_model_dirs[FAMILY], load_file(runs / "ulysses2-in.safetensors")["latents"], image)
    assert (got - other).abs().max().item() > 100 * TOLERANCE


def test_the_cached_prefix_holds_the_pictures_tokens_once_per_job(runs, tiny_model_dirs):
    """Per rank and layer, each branch's prefix K/V: its text rows and the picture's 4 latent tokens per slot, at half
    the heads (Ulysses 2), fp32, stored once (not per step)."""
    inputs = load_file(runs / "ulysses2-in.safetensors")
    transformer = json.loads((tiny_model_dirs[FAMILY] / "transformer" / "config.json").read_text())
    heads, head_dim, layers = (transformer[k] for k in ("num_attention_heads", "attention_head_dim", "num_layers"))
    slots = (inputs["image_pad_mask"], inputs["negative_image_pad_mask"])
    prefixes = [mask.shape[1] + 3 * int(mask.sum()) for mask in slots]  # a slot's one row becomes 4 tokens
    report = json.loads((runs / "ulysses2.safetensors.prefix.json").read_text())
    assert [r["stores"] for r in report] == [2 * layers] * 2 and [r["live"] for r in report] == [0, 0]
    assert [r["bytes"] for r in report] == [layers * 2 * sum(prefixes) * heads // 2 * head_dim * 4] * 2


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[2]])
def test_embeddings_without_their_pictures_slots_are_refused_in_one_line(runs, name):
    errors = case_errors(runs / f"{name}.safetensors")
    assert CASES[name][2] in errors.splitlines()[-1], errors[-2000:]
