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
)

SCHEDULERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "dpmsolver": DPMSolverMultistepScheduler,
    "flow-euler": FlowMatchEulerDiscreteScheduler,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_pipeline(model_dir: str | Path, *, text_encoders: bool = False, dtype: str | None = None) -> DiffusionPipeline:
    """Load a `save_pretrained` folder; text encoders and tokenizers only when asked for."""
    model_dir = Path(model_dir)
    index = model_dir / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} is not a diffusers pipeline folder (no model_index.json)")
    components = json.loads(index.read_text())
    skipped = {} if text_encoders else {
        name: None for name in components if name.startswith(("text_encoder", "tokenizer"))
    }
    kwargs = {"torch_dtype": DTYPES[dtype]} if dtype else {}
    pipeline = DiffusionPipeline.from_pretrained(model_dir, **skipped, **kwargs)
    if torch.cuda.is_available():
        pipeline.to(f"cuda:{torch.cuda.current_device()}")
    return pipeline


def make_scheduler(default, name: str):
    """The scheduler called `name`, built from the pipeline's own (`default`) scheduler config."""
    if name == "default":
        return default
    flow = isinstance(default, FlowMatchEulerDiscreteScheduler) or default.config.get("use_flow_sigmas", False)
    allowed = ["default", "flow-euler"] if flow else ["default", "ddim", "euler", "dpmsolver"]
    if name not in allowed:
        raise ValueError(f"scheduler {name!r} does not fit this {type(default).__name__} model; choose one of {allowed}")
    if name == "flow-euler" and "flow_shift" in default.config:  # Wan's UniPC: the same shift, as FlowMatch spells it
        return FlowMatchEulerDiscreteScheduler.from_config(default.config, shift=default.config["flow_shift"])
    return SCHEDULERS[name].from_config(default.config)


def set_scheduler(pipeline: DiffusionPipeline, name: str) -> None:
    """Swap in another diffusers scheduler built from the pipeline's own scheduler config."""
    pipeline.scheduler = make_scheduler(pipeline.scheduler, name)
