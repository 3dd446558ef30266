"""Attention layers whose processors call diffusers' `dispatch_attention_fn` ([B, S, H, D] layout).

The families declare these classes (`Family.attention_layers`: class name → the module whose
`dispatch_attention_fn` global the processor calls); one wrapper class is built per declared class.
"""

from __future__ import annotations

import functools

from ..register import xFuserLayerWrappersRegister
from .seam import routed, xFuserAttentionBaseWrapper


class _DispatchAttentionWrapper(xFuserAttentionBaseWrapper):
    """Processors that call `dispatch_attention_fn` with [B, S, H, D] tensors; subclasses name the module."""

    @staticmethod
    def reroute(original):
        return routed(original, tokens_dim=1)


def _declared() -> dict[str, str]:
    from ...families import FAMILIES

    return {name: site for family in FAMILIES for name, site in family.attention_layers.items()}


@functools.cache
def _dispatch_wrapper(class_name: str, module: str) -> type:
    return type(f"xFuser{class_name}Wrapper", (_DispatchAttentionWrapper,),
                {"call_site": (module, "dispatch_attention_fn"), "__module__": __name__,
                 "__doc__": f"{class_name}, whose processor calls {module}.dispatch_attention_fn."})


xFuserLayerWrappersRegister.declare(_declared, _dispatch_wrapper)
