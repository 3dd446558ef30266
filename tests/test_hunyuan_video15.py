"""HunyuanVideo 1.5 through real torchrun ranks equals diffusers' single-process pipelines (fp32, 1e-4).

The tiny model (8 latent channels, ×16 VAE, 4 heads) runs on 9-frame 48×48 videos (27 tokens: shards of 14/13 or
7/7/7/6) and 5-frame 64×64 ones (32 tokens, even), with an LLM text and a byT5 glyph text that each end in
padding (the 729 vision tokens text-to-video masks come on top), so every layout also tests the trimmed text
padding. CFG runs in the pipeline's guider, its scale set from the call's guidance_scale. Image-to-video
(HunyuanVideo15ImageToVideoPipeline: SigLIP vision tokens, the start frame's latents as a condition) runs 9-frame
48×80 videos (45 tokens) from a start frame whose own size bucket is 48×80, so diffusers' own call, which sizes the
video from the image, gives the same video. PipeFusion (warm-up = steps) runs alone and beside Ulysses, Ring and
CFG; with warm-up 1 it stays within PipeFusion's stale-K/V bound. Two torchrun launches (2 and 4 ranks) run the
matrix through tests/engine_cases.py. Negative controls: a split without exchange; the stale warm-up-1 run. A
batch whose texts differ in length is refused under Ulysses in one line and runs under CFG and DP; image-to-video
without an image is refused. A 2-rank pool encodes prompts as the pipeline does and samples with its progress from
the scheduler's steps. Single files (Comfy-Org's): their names tell the variants apart; what does not load yet is
not listed.
"""

from __future__ import annotations

from pathlib import Path

import PIL.Image
import pytest
import torch
from diffusers import ClassifierFreeGuidance, DiffusionPipeline
from safetensors.torch import load_file, save_file

from parallel.loading import tiny_models
from parallel.loading.checkpoints.detect import checkpoint_variant, detect_checkpoint
from parallel.loading.pipelines import make_scheduler

from pool_helpers import serving
from test_engine_layouts import LAYOUTS
from xdit_test_helpers import TOLERANCE, case_errors, run_engine_cases

FAMILY, I2V, STEPS, GUIDANCE = "hunyuanvideo15", "hunyuanvideo15-i2v", 4, 6.0
VIDEOS = {"even": (5, 64, 64), "uneven": (9, 48, 48), "wide": (9, 48, 80)}  # (num_frames, height, width)
PIPEFUSION = {2: {"pp2": {"pipefusion_degree": 2}},
              4: {"pp2_ulysses2": {"pipefusion_degree": 2, "ulysses_degree": 2},
                  "pp2_ring2": {"pipefusion_degree": 2, "ring_degree": 2},
                  "pp2_cfg2": {"pipefusion_degree": 2, "cfg_degree": 2}}}
# (nproc, layout, video, variant); a variant with "i2v" runs image-to-video, with "batch2" a batch of two
CASES = [(2, layout, "uneven", "default") for layout in LAYOUTS[2] if layout != "dp2"]  # dp2: below, on a batch of 2
CASES += [(4, layout, "uneven", "default") for layout in LAYOUTS[4]]
CASES += [(2, "ulysses2", "even", "default"), (2, "ring2", "uneven", "unguided"), (4, "cfg2_ulysses2", "even", "default")]
CASES += [(2, "dp2", "uneven", "batch2"), (2, "cfg2", "uneven", "batch2")]
CASES += [(2, layout, "wide", "i2v") for layout in ("ulysses2", "ring2", "cfg2")]
CASES += [(2, "dp2", "wide", "i2v-batch2"), (4, "ulysses2_ring2", "wide", "i2v"), (4, "cfg2_ulysses2", "wide", "i2v")]
CASES += [(n, layout, "even", "default") for n, layouts in PIPEFUSION.items() for layout in layouts]
CASES += [(2, "pp2", "even", "i2v"), (4, "pp2_ulysses2", "even", "i2v")]
CASES += [(2, "pp2", "even", "flow-unipc")]  # UniPC (the pipeline passes sigmas, which DPM-Solver++ does not take)
CONTROLS = [(2, "ulysses2", "even", "no_exchange")]
STALE = (2, "pp2", "even", "warmup1")  # PipeFusion asynchronous after one step
REFUSED = [(2, "ulysses2", "uneven", "batch2"),  # two texts of different lengths: no mask under Ulysses
           (2, "pp2", "uneven", "batch2"),  # nor under PipeFusion
           (2, "ulysses2", "wide", "i2v-noimage")]


def case_name(nproc, layout, video, variant) -> str:
    return f"{layout}-{video}" + ("" if variant == "default" else f"-{variant}")


def guidance(variant: str) -> float:
    return 1.0 if variant == "unguided" else GUIDANCE


def model_of(variant: str) -> str:
    return I2V if "i2v" in variant else FAMILY


def reference(model_dir: Path, inputs: Path, video: str, variant: str) -> torch.Tensor:
    """diffusers' own pipeline, its guider made with the case's guidance scale; image-to-video takes the start
    frame as the 8-bit picture it is and sizes the video from it."""
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=guidance(variant))
    if variant.startswith("flow-"):
        pipeline.scheduler = make_scheduler(pipeline.scheduler, variant)
    frames, height, width = VIDEOS[video]
    tensors = load_file(inputs)
    size = {"height": height, "width": width}
    if "image" in tensors:
        pixels = (tensors.pop("image")[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
        tensors["image"], size = PIL.Image.fromarray(pixels), {}
    with torch.no_grad():
        return pipeline(**tensors, num_inference_steps=STEPS, num_frames=frames, output_type="latent",
                        return_dict=False, **size)[0]


@pytest.fixture(scope="module")
def matrix(video_model_dirs, tmp_path_factory):
    """Run both launches once; return {case: (output file, inputs file, model folder)}."""
    work = tmp_path_factory.mktemp("hunyuan_video15")
    dirs = {FAMILY: video_model_dirs[FAMILY], I2V: tiny_models.save_tiny_pipeline(I2V, work / I2V)}
    results = {}
    for nproc in (2, 4):
        specs = []
        for case in [c for c in CASES + CONTROLS + [STALE] + REFUSED if c[0] == nproc]:
            _, layout, video, variant = case
            frames, height, width = VIDEOS[video]
            batch = 2 if "batch2" in variant else 1
            negative = variant != "unguided"
            model = model_of(variant)
            inputs = work / f"{model}-{video}-b{batch}-{negative}.safetensors"
            if not inputs.exists():
                save_file(tiny_models.make_inputs(model, batch=batch, height=height, width=width, num_frames=frames,
                                                  negative=negative), inputs)
            if variant == "i2v-noimage":
                tensors = load_file(inputs)
                del tensors["image"]
                inputs = work / "no-image.safetensors"
                save_file(tensors, inputs)
            name = case_name(*case)
            layouts = {**LAYOUTS[nproc], **PIPEFUSION[nproc]}
            warmup = {"warmup_steps": 1 if variant == "warmup1" else STEPS} if layout.startswith("pp") else {}
            specs.append({"name": name, "model": str(dirs[model]), "inputs": str(inputs),
                          "output": str(work / f"{name}.safetensors"), "layout": {**layouts[layout], **warmup},
                          "call": {"num_inference_steps": STEPS, "guidance_scale": guidance(variant), "height": height,
                                   "width": width},
                          "scheduler": variant if variant.startswith("flow-") else "default",
                          "fault": variant if variant == "no_exchange" else None})
            results[case] = (Path(specs[-1]["output"]), inputs, dirs[model])
        run_engine_cases(nproc, specs, work)
    return results


def _result(matrix, case):
    output, inputs, model_dir = matrix[case]
    errors = case_errors(output)
    assert not errors, errors[-3000:]
    _, _, video, variant = case
    return load_file(output)["latents"], reference(model_dir, inputs, video, variant)


@pytest.mark.parametrize("case", CASES, ids=[case_name(*c) for c in CASES])
def test_layout_matches_single_process_diffusers(matrix, case):
    parallel, expected = _result(matrix, case)
    assert parallel.shape == expected.shape and parallel.ndim == 5
    error = (parallel - expected).abs().max().item()
    assert error <= TOLERANCE, f"{case_name(*case)}: max |parallel - diffusers| = {error:.3g}"


@pytest.mark.parametrize("case", CONTROLS, ids=[case_name(*c) for c in CONTROLS])
def test_a_split_without_exchange_fails_the_check(matrix, case):
    parallel, expected = _result(matrix, case)
    assert (parallel - expected).abs().max().item() > 100 * TOLERANCE


def test_guidance_reaches_the_guider(matrix):
    """The unguided case is not the guided one: the call's guidance_scale is what the guider used."""
    output, inputs, model_dir = matrix[(2, "ring2", "uneven", "unguided")]
    guided = reference(model_dir, inputs, "uneven", "default")
    assert (load_file(output)["latents"] - guided).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("case", REFUSED, ids=[case_name(*c) for c in REFUSED])
def test_what_cannot_run_is_refused_in_one_line(matrix, case):
    output, _, _ = matrix[case]
    error = case_errors(output)
    if "noimage" in case[-1]:
        assert "needs `image`, the first frame to animate" in error, error[-2000:]
    else:
        assert "texts of different lengths" in error and "send one prompt per job" in error, error[-2000:]


def test_stale_pipefusion_is_within_its_bound(matrix):
    """Warm-up 1: the other patches' K/V one step old (test_pipefusion.py's bound), and visibly not exact."""
    parallel, expected = _result(matrix, STALE)
    error = ((parallel - expected).norm() / expected.norm()).item()
    assert 10 * TOLERANCE < error < 0.05, error


def test_image_to_video_follows_the_image(matrix):
    """The start frame reaches the transformer: the same noise and text with another image give another video."""
    output, inputs, model_dir = matrix[(2, "ulysses2", "wide", "i2v")]
    tensors = load_file(inputs)
    tensors["image"] = 1 - tensors["image"]
    other = inputs.parent / "other-image.safetensors"
    save_file(tensors, other)
    assert (load_file(output)["latents"] - reference(model_dir, other, "wide", "i2v")).abs().max().item() > 100 * TOLERANCE


def test_pool_encodes_as_the_pipeline_and_samples_with_progress(video_model_dirs, tmp_path):
    """Qwen2.5-VL and byT5 encodings on a Ulysses-2 pool equal encode_prompt (a quoted word makes glyph tokens);
    a job with them equals diffusers, and reports every step (from the scheduler: the pipeline takes no callback)."""
    model_dir = video_model_dirs[FAMILY]
    pipeline = DiffusionPipeline.from_pretrained(model_dir)
    frames, height, width = VIDEOS["uneven"]
    with serving(model_dir, tmp_path, "--nproc", "2", "--ulysses-degree", "2", "--text-encoders") as client:
        encoded = {text: client.encode(text) for text in ('a sign that says "open"', "")}
        for text, tensors in encoded.items():
            expected = dict(zip(("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"),
                                pipeline.encode_prompt(text, device="cpu")))
            assert tensors.keys() == expected.keys()
            for name, value in expected.items():
                error = (tensors[name].to(value.dtype) - value).abs().max().item()
                assert error <= 1e-6, (text, name, error)  # byT5 runs in another process's thread count
        inputs = {"latents": tiny_models.make_inputs(FAMILY, height=height, width=width, num_frames=frames)["latents"],
                  **encoded['a sign that says "open"'], **{f"negative_{name}": value for name, value in encoded[""].items()}}
        steps = []
        latents = client.sample(inputs, {"steps": STEPS, "guidance_scale": GUIDANCE, "height": height, "width": width},
                                on_step=lambda message: steps.append(message.params["index"]))
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=GUIDANCE)
    with torch.no_grad():
        expected = pipeline(**inputs, num_inference_steps=STEPS, height=height, width=width, num_frames=frames,
                            output_type="latent", return_dict=False)[0]
    assert steps == list(range(1, STEPS + 1))
    assert (latents - expected).abs().max().item() <= TOLERANCE


def test_single_files_are_told_apart_by_name_and_the_distilled_ones_not_listed(tmp_path):
    """HunyuanVideo 1.5's variants share one shape: Comfy-Org's names tell 480p / 720p and t2v / i2v apart. Its step-
    distilled (`time_r_in`) and super-resolution (98 input channels) files do not load yet: xDiT Pool lists neither."""
    def write(name: str, channels: int = 65, **more) -> str:
        shapes = {"img_in.proj.weight": (256, channels, 1, 1, 1), "final_layer.linear.weight": (32, 256),
                  "cond_type_embedding.weight": (3, 256), "vision_in.proj.0.weight": (1152,),
                  "byt5_in.fc1.weight": (256, 1472), "double_blocks.0.img_mlp.fc1.weight": (1024, 256),
                  "txt_in.input_embedder.weight": (256, 64), "txt_in.individual_token_refiner.blocks.0.norm1.weight": (256,),
                  **more}
        save_file({k: torch.zeros(v) for k, v in shapes.items()}, tmp_path / name)
        return str(tmp_path / name)

    assert checkpoint_variant(write("hunyuanvideo1.5_720p_i2v_fp16.safetensors")) == "hunyuanvideo1.5-720p-i2v"
    assert checkpoint_variant(write("hunyuanvideo1.5_480p_t2v_fp16.safetensors")) == "hunyuanvideo1.5-480p-t2v"
    for path in (write("hunyuanvideo1.5_480p_i2v_step_distilled.safetensors", **{"time_r_in.mlp.0.weight": (256, 256)}),
                 write("hunyuanvideo1.5_1080p_sr_distilled_fp16.safetensors", channels=98)):
        assert checkpoint_variant(path) is None
        with pytest.raises(ValueError, match="step-distilled or super-resolution"):
            detect_checkpoint(path)
