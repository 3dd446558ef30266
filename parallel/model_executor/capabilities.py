"""One table of what each supported pipeline can do, derived from the registers and plans."""

from __future__ import annotations

import inspect
import typing

from .plans import CfgMode
from .register import (
    xFuserPipelineWrapperRegister,
    xFuserSchedulerWrappersRegister,
    xFuserTransformerWrappersRegister,
)


def _transformer_class_of(pipeline_cls: type) -> type | None:
    annotation = inspect.signature(pipeline_cls.__init__).parameters.get("transformer")
    if annotation is None:
        return None
    # Optional transformers (Wan 2.2 may have only transformer_2) are annotated `X | None`.
    candidates = typing.get_args(annotation.annotation) or (annotation.annotation,)
    return next((c for c in candidates if isinstance(c, type) and c is not type(None)), None)


def capability_table() -> str:
    """A markdown table: pipeline, transformer, ulysses/ring/cfg/dp/pipefusion support, schedulers."""
    transformers = dict(xFuserTransformerWrappersRegister.items())
    schedulers = ", ".join(xFuserSchedulerWrappersRegister.supported_names())
    rows = ["| pipeline | transformer | ulysses | ring | cfg parallel | dp | pipefusion |", "|---|---|---|---|---|---|---|"]
    for pipeline_cls, _ in sorted(xFuserPipelineWrapperRegister.items(), key=lambda item: item[0].__name__):
        transformer_cls = _transformer_class_of(pipeline_cls)
        wrapper = transformers.get(transformer_cls)
        plan = wrapper.plan if wrapper else None
        sp = "yes" if plan and plan.sequence_parallel else "no"
        cfg = ("yes (batched)" if plan.cfg is CfgMode.BATCHED else "yes (two calls)") if plan else "no"
        name = transformer_cls.__name__ if transformer_cls else "?"
        pipefusion = "yes" if plan and plan.pipefusion else "no"
        rows.append(f"| {pipeline_cls.__name__} | {name} | {sp} | {sp} | {cfg} | yes | {pipefusion} |")
    rows.append("")
    rows.append(f"Schedulers: {schedulers}.")
    return "\n".join(rows)
