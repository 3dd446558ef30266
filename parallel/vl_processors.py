"""Vision-language processors without torchvision: their image half alone.

Qwen-Image-Edit encodes each prompt together with its reference images through Qwen2.5-VL, so its pipeline
folder's `processor` is transformers' Qwen2VLProcessor. That processor also builds a video processor, and
transformers builds video processors only with torchvision; its image processor has a PIL backend. Where
torchvision is missing, such a processor loads as `images_only(its class)`: the same tokens and pixels for
images, no videos (no diffusers pipeline gives it any).
"""

from __future__ import annotations

import functools
import importlib
import inspect
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


def stand_ins(model_dir: Path, components: dict) -> dict:
    """The pipeline folder's processors that transformers cannot build here (a video half without torchvision),
    loaded for images only: {component name: processor}, to pass to from_pretrained; {} with torchvision."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return {}
    loaded = {}
    for name, entry in components.items():
        if not (isinstance(entry, list) and entry[:1] == ["transformers"] and name.startswith("processor")):
            continue
        cls = getattr(importlib.import_module("transformers"), entry[1], None)
        if isinstance(cls, type) and _needs_video(cls):
            loaded[name] = images_only(cls).from_pretrained(model_dir / name)
    return loaded
