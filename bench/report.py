"""Turns the drivers' raw times and byte counts into suite tables, goal checks and markdown.

Ratios (efficiency, overhead) are taken per round, between runs that were timed next to each other,
and then the median over rounds: slow drift of a shared machine cancels out instead of landing on
whichever layout happened to run during it.
"""

from __future__ import annotations

import statistics

from .analytic import ModelDims, min_bytes_per_step, work_ceiling
from .layouts import LAYOUTS, SUITES

GOALS = (  # (suite, layout, metric, target, comparison peer or None)
    ("overhead", "xdit-1", "overhead", 0.02, None),
    ("efficiency", "xdit-ulysses2", "efficiency", 0.90, "diffusers-cp-ulysses2"),
    ("efficiency", "xdit-cfg2", "efficiency", 0.95, None),
)


def spread(times: list[float]) -> float:
    """(max − min) / median: the whole range of the runs, relative."""
    return (max(times) - min(times)) / statistics.median(times)


def paired_median(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def layout_row(name: str, raw: dict, baseline: dict, dims: ModelDims, steps: int, job_ranks: int) -> dict:
    layout = LAYOUTS[name]
    times = raw["times_s"]
    return {
        "layout": name,
        "description": layout.describe(),
        "ranks": layout.ranks,
        "job_ranks": job_ranks,
        "median_s": statistics.median(times),
        "spread": spread(times),
        "step_ms": 1000 * statistics.median(times) / steps,
        "efficiency": paired_median(baseline["times_s"], [layout.ranks * t for t in times]),
        "work_ceiling": work_ceiling(layout, LAYOUTS[layout.baseline], dims),
        "bytes_per_step": statistics.mean(raw["bytes_per_step_per_rank"]),
        "bytes_per_step_analytic": min_bytes_per_step(layout, dims),
        "max_abs_diff": raw["max_abs_diff"],
    }


def suite_table(suite: str, jobs: dict[int, dict[str, dict]], skipped: dict[str, str], dims: ModelDims, steps: int) -> dict:
    """Rows for every layout of `suite` that ran (baselines from the same job), one line for each that could not."""
    rows = []
    for job_ranks, names in SUITES[suite].items():
        raw = jobs.get(job_ranks, {})
        rows += [
            layout_row(name, raw[name], raw[LAYOUTS[name].baseline], dims, steps, job_ranks)
            for name in names
            if name in raw
        ]
    names = {n for names in SUITES[suite].values() for n in names}
    table = {"rows": rows, "skipped": {name: why for name, why in skipped.items() if name in names}}
    if suite == "overhead" and "xdit-1" in jobs.get(1, {}):
        table["overhead"] = paired_median(jobs[1]["xdit-1"]["times_s"], jobs[1]["diffusers-1"]["times_s"]) - 1
    return table


def goals(tables: dict[str, dict]) -> list[dict]:
    """Each goal whose layout was measured: value, target, the peer's value where there is one, met."""
    results = []
    rows = {row["layout"]: row for table in tables.values() for row in table["rows"]}
    for suite, name, metric, target, peer in GOALS:
        if name not in rows:
            continue
        value = tables[suite][metric] if metric == "overhead" else rows[name][metric]
        met = value <= target if metric == "overhead" else value >= target
        goal = {"layout": name, "metric": metric, "value": value, "target": target}
        if peer in rows:
            goal["peer"], goal["peer_value"] = peer, rows[peer][metric]
            met = met and value >= rows[peer][metric]
        results.append({**goal, "met": met})
    return results


def markdown(tables: dict[str, dict], goal_list: list[dict], meta: dict) -> str:
    lines = [
        f"model {meta['model']}: {meta['height']}×{meta['width']}, {meta['image_tokens']} image + "
        f"{meta['text_tokens']} text tokens, {meta['steps']} steps, {meta['runs']} runs, "
        f"{meta['threads_per_rank']} thread per rank, {meta['cores']} cores, gloo",
    ]
    for suite, table in tables.items():
        lines += ["", f"### {suite}", "",
                  "| layout | job ranks | median s | ms/step | spread | efficiency | work ceiling | KiB/step/rank | analytic KiB | max abs Δ |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in table["rows"]:
            lines.append(
                f"| {r['description']} | {r['job_ranks']} | {r['median_s']:.3f} | {r['step_ms']:.0f} | {100 * r['spread']:.1f}% "
                f"| {r['efficiency']:.3f} | {r['work_ceiling']:.3f} | {r['bytes_per_step'] / 1024:.1f} "
                f"| {r['bytes_per_step_analytic'] / 1024:.1f} | {r['max_abs_diff']:.1e} |"
            )
        if "overhead" in table:
            lines += ["", f"wrapper overhead at 1 rank: {100 * table['overhead']:+.2f}% (paired median)"]
        lines += [f"- skipped {name}: {reason}" for name, reason in table["skipped"].items()]
    if goal_list:
        lines += ["", "### goals", ""]
        for g in goal_list:
            peer = f", {g['peer']} {g['peer_value']:.3f}" if "peer" in g else ""
            relation = "≤" if g["metric"] == "overhead" else "≥"
            lines.append(f"- {g['layout']} {g['metric']} {g['value']:.3f} ({relation} {g['target']}{peer}): "
                         f"{'met' if g['met'] else 'MISSED'}")
    return "\n".join(lines)
