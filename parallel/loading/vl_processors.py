"""Vision-language processors without torchvision: their image half alone.

Qwen-Image-Edit encodes each prompt together with its reference images through Qwen2.5-VL, so its pipeline
folder's `processor` is transformers' Qwen2VLProcessor (FLUX 3's `tokenizer` is a Qwen3VLProcessor). That processor also builds a video processor, and
transformers builds video processors only with torchvision; its image processor has a PIL backend. Where
torchvision is missing, such a processor loads as `images_only(its class)`: the same tokens and pixels for
images, no videos (no diffusers pipeline gives it any). So does one saved where torchvision was missing (its
folder holds no video processor), wherever it is loaded.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from pathlib import Path


@functools.cache
def images_only(cls: type) -> type:
    """`cls` (a transformers processor taking image_processor, tokenizer, video_processor) without its video
    processor. It keeps `cls`'s name and library, so a pipeline saving it writes `cls`'s layout (model_index.json,
    processor_config.json) and the folder loads anywhere as the real thing."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__.split(".")[0],
                                       "__doc__": f"{cls.__name__} for images only (no torchvision here)."})


def _needs_video(cls: type) -> bool:
    return "video_processor" in inspect.signature(cls.__init__).parameters


def _has_video(folder: Path) -> bool:
    """Whether the saved processor holds its video half (transformers 5 keeps it in processor_config.json)."""
    config = folder / "processor_config.json"
    return (folder / "video_preprocessor_config.json").is_file() or (
        config.is_file() and "video_processor" in json.loads(config.read_text()))


def stand_ins(model_dir: Path, components: dict) -> dict:
    """The pipeline folder's processors that transformers cannot build here (a video half without torchvision, or
    saved without one), loaded for images only: {component name: processor}, to pass to from_pretrained.
    `components`: model_index.json's entries ([library, class]) or a modular index's ([library, class, spec])."""
    from transformers.utils import is_torchvision_available

    loaded = {}
    for name, entry in components.items():
        if not (isinstance(entry, list) and entry[:1] == ["transformers"]):
            continue
        cls = getattr(importlib.import_module("transformers"), entry[1], None)
        if isinstance(cls, type) and _needs_video(cls) and not (is_torchvision_available() and _has_video(model_dir / name)):
            loaded[name] = images_only(cls).from_pretrained(model_dir / name)
    return loaded
