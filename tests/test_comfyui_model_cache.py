"""xDiT Cache (model) in a real ComfyUI: KSampler on xDiT Model with the pool's first-block cache equals
diffusers' own FBCache hook replayed in this process on the calls ComfyUI made.

The built-in tiny FLUX.1 on a Ulysses-2 pool (so the first-block metric is reduced over two ranks). A test node
(XDiTTestRecordCalls) saves each model call's inputs and the pool's output on ComfyUI's side; the reference runs
diffusers' FluxTransformer2DModel with `enable_cache(FirstBlockCacheConfig)` on those inputs in the same order
(packed by diffusers' own FluxPipeline helpers), and counts its decisions. Controls: the same KSampler without the
cache differs; a sampling run after another one (another seed) starts from a reset cache, so it equals the first.
A model without diffusers' cache hooks (the tiny SD3) and ComfyUI's own model are refused by the node.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from parallel.loading.builtin_models import builtin_model_dir
from test_comfyui import saved_latent
from test_comfyui_model import save_checkpoint
from xdit_test_helpers import TOLERANCE

STEPS, SIZE, SEED, OTHER_SEED, THRESHOLD = 8, 64, 11, 12, 0.43
INTERVAL, WARMUP = 3, 2  # taylorseer
FLUX = "xdit-tiny-flux"


def _graph(runs: dict[str, bool], seed: int = SEED, family: str = "flux", method: str = "first-block") -> dict:
    """KSampler per run name on xDiT Model, through the cache where runs[name] (each with its own recorder)."""
    prompt = {
        "pool": {"class_type": "XDiTPool", "inputs": {
            "model": f"xdit-tiny-{family} (built-in, no download)", "nproc": 2, "ulysses_degree": 2, "ring_degree": 1,
            "pipefusion_degree": 1, "num_patches": 0, "warmup_steps": 1, "cfg_parallel": False, "dp_degree": 1,
            "text_encoders": True, "dtype": "auto", "devices": "", "threads_per_rank": 1, "endpoint": ""}},
        "pos": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": "a red fox in snow"}},
        "neg": {"class_type": "XDiTTextEncode", "inputs": {"pool": ["pool", 0], "text": "blurry"}},
        "latent": {"class_type": "EmptySD3LatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "model": {"class_type": "XDiTModel", "inputs": {"pool": ["pool", 0]}},
        "cache": {"class_type": "XDiTModelCache", "inputs": {"model": ["model", 0], "method": method,
                  "threshold": THRESHOLD, "interval": INTERVAL, "warmup": WARMUP, "order": 1}},
    }
    for name, cached in runs.items():
        prompt[f"rec-{name}"] = {"class_type": "XDiTTestRecordCalls",
                                 "inputs": {"model": ["cache" if cached else "model", 0], "name": name}}
        prompt[name] = {"class_type": "KSampler", "inputs": {
            "model": [f"rec-{name}", 0], "seed": seed, "steps": STEPS, "cfg": 1.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["latent", 0],
            "denoise": 1.0}}
        prompt[f"save-{name}"] = {"class_type": "SaveLatent", "inputs": {"samples": [name, 0], "filename_prefix": name}}
    return prompt


def _finished(comfy, prompt: dict) -> dict:
    return comfy.wait(comfy.queue(prompt), 600)


def _run(comfy, prompt: dict) -> tuple[dict, dict]:
    """The prompt's latents by run name, and the pool's step cache report after it (its last run's counts)."""
    entry = _finished(comfy, prompt)
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"])[-2000:]
    latents = {node.removeprefix("save-"): saved_latent(comfy, entry, node) for node in entry["outputs"]}
    pool = next(row for row in comfy.get("/xdit/pools")["pools"] if row["status"].get("pipeline") == "FluxPipeline")
    return latents, pool["status"]["last_cache"]


def _calls(comfy, name: str) -> list[dict[str, torch.Tensor]]:
    saved = load_file(comfy.work / "output" / f"{name}.safetensors")
    calls = [{} for _ in range(len({key.split(".")[0] for key in saved}))]
    for key, value in saved.items():
        index, name = key.split(".", 1)
        calls[int(index)][name] = value
    return calls


def _replay(calls: list[dict], method: str | None = "first-block") -> tuple[list[torch.Tensor], list[bool]]:
    """diffusers' FLUX.1 transformer on the recorded calls in order, with its own cache hook for `method` (None:
    none): its outputs (packed) and decisions."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK
    from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

    transformer = FluxTransformer2DModel.from_pretrained(builtin_model_dir(FLUX) / "transformer",
                                                         torch_dtype=torch.float32).eval()
    decisions = []
    if method == "first-block":
        transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
        hook = transformer.transformer_blocks[0]._diffusers_hook.get_hook(_FBC_LEADER_BLOCK_HOOK)
        decide = hook._should_compute_remaining_blocks
        hook._should_compute_remaining_blocks = lambda residual: decisions.append(decide(residual)) or decisions[-1]
    elif method == "taylorseer":
        transformer.enable_cache(TaylorSeerCacheConfig(cache_interval=INTERVAL, disable_cache_before_step=WARMUP,
                                                       max_order=1, taylor_factors_dtype=None))
        hook = next(m._diffusers_hook.get_hook(_TAYLORSEER_CACHE_HOOK) for m in transformer.modules()
                    if getattr(m, "_diffusers_hook", None) and m._diffusers_hook.get_hook(_TAYLORSEER_CACHE_HOOK))
        measure = hook._measure_should_compute
        hook._measure_should_compute = lambda: (lambda out: decisions.append(out[0]) or out)(measure())
    outputs = []
    with torch.no_grad(), transformer.cache_context("default"):
        for call in calls:
            b, c, h, w = call["x"].shape
            guidance = call.get("guidance") if transformer.config.guidance_embeds else None
            outputs.append(transformer(
                hidden_states=FluxPipeline._pack_latents(call["x"], b, c, h, w), timestep=call["t"],
                guidance=None if guidance is None else guidance.reshape(-1).expand(b),
                pooled_projections=call["y"], encoder_hidden_states=call["context"],
                txt_ids=torch.zeros(call["context"].shape[1], 3),
                img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
                return_dict=False)[0])
    return outputs, decisions


def _packed(output: torch.Tensor) -> torch.Tensor:
    from diffusers import FluxPipeline

    return FluxPipeline._pack_latents(output, *output.shape)


def test_ksampler_with_the_pools_first_block_cache_equals_diffusers_hook_replayed(comfy):
    first, report = _run(comfy, _graph({"cached": True, "off": False}))
    calls = _calls(comfy, "cached")
    assert len(calls) == STEPS  # cfg 1: one call per step
    replayed, decisions = _replay(calls)
    errors = [(_packed(call["out"]) - output).abs().max().item() for call, output in zip(calls, replayed)]
    assert max(errors) <= TOLERANCE, errors
    full = sum(decisions)
    assert 0 < STEPS - full < STEPS - 1, decisions  # some calls came from the cache, not all
    assert report["method"] == "first-block" and (report["full"], report["cached"]) == (full, STEPS - full), report
    # negative controls: without the cache the result differs, and so does the uncached replay of the same calls
    assert (first["cached"] - first["off"]).abs().max().item() > 1e-2
    uncached, _ = _replay(calls, None)
    assert max((_packed(c["out"]) - o).abs().max().item() for c, o in zip(calls, uncached)) > 1e-2

    _run(comfy, _graph({"other": True}, seed=OTHER_SEED))  # leaves the pool's cache state of another run
    again, report_again = _run(comfy, _graph({"cached": True}))
    assert (again["cached"] - first["cached"]).abs().max().item() <= 1e-6  # started from a reset cache
    assert report_again == report


def test_taylorseer_on_the_pool_equals_diffusers_hook_replayed(comfy):
    _, report = _run(comfy, _graph({"taylor": True}, method="taylorseer"))
    calls = _calls(comfy, "taylor")
    replayed, decisions = _replay(calls, "taylorseer")
    assert max((_packed(call["out"]) - output).abs().max().item() for call, output in zip(calls, replayed)) <= TOLERANCE
    assert 0 < STEPS - sum(decisions) < STEPS and len(decisions) == STEPS, decisions
    assert report["method"] == "taylorseer" and (report["full"], report["cached"]) == (sum(decisions), STEPS - sum(decisions))


def _error(comfy, prompt: dict) -> str:
    entry = _finished(comfy, prompt)
    assert entry["status"]["status_str"] == "error"
    return next(m[1] for m in entry["status"]["messages"] if m[0] == "execution_error")["exception_message"]


def test_the_model_cache_node_refuses_models_without_hooks_and_comfyuis_own_model(comfy):
    message = _error(comfy, _graph({"sd3": True}, family="sd3"))
    assert "first-block" in message and "no cache hooks for SD3Transformer2DModel (no CacheMixin)" in message, message
    prompt = _graph({"stock": True})
    prompt["model"] = {"class_type": "UNETLoader", "inputs": {"unet_name": f"{save_checkpoint(comfy.work)}.safetensors",
                                                              "weight_dtype": "default"}}
    assert "EasyCache" in _error(comfy, prompt)
