"""xDiT Pool: choose a model and a parallel layout; start (or reuse, or reach) a worker pool.

The layout inputs are ParallelConfig's own declarations (parallel/layout/config.py: each field's widget), read back into
a ParallelConfig by `layout_of`, so the node, the pool CLI and contract E take the same layout and one check
(`layout_error`, also asked by the panel through nodes/routes.py) judges it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import folder_paths
from comfy_api.latest import io

from ..parallel.loading.builtin_models import is_pipeline_folder
from ..parallel.loading.checkpoints import CHECKPOINT_SUFFIXES, checkpoint_variant
from ..parallel.layout.config import AutoLayout, LayoutError, ParallelConfig
from ..parallel.fields import UNSET, fields_of
from ..workers.supervisor import PoolSpec

from .pools import POOLS, TINY_MODELS, TINY_PREFIX, tiny_model_dir

XDiTPoolType = io.Custom("XDIT_POOL")
FILE_PREFIX = "file: "
# ComfyUI's model folders that hold single-file transformers; diffusion_models also covers models/unet.
CHECKPOINT_FOLDERS = ("diffusion_models", "checkpoints")
NO_VAE = "none"
MANUAL, AUTO = "degrees", "auto"


def diffusers_models() -> list[str]:
    """Pipeline folders (with model_index.json, or a modular pipeline's index) under ComfyUI's models/diffusers, plus
    the tiny ones."""
    found = []
    for root in folder_paths.get_folder_paths("diffusers"):
        if os.path.isdir(root):
            for name in sorted(os.listdir(root)):
                if is_pipeline_folder(Path(root, name)):
                    found.append(name)
    return found + single_file_models() + TINY_MODELS


def single_file_models() -> list[str]:
    """Supported single-file transformer checkpoints (Flux.1, SD3/3.5, PixArt; GGUF too) in ComfyUI's model folders."""
    found, seen = [], set()
    for folder in CHECKPOINT_FOLDERS:
        for name in folder_paths.get_filename_list(folder) + _gguf_files(folder):
            path = folder_paths.get_full_path(folder, name)
            if path and name.lower().endswith(CHECKPOINT_SUFFIXES) and os.path.realpath(path) not in seen \
                    and checkpoint_variant(path):
                seen.add(os.path.realpath(path))
                found.append(f"{FILE_PREFIX}{folder}/{name}")
    return found


def _gguf_files(folder: str) -> list[str]:
    """GGUF files in a model folder (city96's layout): ComfyUI lists only its own extensions there."""
    names = []
    for root in folder_paths.get_folder_paths(folder):
        for directory, _, files in os.walk(root, followlinks=True):
            names += [os.path.relpath(os.path.join(directory, f), root) for f in files if f.lower().endswith(".gguf")]
    return sorted(names)


def model_path(choice: str) -> str:
    if choice.startswith(TINY_PREFIX):
        return str(tiny_model_dir(choice))
    if choice.startswith(FILE_PREFIX):
        folder, _, name = choice.removeprefix(FILE_PREFIX).partition("/")
        path = folder_paths.get_full_path(folder, name) if folder in CHECKPOINT_FOLDERS else None
        if path is None:
            raise ValueError(f"model {choice!r}: no file {name!r} in ComfyUI's models/{folder} folders")
        return path
    for root in folder_paths.get_folder_paths("diffusers"):
        if is_pipeline_folder(Path(root, choice)):
            return os.path.join(root, choice)
    raise ValueError(f"model {choice!r} is not a diffusers folder under models/diffusers")


def vae_files() -> list[str]:
    """"none" and the VAE files in ComfyUI's models/vae, for a single-file model's VAE."""
    return [NO_VAE] + [name for name in folder_paths.get_filename_list("vae") if name.lower().endswith(CHECKPOINT_SUFFIXES)]


def vae_path(kwargs) -> str | None:
    """The chosen VAE file's path, for a single-file model; None for "none"."""
    choice = kwargs.get("vae") or NO_VAE
    if choice == NO_VAE:
        return None
    if not kwargs["model"].startswith(FILE_PREFIX):
        raise ValueError(f"vae {choice!r} goes with a single-file model (file: ...); {kwargs['model']} has its own "
                         "VAE: set vae to none")
    path = folder_paths.get_full_path("vae", choice)
    if path is None:
        raise ValueError(f"vae {choice!r}: no such file in ComfyUI's models/vae folders")
    return path


# Saved workflows keep widget values by position: these layout inputs stay right after nproc, in this order, and
# these after curve_dir; every other ParallelConfig field is an optional input after `layout`, in declaration order
# (a new field appends there, so saved workflows keep loading).
FIRST_LAYOUT_INPUTS = ("ulysses_degree", "ring_degree", "pipefusion_degree", "num_patches", "warmup_steps", "cfg_degree",
                       "dp_degree")
LATER_LAYOUT_INPUTS = ("shard_weights", "offload", "compile")


def layout_inputs(names=None, optional: bool = False) -> list:
    """The inputs of ParallelConfig's fields `names` (None: those in neither list above), from their widgets."""
    chosen = [f for f in fields_of(ParallelConfig) if f.rule.widget is not None
              and (f.name in names if names is not None else f.name not in FIRST_LAYOUT_INPUTS + LATER_LAYOUT_INPUTS)]
    if names is not None:
        chosen.sort(key=lambda f: names.index(f.name))
    inputs = []
    for f in chosen:
        widget = f.rule.widget
        name, default = widget.name or f.name, f.default if widget.default is UNSET else widget.default
        if widget.choices is not None:
            inputs.append(io.Combo.Input(name, options=list(widget.choices), default=next(iter(widget.choices)),
                                         optional=optional, tooltip=widget.tooltip))
        elif isinstance(default, bool):
            inputs.append(io.Boolean.Input(name, default=default, optional=optional, tooltip=widget.tooltip))
        else:
            inputs.append(io.Int.Input(name, default=default, min=widget.minimum, max=widget.maximum or 256,
                                       optional=optional, tooltip=widget.tooltip))
    return inputs


def _auto(kwargs) -> bool:
    return kwargs.get("layout", MANUAL) == AUTO


def layout_of(kwargs) -> ParallelConfig:
    """The layout the node's inputs set; with layout auto the degrees stay 1 (the pool chooses them per job size)."""
    values = {}
    for f in fields_of(ParallelConfig):
        widget = f.rule.widget
        if widget is None:  # derived by the ranks (for_world), never set by a user
            continue
        name = widget.name or f.name
        if name not in kwargs or (_auto(kwargs) and (f.name.endswith("_degree") or f.name == "num_patches")):
            continue
        value = kwargs[name]
        if widget.choices is not None:
            value = widget.choices[value]
        elif widget.on is not UNSET:
            value = widget.on if value else f.default
        elif widget.unset is not UNSET and value == widget.unset:
            value = None
        values[f.name] = value
    return ParallelConfig(**values)


def layout_error(kwargs) -> str:
    """What is wrong with the node's layout for its nproc, as one sentence with the numbers and the fix; "" if
    nothing (a pool at an endpoint has its own layout)."""
    if str(kwargs.get("endpoint", "")).strip():
        return ""
    try:
        config, nproc = layout_of(kwargs), int(kwargs["nproc"])
        (replace(config, dp_degree=nproc) if _auto(kwargs) else config).check(nproc, ranks_flag="nproc")
    except (LayoutError, KeyError, TypeError, ValueError) as error:
        return str(error)
    return ""


def pool_key(kwargs, resolve_model: bool = True) -> PoolSpec:
    endpoint = kwargs.get("endpoint", "").strip()
    return PoolSpec(
        model=model_path(kwargs["model"]) if resolve_model and not endpoint else kwargs["model"],
        vae=vae_path(kwargs) if resolve_model and not endpoint else None,
        nproc=kwargs["nproc"], parallel=layout_of(kwargs), endpoint=endpoint or None,
        # a single-file checkpoint is the transformer alone: prompts are encoded in ComfyUI
        text_encoders=kwargs["text_encoders"] and not kwargs["model"].startswith(FILE_PREFIX),
        dtype=None if kwargs["dtype"] == "auto" else kwargs["dtype"],
        devices=kwargs["devices"].strip() or None, threads_per_rank=kwargs["threads_per_rank"] or None,
        curve_dir=(kwargs.get("curve_dir") or "").strip() or None if endpoint else None,
        auto=AutoLayout() if _auto(kwargs) and not endpoint else None,
    )


class XDiTPool(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTPool",
            display_name="xDiT Pool",
            category="sampling/xDiT",
            description="A persistent pool of ranks holding a diffusers DiT model, sampling in parallel.",
            inputs=[
                io.Combo.Input("model", options=diffusers_models(),
                               tooltip="A diffusers pipeline folder under models/diffusers, a single-file transformer "
                                       "checkpoint (file: Flux.1 dev/schnell, SD3 medium, SD3.5 medium/large, PixArt-α/Σ "
                                       "1024; its prompts are encoded with ComfyUI's CLIPTextEncode), or a built-in tiny model."),
                io.Int.Input("nproc", default=2, min=1, max=256, tooltip="Number of ranks (one per GPU)."),
                *layout_inputs(FIRST_LAYOUT_INPUTS),
                io.Boolean.Input("text_encoders", default=True, tooltip="Load the text encoders on rank 0 for xDiT Text Encode."),
                io.Combo.Input("dtype", options=["auto", "fp32", "bf16", "fp16", "fp8"], default="auto",
                               tooltip="Weights' dtype (auto: as saved; fp8: fp8 storage with bf16 compute)."),
                io.String.Input("devices", default="", tooltip="CUDA devices for the ranks, e.g. 0,1,2,3 (empty: all)."),
                io.Int.Input("threads_per_rank", default=0, min=0, max=256, tooltip="CPU threads per rank (0: PyTorch's default)."),
                io.String.Input("endpoint", default="", tooltip="Use a pool started with `python -m workers serve` at this endpoint instead."),
                io.String.Input("curve_dir", default="", optional=True,
                                tooltip="With endpoint, for a pool served with --curve-dir: a folder holding its server.key and "
                                        "an allowed client.key_secret (from `python -m workers keys`). Empty: your own keys "
                                        "($XDIT_CURVE_DIR, else ~/.cache/xdit-pool/keys), which every pool you start uses."),
                *layout_inputs(LATER_LAYOUT_INPUTS, optional=True),
                io.Combo.Input("vae", options=vae_files(), default=NO_VAE, optional=True,
                               tooltip="With a single-file model: its VAE file from models/vae (wan_2.1_vae.safetensors for "
                                       "Wan image-to-video files, flux2-vae.safetensors for FLUX.2 [klein] files: they need "
                                       "it); the pool then also decodes with it (xDiT VAE Decode). none: no VAE on the pool."),
                io.Combo.Input("layout", options=[MANUAL, AUTO], default=MANUAL, optional=True,
                               tooltip="degrees: the degrees above. auto: ignore them; at the first job of each size the "
                                       "pool measures its link and compute, predicts every layout's step time and runs "
                                       "the fastest (the prediction table is in the xDiT panel)."),
                *layout_inputs(optional=True),
            ],
            outputs=[XDiTPoolType.Output(display_name="pool")],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        return layout_error(kwargs) or True

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return POOLS.fingerprint(pool_key(kwargs, resolve_model=False))

    @classmethod
    def execute(cls, **kwargs) -> io.NodeOutput:
        key = pool_key(kwargs)
        handle = POOLS.acquire(key)
        if key.endpoint:
            POOLS.remember(key, key.endpoint)
        return io.NodeOutput(handle)
