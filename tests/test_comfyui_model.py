"""xDiT Model in a real ComfyUI: ComfyUI's own samplers (KSampler, SamplerCustomAdvanced with a CFGGuider)
on a pool equal ComfyUI's own model code on the same single-file checkpoint.

The checkpoint is a tiny SD3 in SAI's layout that ComfyUI's UNETLoader loads natively (ComfyUI's MMDiT:
hidden 64 × depth, depth heads of 64); the pool loads the same weights as a diffusers folder. Both sides
get the same CONDITIONING (xDiT Text Encode) and ComfyUI's own noise, so the latents agree within 1e-4.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save_file

from parallel.loading import tiny_models
from large_files import QWEN
from original_layouts import original_layout
from test_comfyui import saved_latent
from xdit_test_helpers import TOLERANCE

MODEL = "tiny-sd3-sai"
STEPS, SIZE, CFG, SEED = 4, 64, 4.5, 11
SAMPLERS = [("euler", "simple"), ("dpmpp_2m", "karras")]


@pytest.fixture(scope="module")
def checkpoint(comfy):
    return save_checkpoint(comfy.work)


def save_checkpoint(work) -> str:
    """The same tiny SD3 as a diffusers folder (for the pool) and a SAI single file (for UNETLoader), in the models
    folders of a test server's `work` folder (tests/comfyui_server.py)."""
    pipe = tiny_models.build_tiny_pipeline("sd3", seed=4)
    config = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        transformer = type(pipe.transformer).from_config(
            {**config, "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 64, "caption_projection_dim": 128}
        ).eval()
    tiny_models._peak_attention(transformer, tiny_models.QK_SCALE)
    pipe = type(pipe)(**{**pipe.components, "transformer": transformer})
    pipe.save_pretrained(work / "models" / "diffusers" / MODEL, safe_serialization=True)
    weights = original_layout("sd3", transformer)
    save_file({k: v.contiguous() for k, v in weights.items()}, work / "models" / "diffusion_models" / f"{MODEL}.safetensors")
    return MODEL


def _pool(**layout) -> dict:
    return {"class_type": "XDiTPool", "inputs": {
        "model": MODEL, "nproc": 2, "ulysses_degree": 1, "ring_degree": 1, "pipefusion_degree": 1, "num_patches": 0,
        "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1, "text_encoders": True, "dtype": "auto", "devices": "",
        "threads_per_rank": 1, "endpoint": "", **layout}}


def _ksampler(model, sampler: str, scheduler: str, steps: int = STEPS) -> dict:
    return {"class_type": "KSampler", "inputs": {
        "model": model, "seed": SEED, "steps": steps, "cfg": CFG, "sampler_name": sampler, "scheduler": scheduler,
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}


def _save(samples, prefix: str) -> dict:
    return {"class_type": "SaveLatent", "inputs": {"samples": samples, "filename_prefix": prefix}}


def graph(layout: dict, stock: bool) -> dict:
    """The pool's text encodings, then KSampler (both samplers) and SamplerCustomAdvanced on xDiT Model
    (and, with `stock`, on ComfyUI's own model of the same file)."""
    prompt = {
        "1": _pool(**layout),
        "2": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": "a red fox in snow"}},
        "3": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": "blurry"}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "5": {"class_type": "XDiTModel", "inputs": {"pool": ["1", 0]}},
        "6": {"class_type": "UNETLoader", "inputs": {"unet_name": f"{MODEL}.safetensors", "weight_dtype": "default"}},
        "7": {"class_type": "RandomNoise", "inputs": {"noise_seed": SEED}},
        "8": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
    }
    for source, model in (("xdit", "5"), ("stock", "6")) if stock else (("xdit", "5"),):
        for sampler, scheduler in SAMPLERS:
            node = f"{source}-{sampler}"
            prompt[node] = _ksampler([model, 0], sampler, scheduler)
            prompt[f"save-{node}"] = _save([node, 0], f"{source}_{sampler}")
        prompt[f"{source}-guider"] = {"class_type": "CFGGuider", "inputs": {
            "model": [model, 0], "positive": ["2", 0], "negative": ["3", 0], "cfg": CFG}}
        prompt[f"{source}-sigmas"] = {"class_type": "BasicScheduler", "inputs": {
            "model": [model, 0], "scheduler": "simple", "steps": STEPS, "denoise": 1.0}}
        prompt[f"{source}-custom"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["7", 0], "guider": [f"{source}-guider", 0], "sampler": ["8", 0], "sigmas": [f"{source}-sigmas", 0],
            "latent_image": ["4", 0]}}
        prompt[f"save-{source}-custom"] = _save([f"{source}-custom", 0], f"{source}_custom")
    return prompt


def latents_of(comfy, entry) -> dict[str, torch.Tensor]:
    return {node.removeprefix("save-"): saved_latent(comfy, entry, node) for node in entry["outputs"]}


@pytest.fixture(scope="module")
def stock(comfy, checkpoint):
    """ComfyUI's own model (UNETLoader) and xDiT Model on a Ulysses-2 pool, in one prompt."""
    entry = comfy.wait(comfy.queue(graph({"ulysses_degree": 2}, stock=True)), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    return latents_of(comfy, entry)


def compare(latents: dict[str, torch.Tensor], stock: dict[str, torch.Tensor]) -> None:
    for name in [f"{sampler}" for sampler, _ in SAMPLERS] + ["custom"]:
        reference = stock[f"stock-{name}"]
        assert (latents[f"xdit-{name}"] - reference).abs().max().item() <= TOLERANCE, name
        assert reference.abs().max().item() > 0.1  # a real latent, not zeros


def test_comfyuis_samplers_on_a_ulysses_pool_equal_comfyuis_own_model(stock):
    compare(stock, stock)
    # negative control: the two samplers differ, so agreeing per sampler is not agreeing on anything
    assert (stock["stock-euler"] - stock["stock-dpmpp_2m"]).abs().max().item() > 1e-2


def test_comfyuis_samplers_on_a_cfg_parallel_pool_equal_comfyuis_own_model(comfy, stock):
    entry = comfy.wait(comfy.queue(graph({"cfg_parallel": True}, stock=False)), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    compare(latents_of(comfy, entry), stock)


def test_interrupt_mid_sampling_leaves_the_pool_idle_and_the_next_prompt_exact(comfy, stock):
    prompt = graph({"ulysses_degree": 2}, stock=False)
    prompt["xdit-euler"] = _ksampler(["5", 0], "euler", "simple", steps=1000)
    prompt = {k: v for k, v in prompt.items() if k in ("1", "2", "3", "4", "5", "xdit-euler", "save-xdit-euler")}
    before = _model_calls(comfy)
    prompt_id = comfy.queue(prompt)
    deadline = time.monotonic() + 120
    while _model_calls(comfy) < before + 6:
        assert time.monotonic() < deadline, "the long sampling never started"
        time.sleep(0.05)
    comfy.post("/interrupt")
    entry = comfy.wait(prompt_id, 60)
    assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"])
    pools = [p for p in comfy.get("/xdit/pools")["pools"] if p["status"].get("world_size")]
    assert pools and all(p["status"]["state"] == "idle" for p in pools)

    entry = comfy.wait(comfy.queue(graph({"ulysses_degree": 2}, stock=False)), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    compare(latents_of(comfy, entry), stock)


def _model_calls(comfy) -> int:
    return sum(p["status"].get("model_calls", 0) for p in comfy.get("/xdit/pools")["pools"])


def test_a_comfyui_lora_loader_on_xdit_model_is_one_clear_error(comfy, checkpoint):
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(1, 1)}, comfy.work / "models" / "loras" / "xdit_model_lora.safetensors")
    prompt = graph({"ulysses_degree": 2}, stock=False)
    prompt["lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["5", 0], "lora_name": "xdit_model_lora.safetensors", "strength_model": 1.0}}
    prompt["xdit-euler"]["inputs"]["model"] = ["lora", 0]
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "error"
    error = json.dumps([m for m in entry["status"]["messages"] if m[0] == "execution_error"])
    assert "load LoRAs with xDiT LoRA between xDiT Pool and xDiT Model" in error


def test_xdit_lora_before_xdit_model_equals_comfyuis_lora_loader_on_its_own_model(comfy, stock):
    """A diffusers-format SD3 LoRA: xDiT LoRA on the pool (PEFT adapters) vs ComfyUI's LoraLoaderModelOnly
    patching its own model's fused q/k/v weights, both under KSampler."""
    g = torch.Generator().manual_seed(9)
    weights = {}
    for layer in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"):
        weights[f"transformer.transformer_blocks.0.{layer}.lora_A.weight"] = torch.randn(4, 128, generator=g) * 0.2
        weights[f"transformer.transformer_blocks.0.{layer}.lora_B.weight"] = torch.randn(128, 4, generator=g) * 0.2
    save_file(weights, comfy.work / "models" / "loras" / "xdit_sd3_lora.safetensors")
    prompt = {k: v for k, v in graph({"ulysses_degree": 2}, stock=True).items()
              if k in ("1", "2", "3", "4", "5", "6", "xdit-euler", "stock-euler", "save-xdit-euler", "save-stock-euler")}
    prompt["xdit-lora"] = {"class_type": "XDiTLoRA", "inputs": {
        "pool": ["1", 0], "lora_name": "xdit_sd3_lora.safetensors", "strength": 0.8}}
    prompt["5"]["inputs"]["pool"] = ["xdit-lora", 0]
    prompt["stock-lora"] = {"class_type": "LoraLoaderModelOnly", "inputs": {
        "model": ["6", 0], "lora_name": "xdit_sd3_lora.safetensors", "strength_model": 0.8}}
    prompt["stock-euler"]["inputs"]["model"] = ["stock-lora", 0]
    logged = len(comfy.log.read_text())
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latents = latents_of(comfy, entry)
    assert (latents["xdit-euler"] - latents["stock-euler"]).abs().max().item() <= TOLERANCE
    assert (latents["xdit-euler"] - stock["stock-euler"]).abs().max().item() > 1e-3  # the LoRA changed the result
    assert "lora key not loaded" not in comfy.log.read_text()[logged:]  # ComfyUI took every key of the file


def test_a_block_replacement_on_xdit_model_is_one_clear_error(comfy, stock):
    """Skip Layer Guidance replaces transformer blocks inside the model, which runs on the pool: refused,
    not silently ignored."""
    prompt = graph({"ulysses_degree": 2}, stock=False)
    prompt["slg"] = {"class_type": "SkipLayerGuidanceDiT", "inputs": {
        "model": ["5", 0], "double_layers": "1", "single_layers": "", "scale": 3.0, "start_percent": 0.0,
        "end_percent": 1.0, "rescaling_scale": 0.0}}
    prompt["xdit-euler"]["inputs"]["model"] = ["slg", 0]
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "error"
    error = json.dumps([m for m in entry["status"]["messages"] if m[0] == "execution_error"])
    assert "xDiT Model cannot apply a ComfyUI block or attention replacement (dit double_block 1)" in error


@pytest.fixture(scope="module")
def qwen_checkpoint(comfy, qwen_image_files):
    """The session's one-block Qwen-Image of ComfyUI's width (conftest's qwen_image_files: built once, 24 s) linked into
    this server's models folders, as a diffusers folder and a Comfy-Org single file."""
    for kind, name in (("diffusers", QWEN), ("diffusion_models", f"{QWEN}.safetensors")):
        (comfy.work / "models" / kind / name).symlink_to(qwen_image_files / kind / name)
    return QWEN


def test_ksampler_on_a_qwen_image_pool_equals_comfyuis_own_qwen_image(comfy, qwen_checkpoint):
    prompt = {k: v for k, v in graph({"ulysses_degree": 2}, stock=True).items()
              if k in ("1", "2", "3", "4", "5", "6", "xdit-euler", "stock-euler", "save-xdit-euler", "save-stock-euler")}
    prompt["1"]["inputs"]["model"] = QWEN
    prompt["6"]["inputs"]["unet_name"] = f"{QWEN}.safetensors"
    for node in ("xdit-euler", "stock-euler"):
        prompt[node]["inputs"]["cfg"] = 4.0
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latents = latents_of(comfy, entry)
    assert latents["stock-euler"].shape == (1, 16, 1, SIZE // 8, SIZE // 8)  # ComfyUI's own layout for Qwen-Image
    assert (latents["xdit-euler"] - latents["stock-euler"]).abs().max().item() <= TOLERANCE
    assert latents["stock-euler"].abs().max().item() > 0.1


def test_img2img_on_the_pool_equals_comfyuis_ksampler_at_the_same_denoise(comfy, checkpoint):
    """denoise below 1 as ComfyUI means it: KSampler at denoise 0.5 (the last 4 steps of an 8-step schedule, the init
    latent noised to its first sigma) on xDiT Model equals KSampler at the same denoise on ComfyUI's own model of
    the same weights, both samplers, from an init latent that is a first sampling's result. Negative controls: the
    image does not come back unchanged, and denoise 0.6 gives another latent."""
    prompt = {k: v for k, v in graph({"ulysses_degree": 2}, stock=True).items() if k in ("1", "2", "3", "4", "5", "6")}
    prompt["init"] = _ksampler(["6", 0], "euler", "simple")  # an image to start from: ComfyUI's own sampling
    for source, model in (("xdit", "5"), ("stock", "6")):
        for sampler, scheduler in SAMPLERS:
            for denoise in (0.5, 0.6) if (source, sampler) == ("stock", "euler") else (0.5,):
                node = f"{source}-{sampler}-{denoise}"
                prompt[node] = _ksampler([model, 0], sampler, scheduler)
                prompt[node]["inputs"].update(latent_image=["init", 0], denoise=denoise, seed=SEED + 1)
                prompt[f"save-{node}"] = _save([node, 0], f"img2img_{source}_{sampler}_{denoise}")
    prompt["save-init"] = _save(["init", 0], "img2img_init")
    entry = comfy.wait(comfy.queue(prompt), 600)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latents = latents_of(comfy, entry)
    for sampler, _ in SAMPLERS:
        reference = latents[f"stock-{sampler}-0.5"]
        assert (latents[f"xdit-{sampler}-0.5"] - reference).abs().max().item() <= TOLERANCE, sampler
        assert (reference - latents["init"]).abs().max().item() > 1e-2  # img2img changed the image
    assert (latents["stock-euler-0.6"] - latents["stock-euler-0.5"]).abs().max().item() > 1e-2
