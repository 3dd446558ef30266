"""The loader's example workflows in ComfyUI 0.33's own frontend (headless Chromium): official templates with only
UNETLoader swapped for Load Diffusion Model (xDiT Pool), tests/loader_examples.py.

Every example loads and converts (subgraphs flattened as the Run button does) to the template's own prompt but for
its loader nodes. Ten of the twelve run whole (RUNS), on the template's own sampling part (steps but as below,
sampler, scheduler, cfg, shift, seed, switches and LoRA loaders left as shipped), and give ComfyUI's own latent
within 1e-4 (UNETLoader on the same file in the same prompt). What a CPU test cannot run is stood in for:
- the files are tiny ones built with ComfyUI's own layout, under the template's file names (FLUX.1 [dev]: the tiny
  Kontext, the same architecture);
- CLIPLoader / DualCLIPLoader become XDiTTestTextEncoder (the released text encoders are billions of parameters), which
  gives each prompt text a CONDITIONING shaped as ComfyUI's encoder shapes it, and whose TextGenerate (Krea 2's prompt
  enhancer) writes one known text;
- VAELoader becomes XDiTTestVAE, whose decode keeps the latent it is given (what is compared) and whose encode gives
  WanImageToVideo a latent of the Wan VAE's shape from the start image (LoadImage's file: a small picture);
- the size and frame count become tiny ones; for the two families whose files here are at the released width, the
  step count too (STEPS, 4; the template's sampler, scheduler, cfg, shift and seed kept). ComfyUI detects Qwen-Image
  2512 and Z-Image Turbo only at that width: one block each, 1.5 and 3.6 GB, built once per run by conftest and linked
  here, not copied. At the template's 50 steps at cfg 4 and 8 steps their three runs took 160 s and 90 s of a CI run
  with no minutes to spare; at 4, 18 s and 25-30 s, and fewer steps of the same sampling check the same loader.
Not run, each well over a minute of CI where the others take seconds: Kontext and Qwen-Image-Edit scale their input
pictures to ~1 megapixel whatever the size asked (FluxKontextImageScale, TextEncodeQwenImageEditPlus: 8000+ tokens
a step).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from large_files import QWEN, Z_IMAGE_TEXT
from loader_examples import EXAMPLES, LAYOUT, LOAD_CONVERT, template
from test_comfyui_loader_flux2 import DEV, KLEIN, KONTEXT, files  # noqa: F401 - fixture
from test_comfyui_image_2026 import KREA, krea_file
from test_comfyui_loader_video import HUNYUAN, I2V, _prompts, _wan_file, hunyuan_files, i2v_files  # noqa: F401 - fixture
from xdit_test_helpers import ROOT, TOLERANCE

COMFY_ARGS = ("--use-pytorch-cross-attention",)  # as tests/test_comfyui_loader_video.py, for Wan's attention
TEXT_ENCODERS, VAES = ("CLIPLoader", "DualCLIPLoader"), ("VAELoader",)
SIZE_NODES = {"EmptySD3LatentImage", "EmptyFlux2LatentImage", "Flux2Scheduler", "EmptyHunyuanLatentVideo",
              "EmptyHunyuanVideo15Latent", "EmptyLatentImage", "WanImageToVideo", "Wan22ImageToVideoLatent"}
GENERATED = "xdit-test-generated"  # what TextGenerate writes on the stand-in CLIP (tests/comfyui_probe/xdit_test_nodes.py)
START = "wan-start.png"  # i2v_files' start image, put under each LoadImage's file name

RUNS = {  # example: (tiny file per template file name, (positive, negative) conditioning files, width, frames)
    "xdit_loader_flux_dev": ({"flux1-dev.safetensors": KONTEXT}, ("kontext-positive", "kontext-positive"), 64, None),
    "xdit_loader_flux2_klein": ({"flux-2-klein-base-4b.safetensors": KLEIN}, ("klein-positive", "klein-negative"), 64, None),
    "xdit_loader_flux2_dev": ({"flux2_dev_fp8mixed.safetensors": DEV}, ("dev-positive", "dev-positive"), 64, None),
    "xdit_loader_wan22_t2v": ({"wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors": "tiny-wan22-high.safetensors",
                               "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors": "tiny-wan22-low.safetensors"},
                              ("wan-positive", "wan-negative"), 64, 5),
    "xdit_loader_hunyuan_video15": ({"hunyuanvideo1.5_720p_t2v_fp16.safetensors": HUNYUAN["t2v"]},
                                    ("hunyuan-positive", "hunyuan-negative"), 64, 5),
    "xdit_loader_wan22_i2v": ({"wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors": I2V["high"],
                               "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors": I2V["low"]},
                              ("wan-positive", "wan-negative"), 64, 5),
    "xdit_loader_wan22_ti2v_5b": ({"wan2.2_ti2v_5B_fp16.safetensors": I2V["5b"]}, ("wan-positive", "wan-negative"), 64, 5),
    "xdit_loader_krea2": ({"krea2_turbo_fp8_scaled.safetensors": f"{KREA}.safetensors"}, ("krea-positive", None), 64, None),
    "xdit_loader_qwen_image": ({"qwen_image_2512_fp8_e4m3fn.safetensors": f"{QWEN}.safetensors"},
                               ("qwen-positive", "qwen-negative"), 64, None),
    "xdit_loader_z_image": ({"z_image_turbo_bf16.safetensors": "z-image-one-layer.safetensors"}, ("z-image-positive", None),
                            64, None),
}
STEPS = {"xdit_loader_qwen_image": 4, "xdit_loader_z_image": 4}  # the step cap of the released-width files


@pytest.fixture(scope="module")
def tiny_files(comfy, files, hunyuan_files, i2v_files, qwen_image_files, z_image_file) -> None:  # noqa: F811 - fixtures
    """The files every run needs beside the flux2 / hunyuan / Wan i2v fixtures': Wan 2.2's two t2v experts, Krea 2's
    file, the session's Qwen-Image and Z-Image files (linked), the prompts (Krea 2's: ComfyUI's Krea 2 encoder gives its
    3 text layers side by side, 3 × 40 wide; Z-Image's: lumina2's hidden states and all-valid mask)."""
    folder = comfy.work / "models" / "diffusion_models"
    (folder / z_image_file.name).symlink_to(z_image_file)
    (folder / f"{QWEN}.safetensors").symlink_to(qwen_image_files / "diffusion_models" / f"{QWEN}.safetensors")
    _wan_file(comfy, "tiny-wan22-high.safetensors", seed=7)
    _wan_file(comfy, "tiny-wan22-low.safetensors", seed=8)
    krea_file(comfy)
    _prompts(comfy)
    save_file({"cond": torch.randn(1, 11, 3 * 40, generator=torch.Generator().manual_seed(14))},
              comfy.work / "input" / "krea-positive.safetensors")
    g = torch.Generator().manual_seed(15)
    for name, tokens in (("qwen-positive", 9), ("qwen-negative", 5)):
        save_file({"cond": torch.randn(1, tokens, 3584, generator=g)}, comfy.work / "input" / f"{name}.safetensors")
    save_file({"cond": torch.randn(1, 12, Z_IMAGE_TEXT, generator=g), "attention_mask": torch.ones(1, 12)},
              comfy.work / "input" / "z-image-positive.safetensors")


def _loaders(prompt: dict, kind: str) -> dict:
    return {node: value for node, value in prompt.items() if value["class_type"] == kind}


def test_every_loader_example_is_made_from_a_template():
    assert {path.stem for path in (ROOT / "example_workflows").glob("xdit_loader_*.json")} == set(EXAMPLES)


@pytest.mark.parametrize("stem", EXAMPLES)
def test_the_example_is_the_official_template_with_the_loader_swapped(comfy, page, stem):
    ours = page.eval(LOAD_CONVERT, json.loads((ROOT / "example_workflows" / f"{stem}.json").read_text()))
    theirs = page.eval(LOAD_CONVERT, template(comfy.python, stem))
    swapped, stock = _loaders(ours, "XDiTLoadDiffusionModel"), _loaders(theirs, "UNETLoader")
    assert stock and swapped.keys() == stock.keys() and not _loaders(ours, "UNETLoader")
    for node, loader in swapped.items():
        assert {name: loader["inputs"][name] for name in ("unet_name", "weight_dtype")} == stock[node]["inputs"]
        assert {name: loader["inputs"][name] for name in LAYOUT} == LAYOUT
    assert {node: value for node, value in ours.items() if node not in swapped} == \
           {node: value for node, value in theirs.items() if node not in stock}


def _text(prompt: dict, value):
    """A text input's value: a literal, what the primitive node it is linked to holds, what TextGenerate writes here, or
    what the switch or PreviewAny it is linked to passes on."""
    if not isinstance(value, list):
        return value
    node = prompt[value[0]]
    if node["class_type"] == "TextGenerate":
        return GENERATED
    if node["class_type"] == "ComfySwitchNode":
        return _text(prompt, node["inputs"]["on_true" if _text(prompt, node["inputs"]["switch"]) else "on_false"])
    if node["class_type"] == "PreviewAny":
        return _text(prompt, node["inputs"]["source"])
    return node["inputs"]["value"]


def _runnable(comfy, prompt: dict, stem: str) -> dict:
    """The converted example made runnable here (the module docstring's stand-ins), its files put in place."""
    names, (positive, negative), size, frames = RUNS[stem]
    models = comfy.work / "models"
    for template_name, tiny in names.items():  # a link: the released-width files are GBs
        os.symlink(os.path.realpath(models / "diffusion_models" / tiny), models / "diffusion_models" / template_name)
    negatives = {value["inputs"]["negative"][0] for value in prompt.values() if "negative" in value["inputs"]}
    texts = {}
    for node, value in prompt.items():
        kind, inputs = value["class_type"], value["inputs"]
        if stem in STEPS and "steps" in inputs:  # a literal or the switch / primitive it is linked to, capped
            inputs["steps"] = min(_text(prompt, inputs["steps"]), STEPS[stem])
        if kind == "CLIPTextEncode":
            texts[_text(prompt, inputs["text"])] = f"{negative if node in negatives else positive}.safetensors"
        elif kind in TEXT_ENCODERS + VAES:
            prompt[node] = {"class_type": "XDiTTestTextEncoder" if kind in TEXT_ENCODERS else "XDiTTestVAE", "inputs": {}}
        elif kind in SIZE_NODES:
            inputs.update({"width": size, "height": size, **({"length": frames} if "length" in inputs else {})})
        elif kind == "LoraLoaderModelOnly":  # behind the template's switch, off as shipped: its file need only exist
            save_file({}, models / "loras" / inputs["lora_name"])
        elif kind == "LoadImage":
            shutil.copy(comfy.work / "input" / START, comfy.work / "input" / inputs["image"])
    (comfy.work / "input" / "xdit-test-texts.json").write_text(json.dumps(texts))
    return prompt


def _decoded(comfy, prompt: dict) -> list[torch.Tensor]:
    """What the prompt's VAE decodes, in order of the calls."""
    folder = comfy.work / "output" / "xdit-decoded"
    shutil.rmtree(folder, ignore_errors=True)
    entry = comfy.wait(comfy.queue(prompt), 600)
    errors = [(m[1]["node_type"], m[1]["exception_message"]) for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert entry["status"]["status_str"] == "success", errors or json.dumps(entry["status"])[-2000:]
    return [load_file(path)["latent"] for path in sorted(folder.glob("*.safetensors"))]


def _stock(prompt: dict) -> dict:
    """The same prompt on ComfyUI's own model: each swapped loader back to UNETLoader."""
    return {node: {"class_type": "UNETLoader", "inputs": {name: value["inputs"][name] for name in ("unet_name", "weight_dtype")}}
            if value["class_type"] == "XDiTLoadDiffusionModel" else value for node, value in prompt.items()}


@pytest.mark.parametrize("stem", RUNS)
def test_the_example_runs_and_equals_comfyuis_own_model(comfy, page, tiny_files, stem):
    prompt = _runnable(comfy, page.eval(LOAD_CONVERT, json.loads((ROOT / "example_workflows" / f"{stem}.json").read_text())),
                       stem)
    ours, stock = _decoded(comfy, prompt), _decoded(comfy, _stock(prompt))
    assert len(ours) == len(stock) == 1 and ours[0].shape == stock[0].shape
    assert stock[0].abs().max().item() > 0.1
    assert (ours[0] - stock[0]).abs().max().item() <= TOLERANCE
    # negative control: the template's seed moved by one gives another latent
    reseeded = json.loads(json.dumps(prompt))
    for value in reseeded.values():
        for name in ("seed", "noise_seed"):
            if isinstance(value["inputs"].get(name), int):
                value["inputs"][name] += 1
    assert (_decoded(comfy, reseeded)[0] - stock[0]).abs().max().item() > 1e-3
