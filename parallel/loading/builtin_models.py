"""Built-in tiny models: `xdit-tiny-<family>` is accepted wherever a model path is (contract E, the pool
CLI, the xDiT Pool node).

Each family declares its tiny models (`Family.tiny`, parallel/families/). They are built in code on
first use (random weights, offline tokenizers: they make noise, not pictures) and cached in the pack's
`.cache/tiny/` keyed by the builders' source, so a changed builder never serves a stale model. Listing
the names imports no diffusers: ComfyUI shows them at start-up.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ..families import FAMILIES as _REGISTRY

PREFIX = "xdit-tiny-"
FAMILIES = tuple(name for family in _REGISTRY for name in family.tiny)
NAMES = tuple(PREFIX + family for family in FAMILIES)
_HERE = Path(__file__).resolve().parent
_ENGINE = _HERE.parent
# The builders' source: the shared parts and every family module (where each family assembles its models).
_BUILDERS = (_HERE / "tiny_models.py", *sorted((_ENGINE / "families").rglob("*.py")))
CACHE = _ENGINE.parent / ".cache" / "tiny"


def is_pipeline_folder(path: Path) -> bool:
    """A diffusers pipeline's folder, or a modular pipeline's (diffusers' ModularPipeline)."""
    return any((path / index).is_file() for index in ("model_index.json", "modular_model_index.json"))


def is_builtin(model: str | os.PathLike) -> bool:
    return str(model).startswith(PREFIX) and not os.path.exists(model)


def family_of(model: str) -> str:
    family = str(model).removeprefix(PREFIX).split(" ")[0]
    if family not in FAMILIES:
        raise ValueError(f"{model!r} is not a built-in model; the built-in tiny models are {', '.join(NAMES)}")
    return family


def builtin_model_dir(model: str) -> Path:
    """The pipeline folder of built-in `model`, built once (atomically, so concurrent callers agree)."""
    family = family_of(model)
    version = hashlib.sha1(b"".join(path.read_bytes() for path in _BUILDERS)).hexdigest()[:10]
    directory = CACHE / version / family
    if is_pipeline_folder(directory):
        return directory
    from . import tiny_models

    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=directory.parent))
    try:
        tiny_models.save_tiny_pipeline(family, staging)
        try:
            staging.rename(directory)
        except OSError:  # another process finished first: keep its copy
            if not is_pipeline_folder(directory):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def resolve_model(model: str | os.PathLike) -> str:
    """A model argument as a path: built-in names become their cached folder, anything else is kept."""
    return str(builtin_model_dir(str(model))) if is_builtin(model) else str(model)


def check_model(model: str | os.PathLike, vae: str | os.PathLike | None = None) -> None:
    """Raise ValueError naming the real cause, before any rank starts: no such path ≠ not a pipeline folder;
    a VAE file (`--vae`) goes with a single-file checkpoint only."""
    model = str(model)
    if vae is not None and not Path(vae).expanduser().is_file():
        raise ValueError(f"--vae {vae}: no such file; give the VAE file (ComfyUI's models/vae) that goes with --model")
    if vae is not None and (is_builtin(model) or Path(model).expanduser().is_dir()):
        raise ValueError(f"--vae goes with a single-file checkpoint; --model {model} is a pipeline with its own VAE: "
                         "drop --vae")
    if is_builtin(model):
        family_of(model)
        return
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"--model {model}: no such file or folder; give a diffusers pipeline folder, a single-file "
                         f"checkpoint, or a built-in tiny model ({', '.join(NAMES)})")
    if path.is_dir() and not is_pipeline_folder(path):
        raise ValueError(f"--model {model} is a folder but not a diffusers pipeline folder (it has no model_index.json, "
                         "nor a modular pipeline's modular_model_index.json); give the folder that `save_pretrained` wrote")


def resolve_model_on_ranks(model: str | os.PathLike, local_rank: int, barrier: Callable[[], None]) -> str:
    """The model path on a rank: the first rank of each machine builds a built-in model, the others wait for it."""
    if not is_builtin(model):
        return str(model)
    family_of(str(model))  # a wrong name fails on every rank alike, before the barrier
    if local_rank == 0:
        resolve_model(model)
    barrier()
    return resolve_model(model)
