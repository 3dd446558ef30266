"""The attention seam leaves no process-wide trace: routing ends with the layer's forward (also when it
raises), unwrapping puts diffusers' module globals back exactly, and plan shapes are checked.

One rank in this process (gloo, world of 1): USP on one rank is plain attention, so a routed layer
must equal the unwrapped layer, and a broken USP (the negative control) must not.
"""

from __future__ import annotations

import diffusers.models.attention_processor as classic_site
import diffusers.models.transformers.transformer_flux as flux_site
import diffusers.models.transformers.transformer_wan as wan_site
import pytest
import torch
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_flux import FluxAttention
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from parallel.layout.config import LayoutError, ParallelConfig
from parallel.distributed.group_coordinator import GroupCoordinator
from parallel.model_executor import hooks
from parallel.model_executor.attention import TextLayout
from parallel.model_executor.attention import seam as attention_seam
from parallel.model_executor.plans import Gather, Split
from parallel.model_executor.register import xFuserLayerWrappersRegister
from xdit_test_helpers import one_rank

LAYERS = {
    "classic": lambda: Attention(query_dim=32, heads=4, dim_head=8),
    "flux": lambda: FluxAttention(query_dim=32, heads=4, dim_head=8, pre_only=True),
    "wan": lambda: WanAttention(dim=32, heads=4, dim_head=8, processor=WanAttnProcessor()),
}
SITES = {"classic": (classic_site, "F"), "flux": (flux_site, "dispatch_attention_fn"),
         "wan": (wan_site, "dispatch_attention_fn")}


@pytest.fixture(scope="module", name="one_rank")
def one_rank_fixture():
    with one_rank(ParallelConfig()):
        yield


def layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    module = LAYERS[kind]().eval()
    with torch.no_grad():  # peaked attention, so a wrong route changes the result (DESIGN.md)
        for name in ("to_q", "to_k"):
            getattr(module, name).weight.mul_(8)
    return module


def wrap(module: torch.nn.Module, name: str = "attn"):
    return xFuserLayerWrappersRegister.get_wrapper(module)(module, name, TextLayout.NONE)


def tokens() -> torch.Tensor:
    return torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))


def globals_now() -> dict[str, object]:
    return {kind: getattr(module, attribute) for kind, (module, attribute) in SITES.items()}


def broken_usp(q, k, v, **kwargs):
    """Negative control: attention to the first key only."""
    return v[:, :, :1].expand_as(q).clone()


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_routed_layer_equals_diffusers_and_a_broken_route_does_not(one_rank, kind, monkeypatch):
    module, x = layer(kind), tokens()
    expected = module(x)
    wrapper = wrap(module)
    try:
        assert (module(x) - expected).abs().max().item() <= 1e-5
        monkeypatch.setattr(attention_seam, "usp_attention", broken_usp)
        assert (module(x) - expected).abs().max().item() > 1e-2
    finally:
        wrapper.remove()


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_an_exception_inside_attention_leaves_later_attention_unrouted(one_rank, kind, monkeypatch):
    module, other, x = layer(kind), layer(kind), tokens()
    expected = other(x)
    wrapper = wrap(module)
    calls = []

    def failing_usp(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("attention failed")

    monkeypatch.setattr(attention_seam, "usp_attention", failing_usp)
    try:
        with pytest.raises(RuntimeError, match="attention failed"):
            module(x)
        assert attention_seam._ACTIVE.get() is None
        # The route is still installed (the wrapper is), but an unwrapped layer must not take it.
        assert torch.equal(other(x), expected)
        assert len(calls) == 1
    finally:
        wrapper.remove()


def test_unwrap_restores_module_globals_exactly(one_rank):
    before = globals_now()
    wrappers = [wrap(layer(kind)) for kind in LAYERS]
    assert all(globals_now()[kind] is not before[kind] for kind in LAYERS)
    for wrapper in wrappers:
        wrapper.remove()
    assert all(globals_now()[kind] is before[kind] for kind in LAYERS)


@pytest.mark.parametrize("kind", LAYERS)
@torch.no_grad()
def test_wrap_twice_unwrap_twice(one_rank, kind, monkeypatch):
    before = globals_now()[kind]
    first, second, x = layer(kind), layer(kind), tokens()
    expected = second(x)
    calls, usp = [], attention_seam.usp_attention
    monkeypatch.setattr(attention_seam, "usp_attention", lambda *a, **k: calls.append(1) or usp(*a, **k))
    for _ in range(2):  # wrap, unwrap, and again: the second cycle starts from diffusers' globals
        a, b = wrap(first, "first"), wrap(second, "second")
        a.remove()
        a.remove()  # a second remove of the same wrapper changes nothing
        assert globals_now()[kind] is not before  # `second` still needs the route
        calls.clear()
        assert (second(x) - expected).abs().max().item() <= 1e-5 and len(calls) == 1
        b.remove()
        assert globals_now()[kind] is before
        calls.clear()
        assert torch.equal(second(x), expected) and not calls


def split_hook(spec: Split, degree: int = 2):
    module = torch.nn.Linear(4, 4)
    sp = GroupCoordinator("sp", list(range(degree)), None)  # rank 0 of `degree`: the split needs no exchange
    return hooks._split_inputs(module, "FluxTransformer2DModel", {"hidden_states": spec}, sp)


def test_split_with_the_expected_dims_shards():
    _, named = split_hook(Split(dim=1, expected_dims=3))(None, (), {"input": None, "hidden_states": torch.ones(1, 8, 4)})
    assert named["hidden_states"].shape == (1, 4, 4)


@pytest.mark.parametrize("op, where", [
    (Split(dim=1, expected_dims=3), "input 'hidden_states' of FluxTransformer2DModel"),
    (Gather(dim=1, expected_dims=3), "the output of proj_out"),
])
def test_a_changed_shape_fails_with_one_layout_error_line(op, where):
    four_dims = torch.ones(1, 2, 8, 4)
    if isinstance(op, Split):
        run = lambda: split_hook(op)(None, (), {"hidden_states": four_dims})  # noqa: E731
    else:
        sp = GroupCoordinator("sp", [0, 1], None)
        run = lambda: hooks._output_op("proj_out", op, sp)(None, (), four_dims)  # noqa: E731
    with pytest.raises(LayoutError) as error:
        run()
    message = str(error.value)
    assert "\n" not in message and where in message
    assert "expects" in message and "3 dimensions, got 4" in message and "[1, 2, 8, 4]" in message
