"""One table of what each supported pipeline can do, derived from the families' plans."""

from __future__ import annotations

from ..families import FAMILIES
from .plans import CfgMode
from .register import xFuserSchedulerWrappersRegister


def capability_table() -> str:
    """A markdown table: pipeline, transformer, ulysses/ring/cfg/dp/pipefusion support, schedulers."""
    from . import schedulers  # noqa: F401 - registers the scheduler wrappers

    rows = ["| pipeline | transformer | ulysses | ring | cfg parallel | dp | pipefusion |", "|---|---|---|---|---|---|---|"]
    entries = sorted(((p, f) for f in FAMILIES for p in f.pipelines), key=lambda entry: entry[0])
    for pipeline, family in entries:
        plan = family.plan
        sp = "yes" if plan.sequence_parallel else "no"
        cfg = "yes (batched)" if plan.cfg is CfgMode.BATCHED else "yes (two calls)"
        pipefusion = "yes" if plan.pipefusion else "no"
        rows.append(f"| {pipeline} | {family.transformer} | {sp} | {sp} | {cfg} | yes | {pipefusion} |")
    rows.append("")
    rows.append(f"Schedulers: {', '.join(xFuserSchedulerWrappersRegister.supported_names())}.")
    return "\n".join(rows)
