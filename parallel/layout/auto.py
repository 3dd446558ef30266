"""`--layout auto` in a long-lived process (a pool's ranks): the layout chosen once per job size, the pipeline
rewrapped when the next job's size chose another.

Before any job the pipeline runs on a start layout every model can take: Ulysses over as many ranks as its heads
divide, Ring over the rest (single model calls, which carry no job size, run on the current layout). A job of a
size not seen before pays one choice (choice.auto_layout: two serial steps, the block and link probes);
later jobs of that size reuse it, and only a change of layout costs a rewrap (hooks, no weights move). Collective:
every rank calls `for_call` with the same call, as the pool's job loop does.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from .config import AutoLayout, Link, ParallelConfig
from ..distributed import initialize_model_parallel
from .choice import attention_module, auto_layout, describe
from ..model_executor import wrap_pipeline
from ..model_executor.pipeline.data_parallel import batch_size

KEEP = 32  # job sizes remembered; the oldest choice is forgotten first


@dataclass(frozen=True)
class Choice:
    job: str  # "1024x1024, batch 1, 20 steps, CFG"
    config: ParallelConfig
    table: list[str]  # describe(): the links, then one line per layout, fastest first
    predictions: list[dict]  # Prediction.row(), fastest first

    def report(self) -> dict:
        return {"job": self.job, "layout": self.config.describe(), "table": self.table, "predictions": self.predictions}


def start_layout(pipeline, base: ParallelConfig, world: int) -> ParallelConfig:
    """Ulysses over the largest degree the model's heads divide, Ring over the rest."""
    ulysses = math.gcd(attention_module(pipeline.transformer)[1], world)
    return replace(base, ulysses_degree=ulysses, ring_degree=world // ulysses)


class AutoLayouts:
    def __init__(self, pipeline, base: ParallelConfig, world: int, auto: AutoLayout,
                 attention_kernel: str | None = None):
        self.pipeline, self.base, self.world = pipeline, base, world  # the diffusers pipeline, never wrapped twice
        self.link = Link.parse(auto.link) if auto.link else None
        self.link_name = auto.link or "measured"
        self.attention_kernel = attention_kernel
        self.choices: OrderedDict[tuple, Choice] = OrderedDict()
        self.last: Choice | None = None
        self._wrap(start_layout(pipeline, base, world))

    def _wrap(self, config: ParallelConfig) -> None:
        self.rank_layout = initialize_model_parallel(config)
        self.config = config
        self.wrapped = wrap_pipeline(self.pipeline, self.attention_kernel, reversible=True)

    def for_call(self, call: dict) -> tuple[object, Choice | None]:
        """The wrapped pipeline for `call` (pipeline keyword arguments, tensors on any device) and the choice just
        made for it (None when its size was seen before)."""
        transformer = self.pipeline.transformer
        call = {k: v.to(transformer.device, transformer.dtype if v.is_floating_point() else v.dtype)
                if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        kwargs = {**self.wrapped.call_defaults, **call}
        cfg = self.wrapped.uses_cfg(kwargs)
        key = (tuple(sorted((k, tuple(v.shape)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))),
               kwargs.get("height"), kwargs.get("width"), kwargs.get("num_inference_steps"), cfg)
        made = None
        if key not in self.choices:
            chosen = self.config
            self.wrapped.unwrap()
            try:
                chosen, predictions, links = auto_layout(self.pipeline, self.base, call, self.world, self.link,
                                                         self.attention_kernel)
            finally:
                self._wrap(chosen)  # the chosen layout, or the one before if the choice failed
            job = (f"{kwargs.get('height')}x{kwargs.get('width')}, batch {batch_size(kwargs)}, "
                   f"{kwargs.get('num_inference_steps')} steps{', CFG' if cfg else ''}")
            made = Choice(job, chosen, describe(predictions, links, measured=self.link is None),
                          [p.row() for p in predictions])
            self.choices[key] = made
            while len(self.choices) > KEEP:
                self.choices.popitem(last=False)
        choice = self.choices[key]
        self.choices.move_to_end(key)
        if choice.config != self.config:
            self.wrapped.unwrap()
            self._wrap(choice.config)
        self.last = choice
        return self.wrapped, made

    def report(self) -> dict:
        """For a pool's status (asked from rank 0's server thread): the link used, the current layout and every
        remembered choice, the latest last."""
        choices = list(self.choices.values())  # one C-level copy: the job loop may add a choice meanwhile
        return {"link": self.link_name, "current": self.config.describe(), "last": self.last.report() if self.last else None,
                "choices": [{"job": c.job, "layout": c.config.describe()} for c in choices]}
