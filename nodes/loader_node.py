"""Load Diffusion Model (xDiT Pool): UNETLoader's drop-in, whose MODEL runs every evaluation on a pool.

A workflow built for ComfyUI (UNETLoader → LoRA loaders → ModelSampling → KSampler or SamplerCustomAdvanced)
keeps every other node: swap its UNETLoader for this one. It offers the files UNETLoader offers and takes
the pool's layout with XDiTPool's own input names. The pool loads the transformer file alone (no VAE, no text
encoder: a MODEL needs neither), and the same file with the same layout reuses one pool, whichever of this node
and XDiTPool started it. The MODEL is ComfyUI's own model class for the file, as ComfyUI detects it
(comfy_files.py), so model sampling, latent format and conditioning are ComfyUI's; the two expert files of Wan
2.2 A14B share one pool holding both experts, each MODEL calling its own.
"""

from __future__ import annotations

from dataclasses import replace

import folder_paths
from comfy_api.latest import io

from ..parallel.loading.checkpoints import CHECKPOINT_SUFFIXES, detect_checkpoint
from ..workers.supervisor import PoolSpec
from . import comfy_files
from .model_node import comfy_model
from .pool_node import AUTO, FILE_PREFIX, FIRST_LAYOUT_INPUTS, LATER_LAYOUT_INPUTS, MANUAL, _gguf_files, layout_error, \
    layout_inputs, pool_key
from .pools import POOLS

FOLDER = "diffusion_models"  # UNETLoader's folder (models/unet too)
# UNETLoader's weight_dtype → the pool's storage: fp8 files and fp8 casts stay fp8 on the pool (e5m2 as e4m3fn).
WEIGHT_DTYPES = {"default": "auto", "fp8_e4m3fn": "fp8", "fp8_e4m3fn_fast": "fp8", "fp8_e5m2": "fp8"}


def unet_files() -> list[str]:
    """What UNETLoader lists, and the GGUF files beside them."""
    names = folder_paths.get_filename_list(FOLDER) + _gguf_files(FOLDER)
    return sorted({name for name in names if name.lower().endswith(CHECKPOINT_SUFFIXES)})


def unet_path(kwargs) -> str:
    path = folder_paths.get_full_path(FOLDER, kwargs["unet_name"])
    if path is None:
        raise ValueError(f"unet_name {kwargs['unet_name']!r}: no such file in ComfyUI's models/diffusion_models folders")
    return path


def pool_spec(kwargs) -> PoolSpec:
    """The pool this node stands for: XDiTPool's for its file (no text encoders, its weight dtype), the file of an
    expert pair named by the pair's first, so both experts' loaders share one pool."""
    key = pool_key({**kwargs, "model": f"{FILE_PREFIX}{FOLDER}/{kwargs['unet_name']}", "text_encoders": False,
                    "dtype": WEIGHT_DTYPES[kwargs["weight_dtype"]]})
    model, _ = detect_checkpoint(unet_path(kwargs)).expert()
    return key if key.endpoint else replace(key, model=str(model))


class XDiTLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTLoadDiffusionModel",
            display_name="Load Diffusion Model (xDiT Pool)",
            category="sampling/xDiT",
            description="UNETLoader's drop-in: the same files, a MODEL whose every evaluation runs in parallel on a "
                        "pool of ranks; LoRA loaders, ModelSampling, KSampler and guiders work on it unchanged.",
            inputs=[
                io.Combo.Input("unet_name", options=unet_files(), tooltip="A diffusion model file, as UNETLoader lists "
                               "them (models/diffusion_models, models/unet), GGUF files too."),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default",
                               tooltip="As UNETLoader: default keeps the file's dtype; the fp8 choices keep the weights "
                                       "in fp8 on the pool."),
                io.Int.Input("nproc", default=2, min=1, max=256, tooltip="Number of ranks (one per GPU)."),
                *layout_inputs(FIRST_LAYOUT_INPUTS),
                io.String.Input("devices", default="", tooltip="CUDA devices for the ranks, e.g. 0,1,2,3 (empty: all)."),
                io.Int.Input("threads_per_rank", default=0, min=0, max=256, tooltip="CPU threads per rank (0: PyTorch's default)."),
                io.String.Input("endpoint", default="", tooltip="Use a pool started with `python -m workers serve` at this "
                                "endpoint instead (it holds its own model and layout)."),
                io.String.Input("curve_dir", default="", optional=True, tooltip="With endpoint: the folder with the pool's "
                                "server.key and an allowed client.key_secret."),
                *layout_inputs(LATER_LAYOUT_INPUTS, optional=True),
                io.Combo.Input("layout", options=[MANUAL, AUTO], default=MANUAL, optional=True,
                               tooltip="degrees: the degrees above; auto: the pool chooses them per job size."),
                *layout_inputs(optional=True),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def validate_inputs(cls, **kwargs):
        return layout_error(kwargs) or True

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return POOLS.fingerprint(pool_spec(kwargs))

    @classmethod
    def execute(cls, **kwargs) -> io.NodeOutput:
        path = unet_path(kwargs)
        comfy_file = comfy_files.read(path)
        key = pool_spec(kwargs)
        handle = POOLS.acquire(key)
        if key.endpoint:
            POOLS.remember(key, key.endpoint)
        _, expert = detect_checkpoint(path).expert()
        return io.NodeOutput(comfy_model(handle, comfy_file, expert))
