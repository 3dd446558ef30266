"""fp8 matmuls, one linear layer at a time: where `--fp8-matmul` gains or loses against bf16 on this card.

    python -m bench.fp8_linear [--tokens 4608] [--iters 50] [--json bench/out/fp8_linear.json]

FLUX.1-dev's projections at 1024² (4,608 tokens: 4,096 image + 512 text; width 3,072), the sides one after
another on the same inputs, each timed two ways: `launched`, CUDA events around one call as the model makes it
(the CPU's launch and guard costs show where they exceed the kernels'), and `on the card`, the call replayed from a
CUDA graph (the kernels alone). Median ms of `--iters`, after a warm-up. The sides:
- `bf16`: F.linear on bf16 weights, what a bf16 file runs;
- `fp8`: parallel/loading/checkpoints/fp8_matmul.py's `linear` on the same weights stored as float8_e4m3fn with
  a per-tensor scale, activations scaled per row (Hopper) by its default quantizer on CUDA;
- `fp8, per tensor`: the same with one activation scale (what Ada's `_scaled_mm` takes);
- the parts: `_scaled_mm` alone on activations quantized beforehand (the ceiling), with the bias in it, and each
  quantizer alone (fp8_rows' Triton kernel, torch.compile's fusion, the eager four passes).
Every fp8 side's relative L2 distance from bf16's output is reported, and each quantizer's codes against the eager
passes'. Needs a card with fp8 tensor cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from parallel.loading.checkpoints.fp8_matmul import E4M3, E4M3_MAX, HOW, hardware_mode, linear, quantize, quantizer

OUT = Path(__file__).resolve().parent / "out"
PROJECTIONS = {  # FLUX.1-dev's linear layers: (in, out)
    "attention q/k/v/out 3072→3072": (3072, 3072),
    "MLP up 3072→12288": (3072, 12288),
    "MLP down 12288→3072": (12288, 3072),
    "single block out 15360→3072": (15360, 3072),
}


def timed(fn, iters: int) -> dict:
    """Median ms of one call: `launched` (CUDA events around each call) and `on_card` (replayed from a CUDA graph,
    None where the call cannot be captured), after five warm-up calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    launched = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        launched.append(start.elapsed_time(end))
    on_card = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        on_card = statistics.median(times)
    except Exception as error:  # noqa: BLE001 - a side that cannot be captured is reported launched only
        print(f"bench.fp8_linear: no CUDA graph ({type(error).__name__}: {str(error)[:120]})", file=sys.stderr)
    return {"ms": statistics.median(launched), "on_card_ms": on_card}


def relative_l2(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def projection(tokens: int, features: tuple[int, int], mode: str, iters: int) -> dict:
    k, n = features
    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(tokens, k, device="cuda", generator=generator).bfloat16()
    weight = torch.randn(n, k, device="cuda", generator=generator) * k ** -0.5
    bias = torch.randn(n, device="cuda", generator=generator).bfloat16()
    scale = weight.abs().amax() / E4M3_MAX
    stored = (weight / scale).to(E4M3)
    w_bf16 = (stored.float() * scale).bfloat16()  # the file's weights as a bf16 file holds them
    reference = torch.nn.functional.linear(x, w_bf16, bias)
    fused = quantizer(x.device, mode)
    q, x_scale = fused(x)
    w_scale = scale.float().reshape(1, 1).expand(1, n).contiguous() if mode == "row" else scale.float()
    sides = {
        "bf16": lambda: torch.nn.functional.linear(x, w_bf16, bias),
        "fp8": lambda: linear(x, stored, scale, bias, mode),
        "fp8, per tensor": lambda: linear(x, stored, scale, bias, "tensor"),
        "_scaled_mm alone": lambda: torch._scaled_mm(q, stored.t(), scale_a=x_scale, scale_b=w_scale,
                                                     out_dtype=torch.bfloat16),
        "_scaled_mm with the bias": lambda: torch._scaled_mm(q, stored.t(), scale_a=x_scale, scale_b=w_scale,
                                                             bias=bias, out_dtype=torch.bfloat16),
        **{f"quantizer, {how}": (lambda how=how: quantizer(x.device, mode, how)(x)) for how in HOW},
    }
    row = {}
    for name, fn in sides.items():
        try:
            row[name] = timed(fn, iters)
        except Exception as error:  # noqa: BLE001 - e.g. a bias _scaled_mm does not take with this scaling
            row[name] = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
    for name in ("fp8", "fp8, per tensor", "_scaled_mm with the bias"):
        if "ms" in row[name]:
            row[name]["relative_l2_to_bf16"] = relative_l2(sides[name](), reference)
            row[name]["speedup"] = row["bf16"]["ms"] / row[name]["ms"]
            if row[name]["on_card_ms"] and row["bf16"]["on_card_ms"]:
                row[name]["speedup_on_card"] = row["bf16"]["on_card_ms"] / row[name]["on_card_ms"]
    q_eager, scale_eager = quantize(x, mode)
    for how in HOW:
        codes, scales = quantizer(x.device, mode, how)(x)
        step = (codes.view(torch.uint8).int() - q_eager.view(torch.uint8).int()).abs()
        row[f"quantizer, {how}"].update(codes_differing=(step > 0).float().mean().item(), most_codes_apart=step.max().item(),
                                        scales_equal=bool(torch.equal(scales, scale_eager)))
    return row


def _ms(side: dict) -> str:
    if "error" in side:
        return "–"
    return f"{side['ms']:.3f}" + (f" ({side['on_card_ms']:.3f})" if side.get("on_card_ms") else "")


def table(report: dict) -> list[str]:
    """The report (this bench's --json) as a markdown table, and each quantizer's codes against the eager passes'."""
    lines = [f"| projection ({report['tokens']} tokens, median ms of {report.get('iters', 50)}: launched (on the card)) | "
             f"bf16 | fp8 ({report['mode']}) | speed-up | fp8 (tensor) | _scaled_mm alone | with the bias | quantizer: "
             + " | ".join(HOW) + " | relative L2 to bf16 |", "|---|" + "---:|" * (7 + len(HOW))]
    for name, r in report["rows"].items():
        fp8 = r["fp8"]
        speedup = (f"{fp8['speedup']:.2f}×" + (f" ({fp8['speedup_on_card']:.2f}×)" if "speedup_on_card" in fp8 else "")
                   if "speedup" in fp8 else "–")
        lines.append(f"| {name} | {_ms(r['bf16'])} | {_ms(fp8)} | {speedup} | {_ms(r['fp8, per tensor'])} | "
                     f"{_ms(r['_scaled_mm alone'])} | {_ms(r['_scaled_mm with the bias'])} | "
                     + " | ".join(_ms(r[f"quantizer, {how}"]) for how in HOW)
                     + f" | {fp8.get('relative_l2_to_bf16', float('nan')):.1e} |")
    lines.append("")
    for name, r in report["rows"].items():
        lines.append(f"- {name}: " + "; ".join(
            f"{how} codes differing {r[f'quantizer, {how}'].get('codes_differing', float('nan')):.1e}, scales equal "
            f"{r[f'quantizer, {how}'].get('scales_equal')}" for how in HOW))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_linear", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4608)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", type=Path, default=OUT / "fp8_linear.json")
    args = parser.parse_args(argv)
    mode = hardware_mode(torch.device("cuda")) if torch.cuda.is_available() else None
    if mode is None:
        print("error: bench.fp8_linear needs a CUDA card with fp8 tensor cores (compute capability 8.9+)", file=sys.stderr)
        return 2
    rows = {name: projection(args.tokens, features, mode, args.iters) for name, features in PROJECTIONS.items()}
    card = torch.cuda.get_device_name()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"card": card, "tokens": args.tokens, "mode": mode, "iters": args.iters, "rows": rows},
                                    indent=2))
    print("\n".join(table({"card": card, "tokens": args.tokens, "mode": mode, "iters": args.iters, "rows": rows})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
