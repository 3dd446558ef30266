"""`python -m bench SUITE`: launch the torchrun jobs a suite needs, then print and save its tables.

    python -m bench {overhead,efficiency,diffusers-cp,all} [--runs 5] [--json OUT.json] [--tiny | --large]
                    [--settle SECONDS] [--max-ranks N] [--link pcie4 [--gpu-tflops 400]]

Each job is `torchrun --nproc-per-node N -m bench.driver` with one thread per rank. A job needing more
ranks than this machine has cores is skipped with a one-line reason: oversubscribed ranks would time
the scheduler, not the engine (--max-ranks overrides, e.g. to exercise the code path). On GPUs every rank
runs on its own device in bf16 (NCCL): give `--large --max-ranks` the number of GPUs.
`all` writes bench/out/results.json unless --json says otherwise. This process imports neither torch
nor diffusers: it launches the jobs and does the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command
from parallel.layout.config import LINKS

from . import machine, report
from .analytic import ModelDims
from .layouts import LAYOUTS, SUITES, jobs_for

DEFAULT_JSON = ROOT / "bench" / "out" / "results.json"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=[*SUITES, "all"])
    parser.add_argument("--runs", type=int, default=5, help="timed rounds per layout (after one warm-up)")
    parser.add_argument("--json", type=Path, default=None, help=f"write results here (all: default {DEFAULT_JSON})")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true",
                      help="the tiny test model: checks the machinery, times nothing useful")
    size.add_argument("--large", action="store_true",
                      help="FLUX.1-dev's width with 12 of its blocks at 1024² (for GPUs)")
    parser.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="before each round, wait up to this long for other processes to leave the cores idle")
    parser.add_argument("--max-ranks", type=int, default=len(os.sched_getaffinity(0)),
                        help="default: the cores available")
    parser.add_argument("--link", choices=list(LINKS), default=None,
                        help="time every call with its collectives delayed as this link would delay them, relative to "
                             "the GPU of --gpu-tflops (bench/emulated_link.py); default: this machine's own loopback")
    parser.add_argument("--gpu-tflops", type=float, default=400.0,
                        help="with --link: the dense bf16 TFLOP/s of the GPU the link joins (default 400, an H100's)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def run_job(ranks: int, names: list[str], model: str, args: argparse.Namespace, workdir: Path) -> dict:
    spec, result = workdir / f"spec{ranks}.json", workdir / f"result{ranks}.json"
    link = {"name": args.link, "gpu_tflops": args.gpu_tflops} if args.link else None
    spec.write_text(json.dumps({"model": model, "layouts": names, "runs": args.runs, "settle_s": args.settle, "link": link}))
    command = torchrun_command(ranks, "-m", "bench.driver", str(spec), str(result))
    print(f"$ {' '.join(command[1:])}   # {', '.join(names)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=ROOT, env=rank_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench job on {ranks} ranks failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    model_key = "tiny" if args.tiny else "large" if args.large else "medium"
    jobs, skipped, meta = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-") as workdir:
        for ranks, names in sorted(jobs_for(suites).items()):
            if ranks > args.max_ranks:
                reason = (f"needs {ranks} ranks with a core (or GPU) each; --max-ranks is {args.max_ranks} "
                          f"(this machine's cores by default; --max-ranks {ranks} runs it oversubscribed)")
                skipped.update({name: reason for name in names if LAYOUTS[name].engine != "diffusers"})
                continue
            result = run_job(ranks, names, model_key, args, Path(workdir))
            meta = result["meta"]
            jobs[ranks] = {name: raw for name, raw in result["layouts"].items() if "unavailable" not in raw}
            skipped.update({n: raw["unavailable"] for n, raw in result["layouts"].items() if "unavailable" in raw})
    if not meta:
        raise SystemExit(f"nothing ran: every job of {args.suite} needs more than --max-ranks {args.max_ranks} ranks")

    dims = ModelDims(**meta["dims"])
    tables = {suite: report.suite_table(suite, jobs, skipped, dims, meta["steps"]) for suite in suites}
    summary = {
        "meta": {
            "command": "python -m bench " + " ".join(sys.argv[1:] if argv is None else argv),
            **{key: meta[key] for key in ("model", "height", "width", "steps", "threads_per_rank", "backend", "device",
                                          "link", "cpu_tflops")},
            "image_tokens": dims.image_tokens, "text_tokens": dims.text_tokens,
            "runs": args.runs, "settle_s": args.settle,
            "cores": len(os.sched_getaffinity(0)), "cpu": machine.cpu_model(),
            "torch": version("torch"), "diffusers": version("diffusers"),
        },
        "suites": tables,
        "goals": report.goals(tables),
        "raw": jobs,  # per job: every layout's times, other load and bytes per round, for re-analysis
    }
    print(report.markdown(tables, summary["goals"], summary["meta"]))
    target = args.json or (DEFAULT_JSON if args.suite == "all" else None)
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(summary, indent=1))
        print(f"\nwrote {target}", file=sys.stderr)
    return 0
