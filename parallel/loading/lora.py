"""LoRA on a parallel pipeline: load once per file, stack by strength, remove without reloading.

Files are read with the pipeline family's own diffusers converter (`lora_state_dict`), which takes
diffusers/PEFT, Kohya and XLabs layouts; layouts it does not read (BFL's Flux layout) go through the
family's `convert_lora` (parallel/families/). Then they are injected into this rank's transformer with
PEFT (`load_lora_adapter`). Our parallel hooks sit on attention modules, not on the Linear layers
PEFT wraps, so every layout keeps working. Under PipeFusion each stage takes only the weights of
the blocks it holds; weights that match no layer of the model at all mean a LoRA for another model.

A pipeline with two experts (Wan 2.2 A14B: `transformer` for high noise, `transformer_2` for low
noise) takes a LoRA into the expert it names, or into every expert by default, as a ComfyUI user who
loads the same LoRA onto both models expects. Naming MiniMax-H3's `transformer_ref` puts the file's `transformer.`
weights there instead, as diffusers' `load_into_transformer_ref=True` does.

Weights for the other parts diffusers' loader of the pipeline puts LoRAs into (`_lora_loadable_modules`) that the
pipeline's call runs go into those parts: LTX-2's text connectors, which every rank runs whole; MiniMax-H3's
reference-to-video partition `transformer_ref` (its `transformer_ref.` weights: diffusers routes a LoRA to one
partition, as one partition's LoRA degrades the other). Text encoders are not the sampler's (the pool's encode step
and ComfyUI's own CLIP path encode the text).
"""

from __future__ import annotations

import hashlib
import os

import torch

from ..families import FAMILIES
from ..pipeline_transformers import EXPERTS, TRANSFORMERS
from ..request import LoraSpec



class LoraManager:
    """The adapters loaded on one rank's transformers and the stack that is active."""

    def __init__(self, pipeline):
        self.pipeline = pipeline  # the diffusers pipeline (its class converts LoRA formats)
        wrapped = {name: getattr(pipeline, name, None) for name in EXPERTS}
        # each expert's every layer, also those another PipeFusion stage holds, so all ranks judge a file alike
        self.experts = {name: (t.module, t.module_names) for name, t in wrapped.items() if t is not None}
        loadable = getattr(type(pipeline), "_lora_loadable_modules", ())
        self.parts = {}
        for name in loadable:
            part = getattr(pipeline, name, None)
            if name in EXPERTS or name.startswith("text_encoder") or not isinstance(part, torch.nn.Module):
                continue
            # a wrapped transformer (MiniMax-H3's `transformer_ref`) takes its LoRA into the model it wraps
            wrapped = hasattr(part, "module_names")
            self.parts[name] = (part.module, part.module_names) if wrapped else \
                (part, {layer for layer, _ in part.named_modules()})
        self.loaded: dict[tuple[str, str, str], str] = {}  # (file, target, key prefix) -> adapter ("": none here)
        self.loads = 0
        self.active: tuple[LoraSpec, ...] = ()

    def apply(self, stack: list[LoraSpec]) -> None:
        """Make exactly `stack` active (in order, at its strengths); an empty stack is the base model."""
        stack = tuple(stack)
        if stack == self.active:
            return
        for spec in stack:
            self._load(spec)
        for target, (module, _) in {**self.experts, **self.parts}.items():
            active = [(self.loaded[spec.path, t, prefix], spec.strength) for spec in stack
                      for t, prefix in self._routes(spec) if t == target and self.loaded[spec.path, t, prefix]]
            if active:
                module.set_adapters([name for name, _ in active], weights=[strength for _, strength in active])
                module.enable_lora()
            elif any(name for (_, t, _), name in self.loaded.items() if t == target):
                module.disable_lora()
        self.active = stack

    def _routes(self, spec: LoraSpec) -> list[tuple[str, str]]:
        """(target, key prefix) pairs the file goes into: its `transformer.` weights into the transformers it names
        (every expert by default), each part's own weights into that part."""
        into = [spec.expert] if spec.expert else list(self.experts)
        return [(target, "transformer.") for target in into] + [(part, f"{part}.") for part in self.parts]

    def check(self, spec: LoraSpec) -> None:
        """Refuse a LoRA naming a transformer this pipeline does not hold (at submit, before any compute)."""
        held = [name for name in {**self.experts, **self.parts} if name in TRANSFORMERS]
        if spec.expert and spec.expert not in held:
            raise ValueError(f"this {type(self.pipeline).__name__} has no {spec.expert}; its transformers are "
                             f"{', '.join(held)}")

    def _load(self, spec: LoraSpec) -> None:
        """Load the file along its routes (once per file and each)."""
        self.check(spec)
        targets = {**self.experts, **self.parts}
        routes = [route for route in self._routes(spec) if (spec.path, *route) not in self.loaded]
        if not routes:
            return
        if not os.path.isfile(spec.path):
            raise FileNotFoundError(f"LoRA file {spec.path} does not exist")
        state = self._read(spec.path)
        parts_only = not any(k.startswith("transformer.") for k in state) and any(
            k.startswith(prefix) for k in state for _, prefix in routes)  # MiniMax-H3: a `transformer_ref.` LoRA
        for target, prefix in routes:
            module, layers = targets[target]
            weights = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            required = prefix == "transformer." and not parts_only  # the file's own model: its weights must fit
            mine = self._select(spec.path, weights, module, layers) if weights or required else {}
            # one adapter per prefix: MiniMax-H3's `transformer_ref` may take a file's both
            name = "lora_" + hashlib.sha1(f"{spec.path}:{prefix}".encode()).hexdigest()[:12]
            if mine:  # empty when another PipeFusion stage holds every layer this LoRA changes
                module.load_lora_adapter(mine, adapter_name=name, prefix=None)
            self.loaded[spec.path, target, prefix] = name if mine else ""
        self.loads += 1

    def _read(self, path: str) -> dict[str, torch.Tensor]:
        """The file's weights with diffusers' names, converted from Kohya/XLabs/family layouts."""
        loader = getattr(type(self.pipeline), "lora_state_dict", None)
        if loader is None:
            raise ValueError(
                f"{type(self.pipeline).__name__} has no LoRA support in diffusers; LoRA works with SD3, FLUX.1 (Kontext), "
                "FLUX.2, Qwen-Image (Edit), Z-Image, Wan, LTX-2 and MiniMax-H3 pools"
            )
        try:
            state = loader(path)
        except Exception as error:  # noqa: BLE001 - diffusers raises many kinds for bad files
            raise ValueError(f"{os.path.basename(path)} is not a readable LoRA file ({type(error).__name__}: {error})") from None
        state = state[0] if isinstance(state, tuple) else state
        transformer = next(iter(self.experts.values()))[0]
        convert = FAMILIES.for_transformer(transformer).convert_lora
        return convert(state, transformer) if convert else state

    @staticmethod
    def _select(path: str, weights: dict[str, torch.Tensor], transformer, layers) -> dict[str, torch.Tensor]:
        """The weights whose layers this rank holds; refuse a LoRA made for another model."""
        here = dict(transformer.named_modules())
        mine, foreign = {}, []
        for key, value in weights.items():
            layer = key.split(".lora_")[0]
            if layer not in layers:
                foreign.append(key)
            elif layer in here:
                mine[key] = value
        if not weights or foreign:
            example = f" (e.g. {foreign[0]})" if foreign else ""
            raise ValueError(
                f"{os.path.basename(path)} is not a LoRA for this {type(transformer).__name__}: "
                f"{len(foreign) or len(weights)} of its weights match none of the model's layers{example}"
            )
        return mine
