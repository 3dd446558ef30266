"""scripts/gpu_check.sh's numbers as a section of bench/RESULTS.md, headed with the card's name.

    python -m bench.gpu_report RESULTS_DIR --card NAME --seconds S [--results bench/RESULTS.md]

RESULTS_DIR holds what the check wrote: junit.xml (tests/gpu), tests.json (their measurements, tests/gpu/conftest.py's
`record`), pool_overhead.json, quantized_storage.json, fp8_linear.json, link_table.json (each bench's --json); a missing one is a
stage that did not finish, and its rows say so. The section replaces an earlier one of the same card, so a rerun
updates the file instead of growing it. Goals are issue #38's: the 1-rank pool within 2% of diffusers in-process,
fp8 matmuls at least 1.3× faster than bf16 per step, the whole check under 8 minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
BUDGET_S = 480


def _load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


def _tests(folder: Path) -> tuple[str, bool]:
    path = folder / "junit.xml"
    if not path.is_file():
        return "did not finish (no junit.xml)", False
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    cases = suite.findall("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    text = f"{len(cases) - len(failed)} of {len(cases)} passed in {float(suite.get('time', 0)):.0f} s"
    return text + (f"; failed: {', '.join(failed)}" if failed else ""), not failed and bool(cases)


def rows(folder: Path, seconds: float) -> list[tuple[str, str, str]]:
    """(what, result, goal) rows of the section."""
    tests_text, _ = _tests(folder)
    measured = _load(folder, "tests.json") or {}
    out = [("tests/gpu (pytest)", tests_text, "all pass")]
    pool = _load(folder, "pool_overhead.json")
    if pool:
        r = pool["rows"]
        split = (f"; rank 0's steps {r['pool']['steps_on_rank_s']:.3f} s, outside them {r['pool']['outside_steps_s']:.3f} s"
                 if "steps_on_rank_s" in r["pool"] else "")
        out.append((f"1-rank pool (NCCL, bf16) vs the same pipeline in-process, {pool['model']}, {pool['steps']} steps",
                    f"{r['pool']['overhead'] * 100:+.1f}% ({r['in-process']['median_s']:.3f} s in-process, "
                    f"{r['pool']['median_s']:.3f} s pool{split}; previews {r['pool + previews']['overhead'] * 100:+.1f}%)",
                    "≤ 2%"))
    else:
        out.append(("1-rank pool vs in-process", "did not finish", "≤ 2%"))
    if "pool_bf16_relative_l2_from_fp32" in measured:
        out.append(("pool bf16, relative L2 from diffusers fp32 (diffusers' own bf16)",
                    f"{measured['pool_bf16_relative_l2_from_fp32']:.2e} ({measured['diffusers_bf16_relative_l2_from_fp32']:.2e})",
                    "≤ 1.5× diffusers' own"))
    storage = _load(folder, "quantized_storage.json")
    if storage:
        r, bf16 = storage["rows"], storage["rows"]["bf16"]["step_s"]
        if storage.get("blocks"):
            out.append(("quantized files: the model", f"{storage['model']} with {storage['blocks'][0]} double and "
                        f"{storage['blocks'][1]} single blocks", "—"))
        for name in ("fp8_scaled", "gguf_q8_0"):
            out.append((f"{name} file kept quantized: bytes ÷ bf16, step ÷ bf16, relative L2 to bf16",
                        f"{r[name]['ratio_to_bf16']:.3f}, {r[name]['step_s'] / bf16:.2f}, {r[name]['relative_l2_to_bf16']:.1e}", "—"))
        if "fp8_matmul" in r:
            fast = r["fp8_matmul"]
            out.append(("fp8 matmul (`--fp8-matmul`) vs bf16: transformer step, speed-up, relative L2 to bf16",
                        f"{fast['step_s']:.3f} s vs {bf16:.3f} s: {bf16 / fast['step_s']:.2f}×, {fast['relative_l2_to_bf16']:.1e} "
                        f"(dequantizing fp8: {bf16 / r['fp8_scaled']['step_s']:.2f}×)", "≥ 1.3×"))
        else:
            out.append(("fp8 matmul vs bf16", "not run: this card has no fp8 tensor cores", "≥ 1.3×"))
    else:
        out.append(("fp8 / GGUF storage and fp8 matmul vs bf16", "did not finish", "≥ 1.3×"))
    for key, what, goal in (("cancel_latency_s", "cancel inside a job: cancel to the pool's reply, s", "< 2 s"),
                            ("compile_relative_l2_from_fp32", "`--compile`, relative L2 from fp32", "≤ 1.5× diffusers' own"),
                            ("vae_decode_relative_l2", "xDiT VAE Decode vs the pipeline's VAE, relative L2", "≤ 1e-2"),
                            ("model_call_euler_relative_l2_to_diffusers_bf16", "xDiT Model calls (Euler on the client) vs "
                             "diffusers bf16, relative L2", "≤ 1.5× diffusers' own")):
        if key in measured:
            out.append((what, f"{measured[key]:.3g}", goal))
    if "peak_memory_qwen_width_1328" in measured:
        m = measured["peak_memory_qwen_width_1328"]
        out.append(("peak memory of a call (Qwen-Image width, 2 blocks, 1328²) vs bench.memory_table",
                    f"{m['measured_bytes'] / 2**30:.2f} GiB measured, {m['predicted_bytes'] / 2**30:.2f} GiB predicted: "
                    f"{m['ratio']:.2f}", "0.75–1.33"))
    linear = _load(folder, "fp8_linear.json")
    if linear:
        speedups = [r["fp8"].get("speedup_on_card", r["fp8"]["speedup"]) for r in linear["rows"].values()]
        out.append((f"fp8 matmul, one FLUX.1-dev projection at a time ({linear['tokens']} tokens, bench.fp8_linear): "
                    "speed-up over bf16 on the card", f"{min(speedups):.2f}× to {max(speedups):.2f}× (table below)", "≥ 1.3×"))
    if "fp8_matmul" in measured:
        m = measured["fp8_matmul"]
        out.append(("fp8 matmul on the card (tests): activation scaling, layers, relative L2 from fp32",
                    f"{m['mode']}, {m['layers']}, {m['relative_l2_from_fp32']:.2e}", "≤ 5e-2"))
    flash = measured.get("flash_attn")
    out.append(("flash-attn", flash or "not installed here (an optional extra built for the machine's CUDA)", "—"))
    link = _load(folder, "link_table.json")
    out.append(("bench.link_table calibrated", f"blocks measured on {link['blocks_measured_on']}, saved to "
                "bench/link_table_blocks.json" if link else "did not finish", "—"))
    out.append(("the whole check, wall time", f"{seconds:.0f} s", f"< {BUDGET_S} s"))
    return out


def section(folder: Path, card: str, seconds: float, torch_version: str = "") -> str:
    day = datetime.date.today().isoformat()
    lines = [f"<!-- gpu_check: {card} -->", f"## GPU check on {card} (`bash scripts/gpu_check.sh`, {day}{', torch ' + torch_version if torch_version else ''})",
             "", "| check | result | goal |", "|---|---|---|"]
    lines += [f"| {what} | {result} | {goal} |" for what, result, goal in rows(folder, seconds)]
    link = _load(folder, "link_table.json")
    if link:
        lines += ["", "`bench.link_table` from the blocks measured here (compute) and published link bandwidths:", "",
                  "| model, GPUs | link | layout | ms per step | speed-up |", "|---|---|---|---:|---:|"]
        lines += [f"| {r['model']}, {r['gpus']} | {r['link']} | {r['layout']} | {r['step_ms']:.0f} | {r['speedup']:.1f}× |"
                  for r in link["rows"]]
    linear = _load(folder, "fp8_linear.json")
    if linear:
        from .fp8_linear import table

        lines += ["", "`bench.fp8_linear`:", ""] + table(linear)
    return "\n".join(lines) + "\n"


PLACEHOLDER = "## GPU check (`bash scripts/gpu_check.sh`): ready, awaiting a lent GPU"


def write(results: Path, card: str, text: str) -> None:
    """Put `text` in place of the card's earlier section, or at the end (the waiting note goes: a card has run it)."""
    old = results.read_text() if results.is_file() else "# Benchmark results\n"
    old = re.sub(re.escape(PLACEHOLDER) + r".*?(?=\n## |\n<!-- gpu_check: |\Z)", "", old, flags=re.S)
    marker = f"<!-- gpu_check: {card} -->"
    pattern = re.compile(re.escape(marker) + r".*?(?=\n<!-- gpu_check: |\n## (?!GPU check on " + re.escape(card) + r")|\Z)",
                         re.S)
    results.write_text(pattern.sub(lambda _: text.rstrip("\n"), old) if marker in old else old.rstrip("\n") + "\n\n" + text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--card", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--torch", default="")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    text = section(args.folder, args.card, args.seconds, args.torch)
    write(args.results, args.card, text)
    print(text)
    _, passed = _tests(args.folder)
    return 0 if passed and args.seconds < BUDGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
