"""Turns the drivers' raw times and byte counts into suite tables, goal checks and markdown.

Ratios (efficiency, overhead) are taken per round, between runs that were timed next to each other,
and then the median over rounds: slow drift of a shared machine cancels out instead of landing on
whichever layout happened to run during it. Rounds in which other processes took a noticeable share
of the cores (machine.py) are left out when enough clean rounds remain; each table says how many
rounds it used.
"""

from __future__ import annotations

import statistics

from .analytic import ModelDims, min_bytes_per_step, work_ceiling
from .layouts import LAYOUTS, SUITES, Layout

CLEAN_LOAD = 0.2  # cores other processes may have used during every run of a round for it to count as clean
MIN_CLEAN_ROUNDS = 3

GOALS = (  # (layout, metric, target, comparison peer or None)
    ("xdit-1", "overhead", 0.02, None),
    ("xdit-ulysses2", "efficiency", 0.90, "diffusers-cp-ulysses2"),
    ("xdit-cfg2", "efficiency", 0.95, None),
)


def spread(times: list[float]) -> float:
    """(max − min) / median: the whole range of the runs, relative."""
    return (max(times) - min(times)) / statistics.median(times)


def per_round_efficiency(layout: Layout, times: list[float], baseline_times: list[float]) -> list[float]:
    """Jobs done per rank-second relative to the 1-rank baseline of the same round: replicas·T(1) / (N·T(N))."""
    return [layout.replicas * t1 / (layout.ranks * t) for t1, t in zip(baseline_times, times)]


def layout_row(name: str, job: dict[str, dict], dims: ModelDims, steps: int, job_ranks: int) -> dict:
    layout = LAYOUTS[name]
    times = job[name]["times_s"]
    efficiency = per_round_efficiency(layout, times, job[layout.baseline]["times_s"])
    row = {
        "layout": name,
        "description": layout.describe(),
        "ranks": layout.ranks,
        "job_ranks": job_ranks,
        "times_s": times,
        "median_s": statistics.median(times),
        "spread": spread(times),
        "step_ms": 1000 * statistics.median(times) / steps,
        "efficiency": statistics.median(efficiency),
        "efficiency_rounds": efficiency,
        "work_ceiling": work_ceiling(layout, LAYOUTS[layout.baseline], dims),
        "bytes_per_step": statistics.mean(job[name]["bytes_per_step_per_rank"]),
        "bytes_per_step_analytic": min_bytes_per_step(layout, dims),
        "max_abs_diff": job[name]["max_abs_diff"],
        "foreign_cores": statistics.median(job[name]["foreign_cores"]),
    }
    calibration = f"diffusers-1-x{job_ranks}"
    if layout.ranks > 1 and layout.replicas == 1 and calibration in job:
        ceiling = per_round_efficiency(LAYOUTS[calibration], job[calibration]["times_s"], job["diffusers-1"]["times_s"])
        row["vs_hardware"] = statistics.median(e / c for e, c in zip(efficiency, ceiling))
    return row


def clean_rounds(job: dict[str, dict]) -> tuple[dict[str, dict], dict]:
    """The job's results restricted to its clean rounds, if at least MIN_CLEAN_ROUNDS are, else all of them."""
    total = len(next(iter(job.values()))["times_s"])
    clean = [i for i in range(total) if all(raw["foreign_cores"][i] < CLEAN_LOAD for raw in job.values())]
    used = clean if len(clean) >= MIN_CLEAN_ROUNDS else list(range(total))
    kept = {
        name: {**raw, **{key: [raw[key][i] for i in used] for key in ("times_s", "foreign_cores")}}
        for name, raw in job.items()
    }
    return kept, {"used": len(used), "of": total, "clean_only": used == clean}


def suite_table(suite: str, jobs: dict[int, dict], skipped: dict[str, str], dims: ModelDims, steps: int) -> dict:
    """Rows for every layout of `suite` that ran (baselines from the same job), one line for each that could not."""
    rows, rounds, kept_jobs = [], {}, {}
    for job_ranks, names in SUITES[suite].items():
        if job_ranks not in jobs:
            continue
        job, rounds[job_ranks] = clean_rounds(jobs[job_ranks])
        kept_jobs[job_ranks] = job
        rows += [layout_row(name, job, dims, steps, job_ranks) for name in names if name in job]
    names = {n for names in SUITES[suite].values() for n in names}
    table = {"rows": rows, "rounds": rounds, "skipped": {name: why for name, why in skipped.items() if name in names}}
    if suite == "overhead" and "xdit-1" in kept_jobs.get(1, {}):
        ratios = [a / b for a, b in zip(kept_jobs[1]["xdit-1"]["times_s"], kept_jobs[1]["diffusers-1"]["times_s"])]
        table["overhead"] = statistics.median(ratios) - 1
    return table


def goals(tables: dict[str, dict]) -> list[dict]:
    """Each goal whose layout was measured: value, target, the peer's value where there is one, met, and
    whether it rests on clean rounds only (if not, other processes shared the cores while it was timed)."""
    results = []
    found = {row["layout"]: (row, table) for table in tables.values() for row in table["rows"]}
    for name, metric, target, peer in GOALS:
        if name not in found:
            continue
        row, table = found[name]
        value = table["overhead"] if metric == "overhead" else row[metric]
        met = value <= target if metric == "overhead" else value >= target
        clean = table["rounds"][row["job_ranks"]]["clean_only"]
        goal = {"layout": name, "metric": metric, "value": value, "target": target, "clean": clean}
        if peer in found:
            goal["peer"], goal["peer_value"] = peer, found[peer][0][metric]
            met = met and value >= goal["peer_value"]
        results.append({**goal, "met": met})
    return results


COLUMNS = ("| layout | job ranks | median s | ms/step | spread | efficiency | vs hardware | work ceiling "
           "| KiB/step/rank (analytic) | other load | max abs Δ |")


def _markdown_row(r: dict) -> str:
    cells = [
        r["description"], r["job_ranks"], f"{r['median_s']:.3f}", f"{r['step_ms']:.0f}",
        f"{100 * r['spread']:.0f}%",
        f"{r['efficiency']:.3f}", f"{r['vs_hardware']:.3f}" if "vs_hardware" in r else "–",
        f"{r['work_ceiling']:.3f}",
        f"{r['bytes_per_step'] / 1024:.0f} ({r['bytes_per_step_analytic'] / 1024:.0f})",
        f"{r['foreign_cores']:.2f} cores", f"{r['max_abs_diff']:.1e}",
    ]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(tables: dict[str, dict], goal_list: list[dict], meta: dict) -> str:
    lines = [
        f"model {meta['model']}: {meta['height']}×{meta['width']}, {meta['image_tokens']} image + "
        f"{meta['text_tokens']} text tokens, {meta['steps']} steps, {meta['runs']} runs, "
        f"{meta['threads_per_rank']} thread per rank, {meta['cores']} cores, {meta['backend']} on {meta['device']}"
        + (f", each round waited up to {meta['settle_s']:g} s for other load to pass" if meta["settle_s"] else ""),
    ]
    for suite, table in tables.items():
        lines += ["", f"### {suite}", "", COLUMNS, "|---|" + "---:|" * (COLUMNS.count("|") - 2)]
        lines += [_markdown_row(r) for r in table["rows"]]
        for ranks, r in table["rounds"].items():
            why = f"other processes under {CLEAN_LOAD} cores" if r["clean_only"] else "too few clean rounds: all kept"
            lines += ["", f"{ranks}-rank job: {r['used']} of {r['of']} rounds used ({why})"]
        if "overhead" in table:
            lines += ["", f"wrapper overhead at 1 rank: {100 * table['overhead']:+.2f}% (paired median)"]
        lines += [f"- skipped {name}: {reason}" for name, reason in table["skipped"].items()]
    if goal_list:
        lines += ["", "### goals", ""]
        for g in goal_list:
            peer = f", {g['peer']} {g['peer_value']:.3f}" if "peer" in g else ""
            relation = "≤" if g["metric"] == "overhead" else "≥"
            noisy = "" if g["clean"] else " (measured while other processes shared the cores)"
            lines.append(f"- {g['layout']} {g['metric']} {g['value']:.3f} ({relation} {g['target']}{peer}): "
                         f"{'met' if g['met'] else 'MISSED'}{noisy}")
    return "\n".join(lines)
