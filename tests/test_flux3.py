"""FLUX 3 [klein], the first modular pipeline (diffusers' Flux3ModularPipeline / Flux3DistilledModularPipeline).

test_engine_layouts runs both tiny models through every layout at 64² (the base one's CFG by its guider, two calls
per step, one per CFG rank). Here, one torchrun of two ranks (tests/engine_cases.py) runs 48 × 80 pixels: 15 image
tokens, uneven over 2 ranks, with the base model's negative text 5 tokens shorter than its positive, under Ulysses
2, Ring 2, CFG 2 and data parallel 2 for the base model and Ulysses 2 and Ring 2 for the distilled one; each equals
diffusers' own modular pipeline in one process within 1e-4, and the negative control (attention that also sees the
padding keys of the uneven split) misses; two reference images (its image-conditioned workflow, through its own VAE
encoder block) under Ulysses 2, Ring 2 and CFG 2 equal diffusers given the same pictures. Contract E refuses
PipeFusion, the step cache and references beside uneven image tokens in one line each, with the reason. Its BFL
single files (and scaled fp8, kept quantized) sample as the folder; `--prompt` inputs draw the pipeline's own noise. A pool (Ulysses 2, text encoders) encodes text as the pipeline's own text encoder block does, samples
it as diffusers does, runs img2img (denoise 0.5) as the tail of the schedule FLUX 3 makes itself, takes a LoRA
(diffusers' Flux3 loader) as diffusers' fused one, and stops a cancelled job within a step, the next job unchanged.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from workers.client import JobCancelledError

from pool_helpers import serving
from xdit_test_helpers import (TOLERANCE, case_errors, diffusers_latents, load_pipeline_folder, modular_text_encoding,
                               run_engine_cases, torchrun)

HEIGHT, WIDTH, STEPS, GUIDANCE = 48, 80, 3, 4.0
CALL = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": HEIGHT, "width": WIDTH}
CASES = {"flux3": {"ulysses2": {"ulysses_degree": 2}, "ring2": {"ring_degree": 2}, "cfg2": {"cfg_degree": 2},
                   "dp2": {"dp_degree": 2}, "padded_keys": {"ulysses_degree": 2}},
         "flux3-distilled": {"ulysses2": {"ulysses_degree": 2}, "ring2": {"ring_degree": 2}}}


REFERENCES = {"ulysses2-references": {"ulysses_degree": 2}, "ring2-references": {"ring_degree": 2},
              "cfg2-references": {"cfg_degree": 2}}  # two 64² reference images at 64²: 16 + 2 × 16 tokens


def _reference_pictures() -> torch.Tensor:
    return torch.randint(0, 256, (2, 3, 64, 64), generator=torch.Generator().manual_seed(4)) / 255


@pytest.fixture(scope="module")
def uneven(tiny_model_dirs, tmp_path_factory):
    """Every case in one launch; {(family, layout): (output, inputs)}."""
    work = tmp_path_factory.mktemp("flux3")
    specs, results = [], {}
    references = work / "references.safetensors"
    save_file({**tiny_models.make_inputs("flux3"), "image": _reference_pictures()}, references)
    for layout, degrees in REFERENCES.items():
        output = work / f"flux3-{layout}.safetensors"
        specs.append({"name": f"flux3-{layout}", "model": str(tiny_model_dirs["flux3"]), "inputs": str(references),
                      "output": str(output), "layout": degrees, "call": {**CALL, "height": 64, "width": 64}})
        results["flux3", layout] = (output, references)
    for family, layouts in CASES.items():
        for layout, degrees in layouts.items():
            batch = 2 if layout == "dp2" else 1
            inputs = work / f"{family}-b{batch}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(family, batch=batch, height=HEIGHT, width=WIDTH), inputs)
            output = work / f"{family}-{layout}.safetensors"
            specs.append({"name": f"{family}-{layout}", "model": str(tiny_model_dirs[family]), "inputs": str(inputs),
                          "output": str(output), "layout": degrees, "call": CALL,
                          "fault": "padded_keys" if layout == "padded_keys" else None})
            results[family, layout] = (output, inputs)
    run_engine_cases(2, specs, work)
    return results


def _error(uneven, tiny_model_dirs, family, layout) -> float:
    output, inputs = uneven[family, layout]
    assert not case_errors(output), case_errors(output)[-3000:]
    got = load_file(output)["latents"]
    expected = diffusers_latents(tiny_model_dirs[family], family, **load_file(inputs), **CALL)
    assert got.shape == expected.shape == (load_file(inputs)["latents"].shape[0], 128, HEIGHT // 16, WIDTH // 16)
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("family, layout", [(f, l) for f, ls in CASES.items() for l in ls if l != "padded_keys"])
def test_uneven_tokens_and_texts_equal_diffusers_modular_pipeline(uneven, tiny_model_dirs, family, layout):
    assert _error(uneven, tiny_model_dirs, family, layout) <= TOLERANCE


@pytest.mark.parametrize("layout", REFERENCES)
def test_reference_images_equal_diffusers_given_the_same_pictures(uneven, tiny_model_dirs, layout):
    """Two references through the pipeline's own VAE encoder block, their 32 tokens split apart from the image's 16:
    equal to diffusers' modular pipeline given the same 8-bit pictures, and different from the run without them."""
    from parallel.families.base import pictures

    output, inputs = uneven["flux3", layout]
    assert not case_errors(output), case_errors(output)[-3000:]
    got, plain = load_file(output)["latents"], {k: v for k, v in load_file(inputs).items() if k != "image"}
    call = {**CALL, "height": 64, "width": 64}
    expected = diffusers_latents(tiny_model_dirs["flux3"], "flux3", blocks=("vae_encoder", "denoise"),
                                 image=pictures(_reference_pictures()), **plain, **call)
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert (got - diffusers_latents(tiny_model_dirs["flux3"], "flux3", **plain, **call)).abs().max().item() > 100 * TOLERANCE


def test_negative_control_padding_keys_seen_misses(uneven, tiny_model_dirs):
    assert _error(uneven, tiny_model_dirs, "flux3", "padded_keys") > 100 * TOLERANCE


@pytest.mark.parametrize("flags, says, references", [
    (("--pipefusion-degree", "2"), "has no PipeFusion plan (its per-mode blocks", False),
    (("--ulysses-degree", "2", "--cache", "first-block"), "diffusers has no cache hooks for Flux3Transformer2DModel", False),
    (("--ulysses-degree", "2"), "FLUX 3's 15 image tokens and 32 reference tokens must each divide", True),
], ids=["pipefusion", "step-cache", "uneven-with-references"])
def test_what_it_cannot_run_is_refused_in_one_line(tiny_model_dirs, tmp_path, flags, says, references):
    inputs = tmp_path / "in.safetensors"
    image = {"image": _reference_pictures()} if references else {}
    save_file({**tiny_models.make_inputs("flux3", height=HEIGHT, width=WIDTH), **image}, inputs)
    run = torchrun(2, "-m", "parallel.run", "--model", str(tiny_model_dirs["flux3"]), "--inputs", str(inputs),
                   "--output", str(tmp_path / "out.safetensors"), "--steps", "2", "--height", str(HEIGHT),
                   "--width", str(WIDTH), *flags)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1 and says in errors[0], run.stderr[-3000:]


def _tail_of_schedule(pipeline, init: torch.Tensor, noise: torch.Tensor, steps: int, total: int):
    """img2img as FLUX 3 would run it: its own sigmas for `total` steps (linspace(1, 1/total)), their last `steps`,
    shifted by its scheduler; the start latents noised to the first of them."""
    sigmas = np.linspace(1.0, 1 / total, total)[total - steps:]
    scheduler = pipeline.scheduler.__class__.from_config(pipeline.scheduler.config)
    scheduler.set_timesteps(sigmas=sigmas)
    sigma = scheduler.sigmas[0]
    return sigma * noise + (1 - sigma) * init, sigmas.tolist()


def test_a_pool_encodes_samples_img2img_lora_and_cancel_as_diffusers(tiny_model_dirs, tmp_path):
    from test_lora import fuse_loras, peft_lora_for

    model = tiny_model_dirs["flux3"]
    pipeline = load_pipeline_folder(model)
    lora = peft_lora_for(pipeline.transformer, tmp_path / "lora.safetensors",
                         ("mode_blocks.image.0.attn.to_q", "txt_mode_blocks.1.ff.linear_in",
                          "single_transformer_blocks.0.attn.to_out.0"))
    params = {"steps": STEPS, "guidance_scale": GUIDANCE, "height": 64, "width": 64}
    latents = tiny_models.make_inputs("flux3")["latents"]
    init = tiny_models.make_inputs("flux3", seed=5)["latents"]
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        encoded = {text: client.encode(text)["prompt_embeds"] for text in ("a red fox in the snow", "")}
        inputs = {"latents": latents, "prompt_embeds": encoded["a red fox in the snow"],
                  "negative_prompt_embeds": encoded[""]}
        steps = []
        sampled = client.sample(inputs, params, on_step=steps.append)
        img2img = client.sample({**inputs, "init_latents": init}, {**params, "denoise": 0.5})
        with_lora = client.sample(inputs, {**params, "loras": [{"path": lora, "strength": 0.8}]})
        seen = []
        with pytest.raises(JobCancelledError):
            client.sample(inputs, {**params, "steps": 100}, on_step=seen.append, should_cancel=lambda: len(seen) >= 2)
        after = client.sample(inputs, params)

    for text, embeds in encoded.items():
        assert torch.equal(embeds, modular_text_encoding(pipeline, text)), text
    assert encoded[""].shape[1] == 80  # padded to the pipeline's multiple of 80 tokens
    call = {"num_inference_steps": STEPS, "guidance_scale": GUIDANCE, "height": 64, "width": 64}
    expected = diffusers_latents(pipeline, "flux3", **inputs, **call)
    assert (sampled - expected).abs().max().item() <= TOLERANCE
    assert len(steps) == STEPS and torch.equal(after, sampled)
    assert 2 <= len(seen) <= 4  # stopped within a step or two of the cancel

    start, sigmas = _tail_of_schedule(pipeline, init, latents, STEPS, 2 * STEPS)
    tail = diffusers_latents(pipeline, "flux3", **{**inputs, "latents": start}, sigmas=sigmas, **call)
    assert (img2img - tail).abs().max().item() <= TOLERANCE
    assert (img2img - init).norm() < (sampled - init).norm()  # img2img keeps more of the init latents

    fused = diffusers_latents(fuse_loras(pipeline, [(lora, 0.8)]), "flux3", **inputs, **call)
    assert (with_lora - fused).abs().max().item() <= TOLERANCE
    assert (with_lora - sampled).abs().max().item() > 100 * TOLERANCE  # the LoRA takes part


@pytest.mark.parametrize("family, variant", [("flux3", "flux3-klein"), ("flux3-distilled", "flux3-klein-distilled")])
def test_single_files_in_bfls_layout_load_as_their_folder(tiny_model_dirs, tmp_path, family, variant):
    """The tiny transformer written in BFL's layout (the inverse of diffusers' converter) is detected with every size
    read from its shapes and samples as the folder it came from; its ComfyUI scaled-fp8 file stays fp8 in memory
    and samples as the weights it means (stored · scale), not as the unquantized ones."""
    from parallel.loading.checkpoints import detect_checkpoint
    from parallel.loading.checkpoints.fp8 import Fp8Linear
    from parallel.loading.pipelines import load_pipeline

    from original_layouts import original_layout
    from quantized_files import fp8_scaled

    folder = load_pipeline(tiny_model_dirs[family])
    weights = original_layout(family, folder.transformer)
    paths = {name: tmp_path / f"flux-3-klein-{name}.safetensors" for name in ("plain", "fp8", "meant")}
    stored, meant = fp8_scaled(weights, per_layer=False)
    for name, tensors in (("plain", weights), ("fp8", stored), ("meant", meant)):
        save_file({k: v.contiguous() for k, v in tensors.items()}, paths[name])
    detected = detect_checkpoint(paths["plain"])
    assert (detected.variant, detected.family) == (variant, family)
    for key, value in detected.overrides.items():
        expected = folder.transformer.config[key]
        assert value == (list(expected) if isinstance(expected, tuple) else expected), key

    inputs = tiny_models.make_inputs(family, height=HEIGHT, width=WIDTH)
    sample = lambda pipeline: diffusers_latents(pipeline, family, **inputs, **CALL)  # noqa: E731
    plain = load_pipeline(paths["plain"], dtype="fp32")
    assert type(plain) is type(folder) and plain.text_encoder is None and plain.vae is None
    expected = sample(folder)
    assert (sample(plain) - expected).abs().max().item() <= TOLERANCE
    fp8 = load_pipeline(paths["fp8"], dtype="fp32")
    assert any(isinstance(m, Fp8Linear) for m in fp8.transformer.modules())
    got = sample(fp8)
    assert (got - sample(load_pipeline(paths["meant"], dtype="fp32"))).abs().max().item() <= TOLERANCE
    assert (got - expected).abs().max().item() > 100 * TOLERANCE  # the fp8 rounding shows: the file itself runs


def test_prompt_inputs_draw_the_pipelines_own_noise(tiny_model_dirs):
    """`--prompt` inputs (make_inputs, a pool's encode): the noise FLUX 3's latents block draws from the same seed."""
    from parallel.layout.config import ParallelConfig
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor import wrap_pipeline

    from xdit_test_helpers import one_rank

    model = tiny_model_dirs["flux3"]
    with one_rank(ParallelConfig()):
        wrapper = wrap_pipeline(load_pipeline(model))
        noise = wrapper.initial_noise(torch.Generator().manual_seed(3), HEIGHT, WIDTH, torch.float32)
        wrapper.unwrap()
    pipeline = load_pipeline_folder(model)
    embeds = tiny_models.make_inputs("flux3", height=HEIGHT, width=WIDTH, negative=False)["prompt_embeds"]
    call = {**CALL, "num_inference_steps": 2, "guidance_scale": 1.0, "prompt_embeds": embeds}
    own = diffusers_latents(pipeline, "flux3", generator=torch.Generator().manual_seed(3), **call)
    assert torch.equal(diffusers_latents(pipeline, "flux3", latents=noise, **call), own)
    assert not torch.equal(diffusers_latents(pipeline, "flux3", generator=torch.Generator().manual_seed(4), **call), own)
