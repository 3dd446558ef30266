"""Loading a diffusers pipeline folder for sampling, and the scheduler choices a user can make."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from ..pipeline_transformers import TRANSFORMERS
from . import vl_processors
from .checkpoints import CHECKPOINT_SUFFIXES
from .checkpoints.fp8 import Fp8Linear

SCHEDULERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "dpmsolver": DPMSolverMultistepScheduler,
    "unipc": UniPCMultistepScheduler,
}
FLOW_SCHEDULERS = {"flow-euler": FlowMatchEulerDiscreteScheduler, "flow-dpmsolver": DPMSolverMultistepScheduler,
                   "flow-unipc": UniPCMultistepScheduler}
MODULAR_INDEX = "modular_model_index.json"  # a diffusers ModularPipeline's folder (no model_index.json)
WEIGHTED_TEXT_PARTS = ("text_encoder", "tokenizer")  # a pipeline folder loads these only with text encoders
TEXT_PARTS = (*WEIGHTED_TEXT_PARTS, "processor")  # a modular folder loads these only with text encoders
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
FP8_STORAGE = torch.float8_e4m3fn  # "fp8": weights stored in fp8, each layer computing in bf16


def load_pipeline(model_dir: str | Path, *, text_encoders: bool = False, dtype: str | None = None,
                  shard_weights: bool = False, offload: bool = False, vae: str | Path | None = None) -> DiffusionPipeline:
    """Load a `save_pretrained` folder (text encoders and tokenizers only when asked for), or a single-file
    transformer checkpoint with the pack's shipped configs (parallel/loading/checkpoints) and, where given, the VAE
    file beside it (`vae`); `shard_weights` splits the transformer blocks over the ranks of the world
    (weight_sharding.py), `offload` keeps the shards in CPU memory."""
    if shard_weights and dtype == "fp8":
        raise ValueError("--shard-weights does not work with --dtype fp8 (its per-layer casting rewrites the weights "
                         "that FSDP holds in shards); use bf16 or fp16 with --shard-weights")
    model_dir = Path(model_dir)
    if model_dir.suffix.lower() == ".gguf" and (shard_weights or dtype == "fp8"):
        raise ValueError(f"{model_dir.name} is GGUF-quantized: its blocks are not plain tensors that "
                         + ("FSDP can shard; run it without --shard-weights" if shard_weights else
                            "fp8 storage can recast; drop --dtype fp8 (choose bf16, fp16 or fp32 compute)"))
    if model_dir.is_file() or model_dir.suffix.lower() in CHECKPOINT_SUFFIXES:
        return _load_single_file(model_dir, text_encoders, dtype, shard_weights, offload, vae)
    if vae:
        raise ValueError(f"--vae {Path(vae).name} goes with a single-file checkpoint; {model_dir.name} is a pipeline "
                         "folder with its own VAE: drop --vae")
    index = model_dir / "model_index.json"
    if not model_dir.exists():
        raise FileNotFoundError(f"{model_dir} does not exist: give a diffusers pipeline folder or a single-file checkpoint")
    if not index.is_file() and (model_dir / MODULAR_INDEX).is_file():
        return _place(_load_modular(model_dir, text_encoders, dtype), dtype, shard_weights, offload)
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} is not a diffusers pipeline folder (no model_index.json, nor a modular "
                                f"pipeline's {MODULAR_INDEX})")
    components = json.loads(index.read_text())
    # Without text encoders their weights and tokenizers stay out; processors (no weights) load either way, since a
    # pipeline may build on its processor when given embeddings (Qwen-Image 2.1's chat template), for images only
    # where torchvision is missing. A part saved as none loads as none (diffusers refuses such a folder otherwise).
    skipped = {name: None for name, entry in components.items()
               if entry == [None, None] or (not text_encoders and name.startswith(WEIGHTED_TEXT_PARTS))}
    kwargs = {"torch_dtype": DTYPES[dtype]} if dtype else {}
    kwargs.update(vl_processors.stand_ins(model_dir, components))
    pipeline = DiffusionPipeline.from_pretrained(model_dir, **skipped, **kwargs)
    return _place(pipeline, dtype, shard_weights, offload)


def _load_modular(model_dir: Path, text_encoders: bool, dtype: str | None):
    """A modular pipeline folder (diffusers' `ModularPipeline`): its blocks and the components saved in the folder,
    text encoders and their processors only when asked for (processors for images only where torchvision is missing,
    vl_processors). A prompt upsampler (FLUX 3's, a second language model that rewrites prompts) stays none: the
    engine encodes prompts as given, and components its index lists without a source stay none too."""
    from diffusers import ModularPipeline

    components = json.loads((model_dir / MODULAR_INDEX).read_text())
    saved = [name for name, entry in components.items()
             if isinstance(entry, list) and entry[0] is not None and not name.startswith("prompt_upsampler")
             and (text_encoders or not name.startswith(TEXT_PARTS))]
    pipeline = ModularPipeline.from_pretrained(model_dir)
    stand_ins = vl_processors.stand_ins(model_dir, {name: components[name] for name in saved})
    pipeline.update_components(**stand_ins)
    pipeline.load_components(names=[name for name in saved if name not in stand_ins],
                             **({"torch_dtype": DTYPES[dtype]} if dtype else {}))
    return pipeline


def _load_single_file(path: Path, text_encoders: bool, dtype: str | None, shard_weights: bool,
                      offload: bool, vae: str | Path | None) -> DiffusionPipeline:
    if text_encoders:
        raise ValueError(f"{path.name} is a single-file transformer checkpoint: it has no text encoders. Start the "
                         "pool without text encoders and encode prompts in ComfyUI (CLIPTextEncode)")
    from .checkpoints.load import load_single_file_pipeline

    pipeline = load_single_file_pipeline(path, dtype=DTYPES[dtype] if dtype else None, keep_fp8=not shard_weights,
                                         vae=vae)
    return _place(pipeline, dtype, shard_weights, offload)


def _place(pipeline: DiffusionPipeline, dtype: str | None, shard_weights: bool, offload: bool) -> DiffusionPipeline:
    """On this rank's GPU if there is one; fp8 keeps every transformer's weights in fp8 between uses (Wan 2.2
    A14B's two experts, MiniMax-H3's `transformer_ref`)."""
    if torch.cuda.is_available():
        pipeline.to(f"cuda:{torch.cuda.current_device()}")
    if shard_weights:
        from .weight_sharding import shard_weights as shard

        shard(pipeline, offload)
    if dtype == "fp8" and not any(isinstance(m, Fp8Linear) for m in pipeline.transformer.modules()):  # else fp8 already
        for name in TRANSFORMERS:
            if getattr(pipeline, name, None) is not None:
                getattr(pipeline, name).enable_layerwise_casting(storage_dtype=FP8_STORAGE, compute_dtype=torch.bfloat16)
    return pipeline


def make_scheduler(default, name: str):
    """The scheduler called `name`, built from the pipeline's own (`default`) scheduler config."""
    if name == "default":
        return default
    flow = isinstance(default, FlowMatchEulerDiscreteScheduler) or default.config.get("use_flow_sigmas", False)
    allowed = ["default", *(FLOW_SCHEDULERS if flow else SCHEDULERS)]
    if name not in allowed:
        raise ValueError(f"scheduler {name!r} does not fit this {type(default).__name__} model; choose one of {allowed}")
    shift = default.config.get("flow_shift", default.config.get("shift", 1.0))  # Wan's UniPC spells it flow_shift
    if name == "flow-euler":
        return FlowMatchEulerDiscreteScheduler.from_config(default.config, shift=shift)
    if name in FLOW_SCHEDULERS:  # the multistep solvers on the model's flow-matching sigmas, shifted as its own
        return FLOW_SCHEDULERS[name].from_config(default.config, use_flow_sigmas=True, prediction_type="flow_prediction",
                                                 flow_shift=shift)
    return SCHEDULERS[name].from_config(default.config)


def set_scheduler(pipeline: DiffusionPipeline, name: str) -> None:
    """Swap in another diffusers scheduler built from the pipeline's own scheduler config."""
    pipeline.scheduler = make_scheduler(pipeline.scheduler, name)
