"""The seam between diffusers' attention processors and our sequence-parallel attention.

diffusers' processors project Q/K/V, apply norms and rotary embeddings, then call one attention
function: `F.scaled_dot_product_attention` (classic `Attention` processors) or
`dispatch_attention_fn` (newer processors such as Flux's). We keep every processor untouched and
reroute only that call: the wrapped layer marks itself active (a context variable) while it runs,
and the rerouted function runs USP when a layer is active and the original function otherwise.
Layers are wrapped when the sequence is split (ulysses/ring) or runs as PipeFusion patches.
So nothing changes for any attention the plan did not select, e.g. cross-attention.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ...distributed import get_ring_group, get_runtime_state, get_ulysses_group
from ..attention import TextLayout, pick_kernel, usp_attention
from .base_layer import xFuserLayerBaseWrapper


@dataclass
class _ActiveLayer:
    name: str
    text_layout: TextLayout
    kernel: str | None
    kv_cache: Any = None  # PipeFusion's StaleKVCache, when the layer runs in a patch pipeline
    calls: int = 0


_ACTIVE: contextvars.ContextVar[_ActiveLayer | None] = contextvars.ContextVar("xdit_active_attention", default=None)


def _sequence_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, *, tokens_dim: int):
    """USP for the active layer; `tokens_dim` is 2 for [B, H, S, D] callers and 1 for [B, S, H, D]."""
    layer = _ACTIVE.get()
    if attn_mask is not None or dropout_p or is_causal:
        raise NotImplementedError(
            f"sequence-parallel attention in {layer.name} got a mask/dropout/causal flag it cannot split; "
            "run this model without ulysses/ring degrees"
        )
    layer.calls += 1
    if tokens_dim == 1:
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    out = usp_attention(
        query,
        key,
        value,
        ulysses=get_ulysses_group(),
        ring=get_ring_group(),
        kernel=pick_kernel(query, layer.kernel),
        text_layout=layer.text_layout,
        text_tokens=get_runtime_state().text_tokens,
        scale=scale,
        keep=getattr(get_runtime_state().token_split, "keep", None),  # uneven token split: drop padded keys
        image_kv=functools.partial(layer.kv_cache.exchange, layer.name) if layer.kv_cache is not None else None,
    )
    return out.transpose(1, 2) if tokens_dim == 1 else out


def routed(original: Callable, tokens_dim: int) -> Callable:
    """A drop-in for `original` that runs USP while a wrapped layer is active."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if _ACTIVE.get() is None:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        return _sequence_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, tokens_dim=tokens_dim)

    attention.__wrapped__ = original
    return attention


class xFuserAttentionBaseWrapper(xFuserLayerBaseWrapper):
    """Makes one attention layer sequence parallel.

    Subclasses name the call site their processors use (`call_site` = module path, attribute) and
    how to reroute it (`reroute`, given the attribute's current value, returns the replacement).
    """

    call_site: ClassVar[tuple[str, str]]

    @staticmethod
    def reroute(original):  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __init__(self, module: torch.nn.Module, name: str, text_layout: TextLayout, kernel: str | None = None,
                 kv_cache: Any = None):
        super().__init__(module)
        self._install_route()
        self._layer = _ActiveLayer(name, text_layout, kernel, kv_cache)
        self._token: contextvars.Token | None = None
        self._handles.append(module.register_forward_pre_hook(self._enter))
        self._handles.append(module.register_forward_hook(self._exit))

    @classmethod
    def _install_route(cls) -> None:
        module_path, attribute = cls.call_site
        site = importlib.import_module(module_path)
        current = getattr(site, attribute)
        if getattr(current, "_xdit_routed", False):
            return
        replacement = cls.reroute(current)
        replacement._xdit_routed = True
        setattr(site, attribute, replacement)

    def _enter(self, module, args):
        self._layer.calls = 0
        self._token = _ACTIVE.set(self._layer)

    def _exit(self, module, args, output):
        _ACTIVE.reset(self._token)
        if self._layer.calls == 0:
            raise RuntimeError(
                f"{self._layer.name} ({type(module).__name__}) ran without reaching "
                f"{'.'.join(self.call_site)}: its processor ({type(getattr(module, 'processor', None)).__name__}) "
                "is not one this engine can parallelise; reset it with set_default_attn_processor()"
            )
