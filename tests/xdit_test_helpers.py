"""Constants and launchers shared by the test modules (imported as a top-level module by pytest)."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

from parallel.cli.launch import ROOT, rank_environment, torchrun_command

TOLERANCE = 1e-4


@contextmanager
def one_rank(config):
    """This process as a world of one gloo rank under `config` (in-process tests of the engine's wrappers)."""
    import os

    from parallel.distributed import destroy_distributed_environment, initialize_model_parallel
    from workers.wire.endpoints import free_port

    saved = {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})
    try:
        initialize_model_parallel(config)
        yield
    finally:
        destroy_distributed_environment()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` from the repo root with one thread per rank."""
    return subprocess.run(torchrun_command(nproc, *args), cwd=ROOT, env=rank_environment(), capture_output=True,
                          text=True, timeout=timeout)



def run_engine_cases(nproc: int, specs: list[dict], work) -> None:
    """One torchrun launch of `nproc` ranks running every case of `specs` (tests/engine_cases.py); fails the test if
    the launch does (a case's own failure is in its error files: case_errors)."""
    import json
    from pathlib import Path

    spec_file = Path(work) / f"cases{nproc}.json"
    spec_file.write_text(json.dumps(specs))
    run = torchrun(nproc, "tests/engine_cases.py", str(spec_file))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

def flux_file_on_two_ranks(model, inputs, output, *layout: str):
    """Contract E on 2 ranks for the quantized tiny-Flux file tests: fp32 compute, 4 steps at 64², guidance 3.5,
    the `layout` flags; the latents it wrote."""
    from safetensors.torch import load_file

    run = torchrun(2, "-m", "parallel.run", "--model", str(model), "--inputs", str(inputs), "--output", str(output),
                   "--dtype", "fp32", "--steps", "4", "--guidance-scale", "3.5", "--height", "64", "--width", "64",
                   *layout)
    assert run.returncode == 0, run.stderr[-3000:]
    return load_file(output)["latents"]


def case_errors(output) -> str:
    """Every rank's traceback for a failed case of tests/engine_cases.py (and the runners built on it): rank 0's in
    output + ".error", rank N's in output + ".error.rankN" (step caches: ".error.rank0" too); "" when none failed.
    A rank other than 0 can fail alone, so reading rank 0's file only would miss it."""
    from pathlib import Path

    output = Path(output)
    files = [output.parent / f"{output.name}.error", *output.parent.glob(f"{output.name}.error.rank*")]
    found = sorted((f for f in files if f.is_file()), key=lambda f: (len(f.name), f.name))
    return "\n".join(f"--- {f.name}\n{f.read_text()}" for f in found)


def diffusers_latents(model, family: str | None = None, *, scheduler: str | None = None, all_outputs: bool = False,
                      **call):
    """The reference every test compares with: diffusers' own pipeline in this one process (`model`: a saved
    folder or a loaded pipeline), under no_grad as the pipeline runs itself, returning `output_type="latent"`,
    with the tiny `family`'s call defaults (tiny_models.PIPELINE_CALL_DEFAULTS) and `scheduler` if given. A batch
    for a pipeline that takes one prompt per call (Qwen-Image-Edit Plus) is its samples one by one. `all_outputs`:
    everything the pipeline returns (LTX-2: video and audio latents), not the latents alone."""
    import torch
    from diffusers import DiffusionPipeline

    from parallel.loading import tiny_models
    from parallel.loading.pipelines import set_scheduler

    if is_modular(model):
        return modular_latents(model, scheduler=scheduler, **call)
    pipeline = model if isinstance(model, DiffusionPipeline) else load_pipeline_folder(model)
    batch = call["latents"].shape[0] if isinstance(call.get("latents"), torch.Tensor) else 1
    if type(pipeline).__name__ == "QwenImageEditPlusPipeline" and batch > 1:  # it takes one prompt per call
        return torch.cat([diffusers_latents(pipeline, family, scheduler=scheduler, **{
            name: value[i : i + 1] if torch.is_tensor(value) and name != "image" and value.shape[0] == batch else value
            for name, value in call.items()}) for i in range(batch)])
    if scheduler:
        set_scheduler(pipeline, scheduler)
    with torch.no_grad():
        output = pipeline(**tiny_models.PIPELINE_CALL_DEFAULTS.get(family, {}), **at_requested_size(pipeline, call),
                          output_type="latent", return_dict=False)
    return output if all_outputs else output[0]


def is_modular(model) -> bool:
    """A diffusers ModularPipeline, or its saved folder (modular_model_index.json, no model_index.json)."""
    from pathlib import Path

    if hasattr(model, "load_components"):
        return True
    if not isinstance(model, (str, Path)):
        return False
    return (Path(model) / "modular_model_index.json").is_file() and not (Path(model) / "model_index.json").is_file()


def modular_latents(model, *, scheduler: str | None = None, blocks: tuple[str, ...] = ("denoise",),
                    outputs: tuple[str, ...] = ("latents",), **call):
    """diffusers' own modular pipeline in this one process, as its documentation composes one: the blocks that
    sample from embeddings (`blocks`: FLUX 3's "denoise", with "vae_encoder" first for reference images) made a
    pipeline of their own (`init_pipeline`) on the loaded pipeline's components, its guider a copy at the call's
    guidance_scale (`guider.new`); returns the state's `latents` (several `outputs`: a tuple of those values)."""
    import torch
    from diffusers import ModularPipeline
    from diffusers.modular_pipelines import SequentialPipelineBlocks

    from parallel.loading.pipelines import set_scheduler

    if isinstance(model, ModularPipeline):
        loaded = model
    else:
        loaded = ModularPipeline.from_pretrained(model)
        loaded.load_components(names=["transformer", "vae"])
    parts = loaded.blocks.sub_blocks
    pipeline = SequentialPipelineBlocks.from_blocks_dict({name: parts[name] for name in blocks}).init_pipeline()
    pipeline.update_components(**{name: part for name, part in loaded.components.items()
                                  if name in pipeline.component_names and part is not None})
    guidance = call.pop("guidance_scale", None)
    if getattr(pipeline, "guider", None) is not None and guidance is not None:
        pipeline.update_components(guider=pipeline.guider.new(guidance_scale=guidance))
    if scheduler:
        set_scheduler(pipeline, scheduler)
    call.pop("output_type", None), call.pop("return_dict", None)
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        state = pipeline(**call, output=list(outputs))
    return state[outputs[0]] if len(outputs) == 1 else tuple(state[name] for name in outputs)


def modular_text_encoding(pipeline, prompt: str):
    """A modular pipeline's own text encoder block (FLUX 3: chat template, padding to a multiple of 80 tokens, the
    stacked hidden layers) run as a pipeline of its own on the loaded text encoder: `prompt_embeds`."""
    import torch

    encoder = pipeline.blocks.sub_blocks["text_encoder"].init_pipeline()
    encoder.update_components(text_encoder=pipeline.text_encoder, tokenizer=pipeline.tokenizer)
    with torch.no_grad():
        return encoder(prompt=prompt, output="prompt_embeds")


def diffusers_with_reference_latents(model, family: str, references, **call):
    """diffusers_latents of a Qwen-Image-Edit pipeline whose references are given as model-space latents
    [N, 16, h, w] (ComfyUI's ReferenceLatent), which diffusers' pipelines cannot take: its VAE "encodes" stand-in
    pictures of their size to them in the VAE's own space (the pipeline normalises them itself) and its sizing
    keeps that size instead of ~1024²."""
    import sys
    import types
    from unittest import mock

    import PIL.Image
    import torch

    pipeline = load_pipeline_folder(model)
    config = pipeline.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    encoded = iter((references.unsqueeze(2) * std + mean).split(1))
    size = (references.shape[3] * pipeline.vae_scale_factor, references.shape[2] * pipeline.vae_scale_factor)
    module = sys.modules[type(pipeline).__module__]
    sizing = module.calculate_dimensions

    def reference_size(area, ratio):
        out = sizing(area, ratio)
        return (*size, *out[2:]) if area == 1024 * 1024 else out

    def encode(image, *args, **kwargs):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: next(encoded).to(image)))

    stand_ins = [PIL.Image.new("RGB", size)] * references.shape[0]
    image = stand_ins if "Plus" in type(pipeline).__name__ else stand_ins[0]
    with mock.patch.object(module, "calculate_dimensions", reference_size), mock.patch.object(pipeline.vae, "encode", encode):
        return diffusers_latents(pipeline, family, image=image, **call)


def load_pipeline_folder(model, torch_dtype=None):
    """DiffusionPipeline.from_pretrained (a modular folder: ModularPipeline's, every saved part loaded), with the
    parts a folder saved as none given as none, as diffusers wants them, and a Qwen2-VL processor (Qwen-Image-Edit's) for images only where torchvision is missing (transformers'
    class without its video half: parallel/loading/vl_processors.py)."""
    import json
    from pathlib import Path

    from diffusers import DiffusionPipeline

    from parallel.loading import vl_processors

    if is_modular(model):  # diffusers' ModularPipeline with every component its folder holds
        from diffusers import ModularPipeline

        index = json.loads((Path(model) / "modular_model_index.json").read_text())
        pipeline = ModularPipeline.from_pretrained(model)
        stand_ins = vl_processors.stand_ins(Path(model), index)
        pipeline.update_components(**stand_ins)
        pipeline.load_components(names=[name for name, entry in index.items() if isinstance(entry, list)
                                        and entry[0] is not None and name not in stand_ins],
                                 **({"torch_dtype": torch_dtype} if torch_dtype else {}))
        return pipeline
    index = json.loads((Path(model) / "model_index.json").read_text())
    return DiffusionPipeline.from_pretrained(model, **{name: None for name, entry in index.items() if entry == [None, None]},
                                             **({"torch_dtype": torch_dtype} if torch_dtype else {}),
                                             **vl_processors.stand_ins(Path(model), index))


def at_requested_size(pipeline, call: dict) -> dict:
    """`call` with max_area = height·width for pipelines that resize to an area (FLUX.1 Kontext: 1024² by
    default), so diffusers samples at the size the engine honours exactly; embeddings [B, tokens, width] as
    lists of samples where the pipeline takes lists (Z-Image); reference images [N, 3, H, W] in [0, 1] as the
    8-bit PIL images the Qwen-Image-Edit pipelines take (Edit: one, Plus: a list); no guidance_scale nor max_sequence_length
    where the pipeline takes none."""
    import inspect

    import PIL.Image
    import torch

    name = type(pipeline).__name__
    if name.startswith("QwenImageEdit") and isinstance(call.get("image"), torch.Tensor):
        pixels = (call["image"] * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
        images = [PIL.Image.fromarray(picture) for picture in pixels]
        call = {**call, "image": images if "Plus" in name else images[0]}
    parameters = inspect.signature(pipeline.__call__).parameters
    for name in ("guidance_scale", "max_sequence_length"):  # Qwen-Image 2.1 takes neither (the engine drops the first)
        if name not in parameters:
            call = {key: value for key, value in call.items() if key != name}
    for name in ("prompt_embeds", "negative_prompt_embeds"):
        if name in parameters and str(parameters[name].annotation).startswith("list") and hasattr(call.get(name), "unbind"):
            call = {**call, name: list(call[name].unbind(0))}
    if "max_area" in parameters and call.get("height") and call.get("width"):
        return {"max_area": call["height"] * call["width"], **call}
    return call


PACK_UNDER_TEST = "xdit_pack_under_test"


def import_node_module(monkeypatch, name: str, stand_ins: dict | None = None):
    """Import `nodes/<name>.py` as ComfyUI does, as a submodule of the pack (so its `..parallel` imports
    resolve), without running the pack's or nodes/'s __init__.py (which register on a ComfyUI server).
    `stand_ins` maps module names (folder_paths, comfy_api.latest, ...) to stand-in modules."""
    import importlib
    import types

    pack, nodes = types.ModuleType(PACK_UNDER_TEST), types.ModuleType(f"{PACK_UNDER_TEST}.nodes")
    pack.__path__, nodes.__path__ = [str(ROOT)], [str(ROOT / "nodes")]
    for module_name, module in {**(stand_ins or {}), PACK_UNDER_TEST: pack, nodes.__name__: nodes}.items():
        monkeypatch.setitem(sys.modules, module_name, module)
    for loaded in [n for n in sys.modules if n.startswith(f"{PACK_UNDER_TEST}.") and n != nodes.__name__]:
        monkeypatch.delitem(sys.modules, loaded)
    return importlib.import_module(f"{nodes.__name__}.{name}")
