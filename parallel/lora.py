"""LoRA on a parallel pipeline: load once per file, stack by strength, remove without reloading.

Files are read with the pipeline family's own diffusers converter (`lora_state_dict`), which takes
diffusers/PEFT, Kohya and XLabs layouts; layouts it does not read (BFL's Flux layout) go through the
family's `convert_lora` (parallel/families/). Then they are injected into this rank's transformer with
PEFT (`load_lora_adapter`). Our parallel hooks sit on attention modules, not on the Linear layers
PEFT wraps, so every layout keeps working. Under PipeFusion each stage takes only the weights of
the blocks it holds; weights that match no layer of the model at all mean a LoRA for another model.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from .families import FAMILIES


@dataclass(frozen=True)
class LoraSpec:
    path: str
    strength: float


class LoraManager:
    """The adapters loaded on one rank's transformer and the stack that is active."""

    def __init__(self, pipeline):
        self.pipeline = pipeline  # the diffusers pipeline (its class converts LoRA formats)
        self.transformer = pipeline.transformer.module
        # every layer of the whole model, also those another PipeFusion stage holds, so that all
        # ranks judge a file alike
        self.model_layers = pipeline.transformer.module_names
        self.loaded: dict[str, str] = {}  # file -> adapter name
        self.loads = 0
        self.active: tuple[LoraSpec, ...] = ()

    def apply(self, stack: list[LoraSpec]) -> None:
        """Make exactly `stack` active (in order, at its strengths); an empty stack is the base model."""
        stack = tuple(stack)
        if stack == self.active:
            return
        for spec in stack:
            if spec.path not in self.loaded:
                self._load(spec.path)
        active = [(self.loaded[spec.path], spec.strength) for spec in stack if self.loaded[spec.path]]
        names = [name for name, _ in active]
        if names:
            self.transformer.set_adapters(names, weights=[strength for _, strength in active])
            self.transformer.enable_lora()
        elif any(self.loaded.values()):
            self.transformer.disable_lora()
        self.active = stack

    def _load(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"LoRA file {path} does not exist")
        state = self._read(path)
        weights = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
        mine = self._select(path, weights)
        name = "lora_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        if mine:  # empty when another PipeFusion stage holds every layer this LoRA changes
            self.transformer.load_lora_adapter(mine, adapter_name=name, prefix=None)
        self.loaded[path] = name if mine else ""
        self.loads += 1

    def _read(self, path: str) -> dict[str, torch.Tensor]:
        """The file's weights with diffusers' names, converted from Kohya/XLabs/family layouts."""
        loader = getattr(type(self.pipeline), "lora_state_dict", None)
        if loader is None:
            raise ValueError(
                f"{type(self.pipeline).__name__} has no LoRA support in diffusers; LoRA works with SD3 and Flux pools"
            )
        try:
            state = loader(path)
        except Exception as error:  # noqa: BLE001 - diffusers raises many kinds for bad files
            raise ValueError(f"{os.path.basename(path)} is not a readable LoRA file ({type(error).__name__}: {error})") from None
        state = state[0] if isinstance(state, tuple) else state
        convert = FAMILIES.for_transformer(self.transformer).convert_lora
        return convert(state, self.transformer) if convert else state

    def _select(self, path: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights whose layers this rank holds; refuse a LoRA made for another model."""
        here = dict(self.transformer.named_modules())
        mine, foreign = {}, []
        for key, value in weights.items():
            layer = key.split(".lora_")[0]
            if layer not in self.model_layers:
                foreign.append(key)
            elif layer in here:
                mine[key] = value
        if not weights or foreign:
            example = f" (e.g. {foreign[0]})" if foreign else ""
            raise ValueError(
                f"{os.path.basename(path)} is not a LoRA for this {type(self.transformer).__name__}: "
                f"{len(foreign) or len(weights)} of its weights match none of the model's layers{example}"
            )
        return mine
