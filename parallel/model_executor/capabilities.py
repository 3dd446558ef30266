"""One table of what each supported pipeline can do, derived from the registers and plans."""

from __future__ import annotations

import inspect

from .plans import CfgMode
from .register import (
    xFuserPipelineWrapperRegister,
    xFuserSchedulerWrappersRegister,
    xFuserTransformerWrappersRegister,
)


def _transformer_class_of(pipeline_cls: type) -> type | None:
    annotation = inspect.signature(pipeline_cls.__init__).parameters.get("transformer")
    return annotation.annotation if annotation and isinstance(annotation.annotation, type) else None


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
        rows.append(f"| {pipeline_cls.__name__} | {name} | {sp} | {sp} | {cfg} | yes | no |")
    rows.append("")
    rows.append(f"Schedulers: {schedulers}.")
    return "\n".join(rows)
