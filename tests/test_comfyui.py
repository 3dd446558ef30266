"""Against a real ComfyUI server: the pack loads, and API-format workflows run on real pools.

Needs the ComfyUI test bed (tests/testbed.py); without one every test here is skipped with the reason,
shown by `pytest -rs` (as scripts/test.sh runs it).
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file

from xdit_test_helpers import ROOT, TOLERANCE, diffusers_latents, load_pipeline_folder, modular_text_encoding

ARTIFACTS = ROOT / "out" / "test-artifacts"
FAMILIES = {  # family: (empty latent node, cfg, scale, shift)
    "pixart-alpha": ("EmptyLatentImage", 4.5, 0.18215, 0.0),
    "pixart-sigma": ("EmptyLatentImage", 4.5, 0.13025, 0.0),
    "sd3": ("EmptySD3LatentImage", 4.5, 1.5305, 0.0609),
    "flux": ("EmptySD3LatentImage", 1.0, 0.3611, 0.1159),
    "flux-kontext": ("EmptySD3LatentImage", 1.0, 0.3611, 0.1159),  # with ReferenceLatent: tests/test_flux_kontext.py
    "qwen-image": ("EmptySD3LatentImage", 4.0, None, None),  # Wan21 format: the VAE's per-channel mean and std
    "qwen-image-edit": ("EmptySD3LatentImage", 4.0, None, None),  # with its reference image: below
    "z-image": ("EmptySD3LatentImage", 2.0, 0.3611, 0.1159),  # FLUX.1's VAE; cfg 2 is Z-Image's guidance_scale 1
    # ComfyUI 0.33's own FLUX.2 empty latent and latent format (0.3.64 has neither: xDiT Empty Latent and the family's
    # declared format stand in there)
    "flux2-klein": ("EmptyFlux2LatentImage", 4.0, None, None),  # the base model: real CFG
    "flux2-dev": ("EmptyFlux2LatentImage", 1.0, None, None),  # guidance-distilled: cfg 1, FluxGuidance's default 4
    # FLUX 3 (a modular pipeline): no FLUX 3 nodes in ComfyUI 0.33.0; xDiT Empty Latent makes FLUX.2's latent, which
    # is FLUX 3's, in 0.33's own Flux2 format; cfg is its guider's guidance_scale
    "flux3": ("XDiTEmptyLatent", 4.0, None, None),
}
# The pipelines whose latents must be in ComfyUI's own latent format class (nodes/comfy_compat.py logs the one taken)
NATIVE_FORMATS = {"flux2-klein": ("Flux2KleinPipeline", "Flux2"), "flux2-dev": ("Flux2Pipeline", "Flux2"),
                  "z-image": ("ZImagePipeline", "Flux"), "flux3": ("Flux3ModularPipeline", "Flux2")}


def native_format_taken(comfy, pipeline: str, name: str) -> bool:
    """Whether the server's log says the pack took ComfyUI's own comfy.latent_formats.<name> for `pipeline`."""
    return f"xDiT: {pipeline} latents in ComfyUI's own comfy.latent_formats.{name}" in comfy.log.read_text()
TEXT_TO_IMAGE = [family for family in FAMILIES if family not in ("flux-kontext", "qwen-image-edit")]



def workflow(family: str, *, steps=4, size=64, seed=7, positive="a cat on a mat", negative="blurry", nproc=2,
             ulysses=2, ring=1, cfg=None, prefix="out") -> dict:
    empty, default_cfg, _, _ = FAMILIES[family]
    return {
        "1": {"class_type": "XDiTPool", "inputs": {
            "model": f"xdit-tiny-{family} (built-in, no download)", "nproc": nproc, "ulysses_degree": ulysses,
            "ring_degree": ring, "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False,
            "dp_degree": 1, "text_encoders": True, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}},
        "2": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": positive}},
        "3": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["1", 0], "text": negative}},
        "4": {"class_type": empty, "inputs": {"width": size, "height": size, "batch_size": 1,
                                              **({"pool": ["1", 0]} if empty.startswith("XDiT") else {})}},
        "5": {"class_type": "XDiTSampler", "inputs": {
            "pool": ["1", 0], "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "seed": seed,
            "steps": steps, "cfg": default_cfg if cfg is None else cfg, "sampler": "default", "denoise": 1.0, "preview": True}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": f"{prefix}_{family}"}},
    }


def saved_latent(comfy, entry, node: str = "6") -> torch.Tensor:
    info = entry["outputs"][node]["latents"][0]
    return load_file(comfy.work / "output" / info["subfolder"] / info["filename"])["latent_tensor"]


def reference(model_dir, family, *, steps=4, size=64, seed=7, positive="a cat on a mat", negative="blurry",
              true_cfg=None, cache=None, **call) -> torch.Tensor:
    """diffusers' single-process result for ComfyUI's noise of `seed`, in ComfyUI's latent space
    (`true_cfg`: Flux's real CFG, what xDiT Sampler's cfg above 1 means for Flux; `call`: more pipeline
    arguments, e.g. Kontext's reference image; `cache`: a diffusers cache config enabled on the transformer)."""
    _, cfg, scale, shift = FAMILIES[family]
    pipeline = load_pipeline_folder(model_dir)
    if cache is not None:
        pipeline.transformer.enable_cache(cache)
    channels, scale_down = ((4, 8) if family.startswith("pixart") else (128, 16) if family.startswith(("flux2", "flux3"))
                            else (16, 8))
    noise = torch.randn((1, channels, size // scale_down, size // scale_down), generator=torch.manual_seed(seed))
    if family.startswith("flux3"):  # its own text encoder block; the LATENT is what its denoise blocks return
        kwargs = {"prompt_embeds": modular_text_encoding(pipeline, positive),
                  "negative_prompt_embeds": modular_text_encoding(pipeline, negative), "guidance_scale": cfg}
        return diffusers_latents(pipeline, family, **kwargs, latents=noise, num_inference_steps=steps, height=size,
                                 width=size)
    with torch.no_grad():
        if family.startswith("flux2"):  # ComfyUI's FLUX.2 LATENT is what the pipelines take, [B, 128, H/16, W/16]
            embeds, _ = pipeline.encode_prompt(positive, device="cpu")
            kwargs = {"prompt_embeds": embeds, "latents": noise, "guidance_scale": 4.0 if family == "flux2-dev" else cfg}
            if family == "flux2-klein":
                kwargs["negative_prompt_embeds"] = pipeline.encode_prompt(negative, device="cpu")[0]
        elif family.startswith("flux"):
            embeds, pooled, _ = pipeline.encode_prompt(positive, None)
            kwargs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "guidance_scale": 3.5,
                      "latents": pipeline._pack_latents(noise, 1, channels, size // 8, size // 8)}
            if true_cfg is not None:
                negative_embeds, negative_pooled, _ = pipeline.encode_prompt(negative, None)
                kwargs.update(negative_prompt_embeds=negative_embeds, negative_pooled_prompt_embeds=negative_pooled,
                              true_cfg_scale=true_cfg)
        elif family == "qwen-image":
            embeds, _ = pipeline.encode_prompt(positive, device="cpu")
            negative_embeds, _ = pipeline.encode_prompt(negative, device="cpu")
            kwargs = {"prompt_embeds": embeds, "negative_prompt_embeds": negative_embeds, "true_cfg_scale": cfg,
                      "latents": pipeline._pack_latents(noise, 1, channels, size // 8, size // 8)}
        elif family == "z-image":  # lists of [tokens, width]; guidance pos + g·(pos − neg): g = cfg − 1
            (embeds,), _ = pipeline.encode_prompt(positive, do_classifier_free_guidance=False)
            (negative_embeds,), _ = pipeline.encode_prompt(negative, do_classifier_free_guidance=False)
            kwargs = {"prompt_embeds": [embeds], "negative_prompt_embeds": [negative_embeds], "guidance_scale": cfg - 1,
                      "latents": noise}
        elif family == "sd3":
            pe, _, pp, _ = pipeline.encode_prompt(positive, None, None, do_classifier_free_guidance=False)
            ne, _, np_, _ = pipeline.encode_prompt(negative, None, None, do_classifier_free_guidance=False)
            kwargs = {"prompt_embeds": pe, "pooled_prompt_embeds": pp, "negative_prompt_embeds": ne,
                      "negative_pooled_prompt_embeds": np_, "guidance_scale": cfg, "latents": noise}
        else:
            pe, pm, _, _ = pipeline.encode_prompt(positive, do_classifier_free_guidance=False)
            ne, nm, _, _ = pipeline.encode_prompt(negative, do_classifier_free_guidance=False)
            kwargs = {"prompt_embeds": pe, "prompt_attention_mask": pm, "negative_prompt_embeds": ne,
                      "negative_prompt_attention_mask": nm, "guidance_scale": cfg, "latents": noise}
    latents = diffusers_latents(pipeline, family, **kwargs, **call, num_inference_steps=steps, height=size, width=size)
    if family.startswith("flux2"):  # [klein] returns its latents unpatchified and denormalised; [dev] packed
        if family == "flux2-klein":
            bn = pipeline.vae.bn
            std = torch.sqrt(bn.running_var + pipeline.vae.config.batch_norm_eps).view(1, -1, 1, 1)
            return (pipeline._patchify_latents(latents) - bn.running_mean.view(1, -1, 1, 1)) / std
        return latents.transpose(1, 2).reshape(noise.shape)
    if family.startswith("flux"):
        latents = pipeline._unpack_latents(latents, size, size, 8)
    if family == "qwen-image":  # [B, C, 1, H, W] in the VAE's space, as ComfyUI's own Qwen-Image sampling returns
        latents = pipeline._unpack_latents(latents, size, size, 8)
        config = pipeline.vae.config
        mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
        return latents * std + mean
    return latents / scale + shift


def test_pack_imports_and_lists_its_nodes(comfy):
    info = comfy.get("/object_info")
    for node in ("XDiTPool", "XDiTTextEncode", "XDiTSampler", "XDiTCache", "XDiTModel"):
        assert info[node]["category"] == "sampling/xDiT"
        assert all("tooltip" in spec[1] for spec in info[node]["input"]["required"].values())
    assert info["XDiTPool"]["display_name"] == "xDiT Pool"
    assert "IMPORT FAILED" not in comfy.log.read_text()


def test_loading_the_pack_leaves_comfyuis_interpreter_as_it_was(comfy):
    """The pack lives in its own namespace: no top-level `parallel` / `workers` module (both names exist on
    PyPI), no diffusers (ComfyUI 0.3.64 imports none; the pack needs it only in its rank processes), and
    sys.path untouched. tests/comfyui_probe notes the interpreter just before and just after the pack loads."""
    probe = comfy.get("/xdit-test/probe")
    before, after = probe["before"], probe["after"]
    pack = [name for name in after["modules"] if name.endswith("custom_nodes/comfyui-xdit-pool")]
    assert pack and pack[0] not in before["modules"], "the probes must load around the pack and see it load"
    assert not {name.split(".")[0] for name in after["modules"]} & {"parallel", "workers", "diffusers"}
    assert not {name.split(".")[0] for name in probe["now"]["modules"]} & {"parallel", "workers"}
    assert after["path"] == before["path"]
    timings = comfy.log.read_text().split("Import times for custom nodes:\n")[1].split("\n\n")[0]
    assert "comfyui-xdit-pool" in timings and "IMPORT FAILED" not in timings
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "comfyui-import-times.txt").write_text(timings + "\n")  # the pack's import time, for reports


@pytest.mark.parametrize("family", TEXT_TO_IMAGE)
def test_workflow_equals_diffusers_single_process(comfy, tiny_model_dirs, family):
    entry = comfy.wait(comfy.queue(workflow(family)))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    expected = reference(tiny_model_dirs[family], family)
    latent = saved_latent(comfy, entry)
    assert latent.shape == expected.shape
    assert (latent - expected).abs().max().item() <= TOLERANCE
    if family in NATIVE_FORMATS:
        assert native_format_taken(comfy, *NATIVE_FORMATS[family]), "the pack's declared format was taken"
        assert "the pack's declared" not in comfy.log.read_text()


def test_flux_cfg_reaches_the_pool_as_its_true_cfg_scale(comfy, tiny_model_dirs):
    """xDiT Sampler sends Flux's cfg above 1 in the job's call map (true_cfg_scale); equal to diffusers with it."""
    entry = comfy.wait(comfy.queue(workflow("flux", cfg=2.0, prefix="true_cfg")))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latent = saved_latent(comfy, entry)
    expected = reference(tiny_model_dirs["flux"], "flux", true_cfg=2.0)
    assert (latent - expected).abs().max().item() <= TOLERANCE
    assert (latent - reference(tiny_model_dirs["flux"], "flux")).abs().max().item() > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["sd3", "flux2-klein", "flux3"])  # FLUX.2, FLUX 3: previews unfolded
def test_progress_and_preview_frames_arrive_over_the_websocket(comfy, family):
    _, progress, previews, outcome = comfy.run_watching(workflow(family, steps=6, seed=11))
    assert outcome == "execution_success"
    assert progress[-6:] == [1, 2, 3, 4, 5, 6]
    assert previews >= 1


def test_interrupt_ends_the_job_within_a_step_and_the_next_prompt_works(comfy, tiny_model_dirs):
    prompt_id = comfy.queue(workflow("pixart-alpha", steps=1000, seed=3))
    deadline = time.monotonic() + 120
    step = 0
    while step < 3:
        assert time.monotonic() < deadline, "the long job never started"
        pools = comfy.get("/xdit/pools")["pools"]
        step = max((p["status"].get("step", 0) for p in pools if p["status"].get("state") == "busy"), default=0)
        time.sleep(0.05)
    interrupted_at = time.monotonic()
    comfy.post("/interrupt")
    entry = comfy.wait(prompt_id, 60)
    assert time.monotonic() - interrupted_at < 10
    assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"])
    pools = comfy.get("/xdit/pools")["pools"]
    assert all(p["status"]["state"] == "idle" for p in pools if p["status"].get("world_size"))
    entry = comfy.wait(comfy.queue(workflow("pixart-alpha")))
    assert entry["status"]["status_str"] == "success"
    assert (saved_latent(comfy, entry) - reference(tiny_model_dirs["pixart-alpha"], "pixart-alpha")).abs().max() <= TOLERANCE


def _node_error(comfy, prompt) -> str:
    """The readable error of a prompt: a validation error at queue time, or the failing node's error."""
    try:
        prompt_id = comfy.queue(prompt)
    except Exception as error:  # urllib HTTPError 400: validation failed before running
        body = json.loads(error.read())
        return json.dumps(body)
    entry = comfy.wait(prompt_id)
    assert entry["status"]["status_str"] == "error"
    return json.dumps([m for m in entry["status"]["messages"] if m[0] == "execution_error"])


def test_user_errors_are_readable_and_the_pool_stays_usable(comfy, tiny_model_dirs):
    bad_layout = workflow("sd3", ulysses=1)
    assert "1 = 1, but there are 2 ranks" in _node_error(comfy, bad_layout)

    unsplittable = workflow("sd3", size=48)  # 9 tokens over 2 ranks
    assert "do not split over sequence-parallel degree 2" in _node_error(comfy, unsplittable)

    mismatch = workflow("sd3")
    mismatch["7"] = {"class_type": "XDiTPool", "inputs": {**workflow("flux")["1"]["inputs"]}}
    mismatch["2"]["inputs"]["pool"] = ["7", 0]  # Flux text encoding into an SD3 pool
    error = _node_error(comfy, mismatch)
    assert "pooled_prompt_embeds is 16 wide but this pool's StableDiffusion3Pipeline model needs 32" in error, error[:1500]
    assert "SD3's TripleCLIPLoader" in error, error[:1500]  # and which encoder gives the right width

    no_pool = workflow("sd3")
    del no_pool["5"]["inputs"]["pool"]
    assert "pool" in _node_error(comfy, no_pool)

    entry = comfy.wait(comfy.queue(workflow("sd3")))
    assert entry["status"]["status_str"] == "success"
    assert (saved_latent(comfy, entry) - reference(tiny_model_dirs["sd3"], "sd3")).abs().max() <= TOLERANCE


def test_xdit_lora_node_applies_a_lora_like_diffusers_fused(comfy, tiny_model_dirs):
    from test_lora import fused_reference, peft_lora

    lora = peft_lora(comfy.work / "models" / "loras" / "xdit_test_lora.safetensors", 3)
    prompt = workflow("flux", prefix="lora")
    prompt["8"] = {"class_type": "XDiTLoRA", "inputs": {"pool": ["1", 0], "lora_name": "xdit_test_lora.safetensors",
                                                         "strength": 0.8}}
    prompt["5"]["inputs"]["pool"] = ["8", 0]
    entry = comfy.wait(comfy.queue(prompt))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]

    pipeline = DiffusionPipeline.from_pretrained(tiny_model_dirs["flux"])
    with torch.no_grad():
        embeds, pooled, _ = pipeline.encode_prompt("a cat on a mat", None)
    noise = torch.randn((1, 16, 8, 8), generator=torch.manual_seed(7))
    inputs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled,
              "latents": pipeline._pack_latents(noise, 1, 16, 8, 8)}
    expected = pipeline._unpack_latents(fused_reference(tiny_model_dirs["flux"], inputs, [(lora, 0.8)]), 64, 64, 8)
    expected = expected / FAMILIES["flux"][2] + FAMILIES["flux"][3]
    assert (saved_latent(comfy, entry) - expected).abs().max().item() <= TOLERANCE


def test_xdit_cache_node_samples_like_diffusers_with_the_same_hook(comfy, tiny_model_dirs):
    """xDiT Cache (first-block) chained onto a Ulysses-2 pool equals diffusers' FirstBlockCacheConfig in one
    process, differs from the uncached result, and the job's full and cached calls reach ComfyUI's log."""
    from diffusers.hooks import FirstBlockCacheConfig

    prompt = workflow("flux", steps=20, prefix="cache")
    prompt["8"] = {"class_type": "XDiTCache", "inputs": {"pool": ["1", 0], "method": "first-block", "threshold": 0.42,
                                                          "interval": 5, "warmup": 3, "order": 1}}
    prompt["5"]["inputs"]["pool"] = ["8", 0]
    entry = comfy.wait(comfy.queue(prompt))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latent = saved_latent(comfy, entry)
    expected = reference(tiny_model_dirs["flux"], "flux", steps=20, cache=FirstBlockCacheConfig(threshold=0.42))
    assert (latent - expected).abs().max().item() <= TOLERANCE
    assert (latent - reference(tiny_model_dirs["flux"], "flux", steps=20)).abs().max().item() > 100 * TOLERANCE
    assert "xDiT Sampler: first-block cache (threshold 0.42):" in comfy.log.read_text()
