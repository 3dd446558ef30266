"""xDiT Pool: choose a model and a parallel layout; start (or reuse, or reach) a worker pool."""

from __future__ import annotations

import os
from dataclasses import replace

import folder_paths
from comfy_api.latest import io

from ..parallel.checkpoints import CHECKPOINT_SUFFIXES, checkpoint_variant
from ..parallel.config import LayoutError, ParallelConfig

from .pools import POOLS, TINY_MODELS, TINY_PREFIX, PoolKey, tiny_model_dir

XDiTPoolType = io.Custom("XDIT_POOL")
FILE_PREFIX = "file: "
# ComfyUI's model folders that hold single-file transformers; diffusion_models also covers models/unet.
CHECKPOINT_FOLDERS = ("diffusion_models", "checkpoints")
NO_VAE = "none"
MANUAL, AUTO = "degrees", "auto"


def diffusers_models() -> list[str]:
    """Pipeline folders (with model_index.json) under ComfyUI's models/diffusers, plus the tiny ones."""
    found = []
    for root in folder_paths.get_folder_paths("diffusers"):
        if os.path.isdir(root):
            for name in sorted(os.listdir(root)):
                if os.path.isfile(os.path.join(root, name, "model_index.json")):
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
        if os.path.isfile(os.path.join(root, choice, "model_index.json")):
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


def _auto(kwargs) -> bool:
    return kwargs.get("layout", MANUAL) == AUTO


def _config(kwargs) -> ParallelConfig:
    """The degrees as set, or with layout auto all 1 (the pool chooses them per job size)."""
    degrees = {} if _auto(kwargs) else dict(
        dp_degree=kwargs["dp_degree"], cfg_degree=2 if kwargs["cfg_parallel"] else 1,
        pipefusion_degree=kwargs["pipefusion_degree"], ring_degree=kwargs["ring_degree"],
        ulysses_degree=kwargs["ulysses_degree"], num_patches=kwargs["num_patches"] or None)
    return ParallelConfig(**degrees, warmup_steps=kwargs["warmup_steps"], shard_weights=kwargs.get("shard_weights", False),
                          offload=kwargs.get("offload", False), compile=kwargs.get("compile", False))


def pool_key(kwargs, resolve_model: bool = True) -> PoolKey:
    endpoint = kwargs.get("endpoint", "").strip()
    return PoolKey(
        model=model_path(kwargs["model"]) if resolve_model and not endpoint else kwargs["model"],
        vae=vae_path(kwargs) if resolve_model and not endpoint else None,
        nproc=kwargs["nproc"], parallel=_config(kwargs),
        # a single-file checkpoint is the transformer alone: prompts are encoded in ComfyUI
        text_encoders=kwargs["text_encoders"] and not kwargs["model"].startswith(FILE_PREFIX),
        dtype=None if kwargs["dtype"] == "auto" else kwargs["dtype"],
        devices=kwargs["devices"].strip() or None, threads_per_rank=kwargs["threads_per_rank"] or None,
        endpoint=endpoint, curve_dir=(kwargs.get("curve_dir") or "").strip() if endpoint else "",
        auto=_auto(kwargs) and not endpoint,
    )


class XDiTPool(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        degree = "Degree of {}; all degrees multiply to nproc."
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
                io.Int.Input("ulysses_degree", default=2, min=1, max=256, tooltip=degree.format("Ulysses sequence parallelism")),
                io.Int.Input("ring_degree", default=1, min=1, max=256, tooltip=degree.format("Ring attention")),
                io.Int.Input("pipefusion_degree", default=1, min=1, max=64, tooltip=degree.format("PipeFusion stages")),
                io.Int.Input("num_patches", default=0, min=0, max=64, tooltip="PipeFusion patches (0: the PipeFusion degree)."),
                io.Int.Input("warmup_steps", default=1, min=0, max=100, tooltip="PipeFusion synchronous warm-up steps."),
                io.Boolean.Input("cfg_parallel", default=False, tooltip="Run the two guidance branches on two ranks (counts as degree 2)."),
                io.Int.Input("dp_degree", default=1, min=1, max=256, tooltip=degree.format("data parallelism over the batch")),
                io.Boolean.Input("text_encoders", default=True, tooltip="Load the text encoders on rank 0 for xDiT Text Encode."),
                io.Combo.Input("dtype", options=["auto", "fp32", "bf16", "fp16", "fp8"], default="auto",
                               tooltip="Weights' dtype (auto: as saved; fp8: fp8 storage with bf16 compute)."),
                io.String.Input("devices", default="", tooltip="CUDA devices for the ranks, e.g. 0,1,2,3 (empty: all)."),
                io.Int.Input("threads_per_rank", default=0, min=0, max=256, tooltip="CPU threads per rank (0: PyTorch's default)."),
                io.String.Input("endpoint", default="", tooltip="Use a pool started with `python -m workers serve` at this endpoint instead."),
                io.String.Input("curve_dir", default="", optional=True,
                                tooltip="With endpoint, for a pool served with --curve-dir: a folder holding its server.key and "
                                        "an allowed client.key_secret (from `python -m workers keys`). Empty: $XDIT_CURVE_DIR, if set."),
                io.Boolean.Input("shard_weights", default=False, optional=True,
                                 tooltip="Split every transformer block's weights over the ranks (FSDP2), for models larger "
                                         "than one GPU; not with PipeFusion or fp8."),
                io.Boolean.Input("offload", default=False, optional=True,
                                 tooltip="With shard_weights: keep the shards in CPU memory, on the GPU only while their "
                                         "block runs, for models that do not fit even sharded."),
                io.Boolean.Input("compile", default=False, optional=True,
                                 tooltip="torch.compile every transformer block: faster steps once the first job of each "
                                         "size has paid the compilation."),
                # last, as every later input: saved workflows keep their widget values by position
                io.Combo.Input("vae", options=vae_files(), default=NO_VAE, optional=True,
                               tooltip="With a single-file model: its VAE file from models/vae (wan_2.1_vae.safetensors for "
                                       "Wan image-to-video files, flux2-vae.safetensors for FLUX.2 [klein] files: they need "
                                       "it); the pool then also decodes with it (xDiT VAE Decode). none: no VAE on the pool."),
                io.Combo.Input("layout", options=[MANUAL, AUTO], default=MANUAL, optional=True,
                               tooltip="degrees: the degrees above. auto: ignore them; at the first job of each size the "
                                       "pool measures its link and compute, predicts every layout's step time and runs "
                                       "the fastest (the prediction table is in the xDiT panel)."),
            ],
            outputs=[XDiTPoolType.Output(display_name="pool")],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        if kwargs.get("endpoint", "").strip():
            return True
        try:
            config = _config(kwargs)
            (replace(config, dp_degree=kwargs["nproc"]) if _auto(kwargs) else config).check(kwargs["nproc"], ranks_flag="nproc")
        except LayoutError as error:
            return str(error)
        return True

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
