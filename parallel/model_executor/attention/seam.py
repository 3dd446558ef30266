"""The seam between diffusers' attention processors and our sequence-parallel attention.

diffusers' processors project Q/K/V, apply norms and rotary embeddings, then call one attention
function: `F.scaled_dot_product_attention` (classic `Attention` processors) or
`dispatch_attention_fn` (newer processors such as Flux's). We keep every processor untouched and
reroute only that call: the wrapped layer marks itself active (a context variable) while it runs,
and the rerouted function runs USP when a layer is active and the original function otherwise.
Layers are wrapped when the sequence is split (ulysses/ring) or runs as PipeFusion patches.
So nothing changes for any attention the plan did not select, e.g. cross-attention.

The reroute replaces one module global (`call_site`), shared by every wrapped layer that uses it and
counted: the last layer to be removed puts the original back, so an unwrapped model runs exactly
diffusers' code again. The active mark is cleared by an `always_call` forward hook, so an exception
inside attention cannot leave later attention routed to USP.

Why not diffusers' own seams: its attention backend registry (`attention_dispatch`) is keyed by the
closed `AttentionBackendName` enum, so a new backend means writing into private registry state, and
it only covers `dispatch_attention_fn` callers (not the classic processors' `F`); the processors'
`_parallel_config` selects diffusers' own context-parallel implementation and device meshes, not ours.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ...distributed import get_layout, get_ring_group, get_runtime_state, get_sp_group, get_ulysses_group
from ..wrapper import xFuserBaseWrapper
from .kernels import pick_kernel
from .usp import TextLayout, key_shard_attention, usp_attention


class xFuserLayerBaseWrapper(xFuserBaseWrapper):
    """Parallel behaviour attached to one diffusers layer, in place: it hooks the original module instead of
    replacing it in the model tree, so parameter names (checkpoints, LoRA adapters) and the transformer's own
    forward stay exactly diffusers'."""

    def __init__(self, module: torch.nn.Module):
        super().__init__(module)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def remove(self) -> None:
        """Detach from the layer, leaving it exactly as diffusers built it."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@dataclass
class _ActiveLayer:
    name: str
    text_layout: TextLayout
    kernel: str | None
    kv_cache: Any = None  # PipeFusion's StaleKVCache, when the layer runs in a patch pipeline
    replicated_queries: bool = False  # queries of a stream every rank holds, keys of the split one (plans.py)
    mask_argument: str | None = None  # ParallelPlan.attention_masks: the forward argument holding its additive mask
    bias: torch.Tensor | None = None  # that mask in this call, taken from the processor's arguments
    calls: int = 0
    reached: bool = False  # has reached the attention call once: a later call may skip it (LTX-2's perturbed STG blocks)


_ACTIVE: contextvars.ContextVar[_ActiveLayer | None] = contextvars.ContextVar("xdit_active_attention", default=None)


# Under --compile (parallel/model_executor/compile.py) the collectives and the active-layer mark run eagerly: dynamo stops
# cleanly at these three functions instead of tracing group state it would guard on and recompile for.
@torch.compiler.disable
def _sequence_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, *, tokens_dim: int):
    """USP for the active layer; `tokens_dim` is 2 for [B, H, S, D] callers and 1 for [B, S, H, D]."""
    layer = _ACTIVE.get()
    if attn_mask is not None and attn_mask.dtype == torch.bool and get_runtime_state().text_mask_complete:
        attn_mask = None  # the text padding was trimmed away (plans.TextPadding): nothing is masked, no need to look
    if attn_mask is not None or dropout_p or is_causal:
        raise NotImplementedError(
            f"sequence-parallel attention in {layer.name} got a mask/dropout/causal flag it cannot split; "
            "run this model without ulysses/ring degrees"
        )
    layer.calls += 1
    if tokens_dim == 1:
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    if layer.replicated_queries:
        split, sp = get_runtime_state().token_split, get_sp_group()
        out = key_shard_attention(query, key, value, sp=sp, kernel=pick_kernel(query, layer.kernel), scale=scale,
                                  real=None if split is None else split.sizes[sp.rank_in_group])
        return out.transpose(1, 2) if tokens_dim == 1 else out
    text_tokens = get_runtime_state().text_tokens
    if layer.text_layout is TextLayout.CAUSAL_PREFIX:  # the keys' replicated prefix: the sequence's, or a cached one
        text_tokens = key.shape[2] - query.shape[2]  # [B, H, S, D] by now
    if layer.kv_cache is not None:  # a PipeFusion patch may hold the text alone, or no text
        text_tokens = layer.kv_cache.text_tokens(text_tokens)
    out = usp_attention(
        query,
        key,
        value,
        ulysses=get_ulysses_group(),
        ring=get_ring_group(),
        kernel=pick_kernel(query, layer.kernel),
        text_layout=layer.text_layout,
        text_tokens=text_tokens,
        scale=scale,
        keep=getattr(get_runtime_state().token_split, "keep", None),  # uneven token split: drop padded keys
        stale_kv=functools.partial(layer.kv_cache.exchange, layer.name) if layer.kv_cache is not None else None,
        head_groups=get_layout().config.ulysses_overlap_groups,
        bias=layer.bias,  # the transformer's own tensor, the same in every layer of a call: gathered once
    )
    return out.transpose(1, 2) if tokens_dim == 1 else out


def routed(original: Callable, tokens_dim: int) -> Callable:
    """A drop-in for `original` that runs USP while a wrapped layer is active."""

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        layer = _ACTIVE.get()
        if layer is None or _prefix_alone(layer, key, tokens_dim):
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)
        return _sequence_parallel_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, tokens_dim=tokens_dim)

    attention.__wrapped__ = original
    return attention


def _prefix_alone(layer: _ActiveLayer, key: torch.Tensor, tokens_dim: int) -> bool:
    """A call of a CAUSAL_PREFIX layer on its replicated prefix alone (its keys all the prefix's): it runs as it is,
    whole on every rank, its result the same everywhere."""
    if layer.text_layout is not TextLayout.CAUSAL_PREFIX or key.shape[tokens_dim] > get_runtime_state().text_tokens:
        return False
    layer.calls += 1
    return True


@dataclass
class _Route:
    original: Any
    replacement: Any
    users: int = 0


_ROUTES: dict[tuple[str, str], _Route] = {}


def _take_route(call_site: tuple[str, str], reroute: Callable[[Any], Any]) -> None:
    """Install the reroute of `call_site` for one more layer (the first one replaces the global)."""
    route = _ROUTES.get(call_site)
    if route is None:
        site = importlib.import_module(call_site[0])
        original = getattr(site, call_site[1])
        route = _ROUTES[call_site] = _Route(original, reroute(original))
        setattr(site, call_site[1], route.replacement)
    route.users += 1


def _release_route(call_site: tuple[str, str]) -> None:
    """One layer fewer uses the reroute; the last one puts the original global back."""
    route = _ROUTES[call_site]
    route.users -= 1
    if route.users:
        return
    del _ROUTES[call_site]
    site = importlib.import_module(call_site[0])
    if getattr(site, call_site[1]) is route.replacement:  # a later patch on top of ours stays in place
        setattr(site, call_site[1], route.original)


def _cache_may_serve(module: torch.nn.Module) -> bool:
    """A diffusers cache hook on the layer (TaylorSeer) returns its prediction without running attention."""
    registry = getattr(module, "_diffusers_hook", None)
    return registry is not None and bool(registry.hooks)


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
                 kv_cache: Any = None, replicated_queries: bool = False, mask_argument: str | None = None):
        super().__init__(module)
        _take_route(self.call_site, self.reroute)
        self._routed = True
        self._layer = _ActiveLayer(name, text_layout, kernel, kv_cache, replicated_queries, mask_argument)
        self._token: contextvars.Token | None = None
        self._handles.append(module.register_forward_pre_hook(self._enter))
        if mask_argument is not None:
            self._handles.append(module.register_forward_pre_hook(self._take_mask, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._exit, always_call=True))

    def remove(self) -> None:
        super().remove()
        if self._routed:
            _release_route(self.call_site)
            self._routed = False

    @torch.compiler.disable
    def _enter(self, module, args):
        self._layer.calls = 0
        self._token = _ACTIVE.set(self._layer)

    @torch.compiler.disable
    def _take_mask(self, module, args, kwargs):
        """The plan's attention mask out of the processor's call (which would pad its key columns to the local
        tokens) and onto the layer, for USP to apply where the keys are (ParallelPlan.attention_masks)."""
        name = self._layer.mask_argument
        if name in kwargs:
            self._layer.bias, kwargs = kwargs[name], {**kwargs, name: None}
            return args, kwargs
        position = list(inspect.signature(module.forward).parameters).index(name)
        if position < len(args):
            self._layer.bias, args = args[position], (*args[:position], None, *args[position + 1:])
        return args, kwargs

    @torch.compiler.disable
    def _exit(self, module, args, output):
        """Runs after forward, also when it raised (then `output` is None and torch re-raises its error)."""
        if self._token is None:  # an earlier pre-hook raised before _enter ran
            return
        _ACTIVE.reset(self._token)
        self._token, self._layer.bias = None, None
        self._layer.reached |= self._layer.calls > 0
        if output is not None and not self._layer.reached and not _cache_may_serve(module):
            raise RuntimeError(
                f"{self._layer.name} ({type(module).__name__}) ran without reaching "
                f"{'.'.join(self.call_site)}: its processor ({type(getattr(module, 'processor', None)).__name__}) "
                "is not one this engine can parallelise; reset it with set_default_attn_processor()"
            )
