"""One table of what each supported pipeline can do, derived from the families' plans."""

from __future__ import annotations

from ..families import FAMILIES
from .plans import CfgMode
from .register import xFuserSchedulerWrappersRegister
from .step_cache import cache_refusal


def capability_table() -> str:
    """A markdown table: pipeline, transformer, what each parallel method does for it, and the schedulers. Data
    parallel and weight sharding work for every pipeline (they need nothing of the plan), so they have no column."""
    from . import scheduler  # noqa: F401 - registers the scheduler wrappers

    rows = ["| pipeline | transformer | sequence parallel (Ulysses, Ring, USP) | cfg parallel | pipefusion | step cache |",
            "|---|---|---|---|---|---|"]
    entries = sorted(((p, f) for f in FAMILIES for p in f.pipelines), key=lambda entry: entry[0])
    for pipeline, family in entries:
        plan = family.plan
        sp = "yes" if plan.sequence_parallel else "no"
        if plan.sequence_parallel and plan.replicated:
            sp += f" ({', '.join(dict.fromkeys(r.stream for r in plan.replicated.values()))} replicated)"
        cfg = "yes (batched)" if plan.cfg is CfgMode.BATCHED else "yes (two calls)"
        pipefusion = ((f"no: {plan.no_pipefusion}" if plan.no_pipefusion else "no") if plan.pipefusion is None else
                      "yes, patches flow across steps" if plan.pipefusion.flow is not None else "yes")
        rows.append(f"| {pipeline} | {family.transformer} | {sp} | {cfg} | {pipefusion} | {step_caches(family.transformer)} |")
    rows.append("")
    rows.append("Data parallel: every pipeline. "
                f"Schedulers: {', '.join(xFuserSchedulerWrappersRegister.supported_names())}.")
    return "\n".join(rows)


def step_caches(transformer: str) -> str:
    """The --cache methods diffusers' hooks take on this transformer, and why the others are refused (the engine
    refuses them with the same reason, step_cache.check_cache)."""
    import diffusers

    cls = getattr(diffusers, transformer)
    refused = {method: cache_refusal(cls, method) for method in ("first-block", "taylorseer")}
    taken = [method for method, why in refused.items() if not why]
    if not taken:
        return f"no: {refused['taylorseer']}"
    return ", ".join(taken) + "".join(f" (not {method}: {why})" for method, why in refused.items() if why)
