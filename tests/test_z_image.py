"""Z-Image: latents and text as lists of samples, a padded [image; text] stream, its own CFG.

test_engine_layouts runs the tiny model through every layout (CFG on, texts of one padded length). Here,
through contract E on 2 ranks: 48 × 80 pixels (15 image tokens, which the model pads to 32) with a 40-token
prompt and a 17-token negative (padded to 64 and 32: the model would mask them, so each sample runs alone)
under Ulysses 2, Ring 2 and CFG 2 equals diffusers' single-process ZImagePipeline within 1e-4, and misses it
by far more with another guidance scale; guidance 0 (no CFG, as Z-Image-Turbo samples) equals diffusers
and refuses CFG parallel in one line. On a Ulysses-2 pool, the Qwen3 encodings equal the pipeline's own
encode_prompt (one [1, tokens, width] per prompt, unpadded), a job with them equals diffusers, and a PEFT LoRA
on the main and refiner blocks equals diffusers with the LoRA fused (and is removed exactly). The plan's
paths ("*", "-1") name the modules they should. PipeFusion 2 (warm-up = steps, with CFG) equals diffusers, and
with warm-up 1 stays within its stale-K/V bound.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers import DiffusionPipeline

from parallel.loading import tiny_models
from parallel.model_executor.hooks import modules_at

from pool_helpers import serving
from test_lora import fuse_loras
from xdit_test_helpers import TOLERANCE, diffusers_latents, torchrun

FAMILY, STEPS, GUIDANCE = "z-image", 4, 1.0
HEIGHT, WIDTH, TEXT = 48, 80, 40
CALL = {"num_inference_steps": STEPS, "height": HEIGHT, "width": WIDTH}


def _engine(model, inputs, output, guidance, *flags):
    return torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                    "--steps", str(STEPS), "--guidance-scale", str(guidance), "--height", str(HEIGHT),
                    "--width", str(WIDTH), *flags)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("z-image") / "in.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, text_tokens=TEXT), path)
    return path


@pytest.mark.parametrize("flags", [("--ulysses-degree", "2"), ("--ring-degree", "2"), ("--cfg-parallel",)],
                         ids=["ulysses2", "ring2", "cfg2"])
def test_texts_of_different_padded_lengths_and_uneven_image_equal_diffusers(tiny_model_dirs, inputs, tmp_path, flags):
    given = load_file(inputs)
    assert (given["prompt_embeds"].shape[1], given["negative_prompt_embeds"].shape[1]) == (TEXT, 17)
    output = tmp_path / "out.safetensors"
    run = _engine(tiny_model_dirs[FAMILY], inputs, output, GUIDANCE, *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    got = load_file(output)["latents"]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **given, guidance_scale=GUIDANCE, **CALL)
    assert got.shape == expected.shape == (1, 16, HEIGHT // 8, WIDTH // 8)
    assert (got - expected).abs().max().item() <= TOLERANCE
    other = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **given, guidance_scale=2 * GUIDANCE, **CALL)
    assert (got - other).abs().max().item() > 100 * TOLERANCE  # negative control: the guidance takes part


def test_without_guidance_equals_diffusers_and_cfg_parallel_is_refused(tiny_model_dirs, tmp_path):
    inputs, output = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file(tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH, negative=False), inputs)
    run = _engine(tiny_model_dirs[FAMILY], inputs, output, 0.0, "--ulysses-degree", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), guidance_scale=0.0, **CALL)
    assert (load_file(output)["latents"] - expected).abs().max().item() <= TOLERANCE

    run = _engine(tiny_model_dirs[FAMILY], inputs, output, 0.0, "--cfg-parallel")
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and "CFG parallel on Z-Image needs guidance_scale above 0" in errors[0]


def test_pipefusion_equals_diffusers_and_stays_within_its_stale_bound(tiny_model_dirs, tmp_path):
    """PipeFusion 2 over the main layers, a patch a slice of the joined [image; text] sequence: with warm-up =
    steps equal to diffusers, CFG's two samples (texts of different padded lengths) each running alone with
    their own stale K/V; with warm-up 1 (no CFG) within PipeFusion's stale-K/V bound and visibly not exact."""
    size = {"height": 64, "width": 64}
    for guidance, warmup in ((GUIDANCE, STEPS), (0.0, 1)):
        inputs, output = tmp_path / f"in{warmup}.safetensors", tmp_path / f"out{warmup}.safetensors"
        save_file(tiny_models.make_inputs(FAMILY, **size, text_tokens=TEXT, negative=guidance > 0), inputs)
        run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs[FAMILY]), "--inputs", str(inputs),
                       "--output", str(output), "--steps", str(STEPS), "--guidance-scale", str(guidance), "--height", "64",
                       "--width", "64", "--pipefusion-degree", "2", "--warmup-steps", str(warmup))
        assert run.returncode == 0, run.stderr[-3000:]
        got = load_file(output)["latents"]
        expected = diffusers_latents(tiny_model_dirs[FAMILY], FAMILY, **load_file(inputs), guidance_scale=guidance,
                                     num_inference_steps=STEPS, **size)
        if warmup == STEPS:
            assert (got - expected).abs().max().item() <= TOLERANCE
        else:
            assert 100 * TOLERANCE < (got - expected).abs().max().item()
            assert ((got - expected).norm() / expected.norm()).item() < 0.05


def test_plan_paths_name_every_child_and_the_last():
    blocks = torch.nn.Module()
    blocks.layers = torch.nn.ModuleList(torch.nn.Linear(1, 1) for _ in range(3))
    assert [name for name, _ in modules_at(blocks, "layers.*")] == ["layers.0", "layers.1", "layers.2"]
    assert [(name, module) for name, module in modules_at(blocks, "layers.-1")] == [("layers.2", blocks.layers[2])]
    assert modules_at(blocks, "") == [("", blocks)]
    with pytest.raises(AttributeError):
        modules_at(blocks, "blocks.0")


def _peft_lora(path, blocks=("layers.1", "noise_refiner.0"), rank=4) -> str:
    g = torch.Generator().manual_seed(3)
    weights = {}
    for block in blocks:
        for layer in ("attention.to_q", "attention.to_v", "feed_forward.w1"):
            out = 170 if layer == "feed_forward.w1" else 64  # Z-Image's FFN: int(64 / 3 * 8)
            weights[f"transformer.{block}.{layer}.lora_A.weight"] = torch.randn(rank, 64, generator=g) * 0.3
            weights[f"transformer.{block}.{layer}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.3
    save_file(weights, path)
    return str(path)


def test_pool_text_encoding_lora_and_jobs_equal_diffusers(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs[FAMILY]
    params = {"steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH}
    lora = _peft_lora(tmp_path / "lora.safetensors")
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        pipeline = DiffusionPipeline.from_pretrained(model)
        encoded = {text: client.encode(text)["prompt_embeds"] for text in ("a red fox in the snow", "blurry")}
        for text, embeds in encoded.items():
            (own,), _ = pipeline.encode_prompt(text, device="cpu", do_classifier_free_guidance=False)
            assert torch.equal(embeds, own[None]), text
        inputs = {"latents": tiny_models.make_inputs(FAMILY, height=HEIGHT, width=WIDTH)["latents"],
                  "prompt_embeds": encoded["a red fox in the snow"], "negative_prompt_embeds": encoded["blurry"]}
        base = client.sample(inputs, params)
        call = {**inputs, "guidance_scale": GUIDANCE, **CALL}
        assert (base - diffusers_latents(pipeline, FAMILY, **call)).abs().max().item() <= TOLERANCE

        with_lora = client.sample(inputs, {**params, "loras": [{"path": lora, "strength": 0.8}]})
        fused = diffusers_latents(fuse_loras(pipeline, [(lora, 0.8)]), FAMILY, **call)
        assert (with_lora - fused).abs().max().item() <= TOLERANCE
        assert (with_lora - base).abs().max().item() > 100 * TOLERANCE  # the LoRA takes part
        assert torch.equal(client.sample(inputs, params), base)  # and is removed exactly
