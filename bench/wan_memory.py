"""Per-rank activation memory of Wan video sampling: analytic for real shapes, measured on a mini model.

    python -m bench.wan_memory [--json OUT.json] [--no-measure]

Activation memory is what one transformer call holds beyond its weights: one rank's share of the
video tokens flowing through the blocks, plus the buffers of sequence-parallel attention. It is
linear in the tokens a rank holds (attention kernels keep no S×S matrix), so the analytic model
(`analytic_peak`) counts, phase by phase, the tensors alive at once per local token, following
diffusers' WanTransformerBlock and this engine's USP path; the peak is the largest phase.

The measurement runs a mini Wan transformer (4 heads of 32, FFN 2.7× as in Wan 14B, 2 blocks) in
bf16 with diffusers' fp32-kept modules, on real torchrun ranks, and counts every tensor that the
transformer call allocates (a TorchDispatchMode tracking live storages); the same analytic model,
evaluated at the mini shape, is printed next to it. CUDA's caching allocator would add fragmentation
on top; this counts tensors only.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command


@dataclass(frozen=True)
class WanDims:
    heads: int
    head_dim: int
    ffn: int
    layers: int
    text_tokens: int = 512
    experts: int = 1  # Wan 2.2 A14B: a high-noise and a low-noise transformer, both held by every rank

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def block_parameters(self) -> int:
        """Self- and cross-attention (q, k, v, out: 8·D²), FFN (2·D·F), the rest is small."""
        return self.layers * (8 * self.dim**2 + 2 * self.dim * self.ffn)


MODELS = {
    "Wan 2.2 A14B (Wan 2.1 14B: one expert)": WanDims(heads=40, head_dim=128, ffn=13824, layers=40, experts=2),
    "Wan2.1-T2V-1.3B": WanDims(heads=12, head_dim=128, ffn=8960, layers=30),
}
MINI = WanDims(heads=4, head_dim=32, ffn=346, layers=2, text_tokens=16)
# name: (ulysses, ring, cfg, dp); cfg and dp leave a rank's tokens whole (it runs one branch / one sample)
LAYOUTS = {
    "1 rank": (1, 1, 1, 1),
    "cfg2": (1, 1, 2, 1),
    "ulysses2": (2, 1, 1, 1),
    "ring2": (1, 2, 1, 1),
    "ulysses4": (4, 1, 1, 1),
    "ring4": (1, 4, 1, 1),
    "ulysses2×ring2": (2, 2, 1, 1),
    "cfg2×ulysses2": (2, 1, 2, 1),
    "ulysses8": (8, 1, 1, 1),
    "ulysses4×ring2": (4, 2, 1, 1),
    "cfg2×ulysses4": (4, 1, 2, 1),
}
MEASURED = ("1 rank", "cfg2", "ulysses2", "ring2", "ulysses4", "ring4", "ulysses2×ring2")


def video_tokens(frames: int, height: int, width: int) -> int:
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


# -- analytic --------------------------------------------------------------------------------------
def analytic_peak(dims: WanDims, tokens: int, ulysses: int, ring: int, act: int = 2) -> dict[str, float]:
    """Bytes one rank holds at each step of a transformer call that can be its peak, and the peak.

    The largest step is in block 0: the transformer's forward keeps the unsplit patch-embedded tokens
    in a local variable until block 0 returns (the split is a hook on block 0's input), and the token
    shards of the rotary table are views that keep the whole table alive. So every step starts from
    base = S·D·act + S·2·hd·4 (fp32 rotary cos and sin). With s = ⌈S / (ulysses·ring)⌉ local tokens,
    a = s·D·act one local activation and f = s·D·4 its fp32 copy (diffusers upcasts norms and
    residuals to fp32), the steps are, following WanTransformerBlock and this engine's USP:
    - cross-attention q RMSNorm: block input, the attn1 residual, attn2's input, attn1's output, q
      (4a), and RMSNorm's fp32 upcast, square and scale (3f). The text K/V (2·T·D·act) are replicated.
    - FFN: hidden, attn2's output, the FFN input (3a), up-projection and GELU output (2·s·F·act).
    - FFN residual: hidden, attn2's output, FFN input and output (4a); x.float() + y.float()·gate (3f).
    - USP, Ulysses all-to-all (ulysses > 1): attn1's input and q/k/v (4a); the stacked q/k/v, the
      all-to-all's send and receive buffers and its concatenation (4 × 3a).
    - USP, Ring (ring > 1): attn1's input, q/k/v and their stack or all-to-all result (7a); the query
      and local K/V joined with the (empty) text (3a); the K/V block in use and the one in flight
      (4a); the block's output (a); the fp32 running output, the block output upcast and the two
      rescaled terms of the log-sum-exp merge (4f).
    """
    s = math.ceil(tokens / (ulysses * ring))
    a, f = s * dims.dim * act, s * dims.dim * 4
    base = tokens * dims.dim * act + tokens * 2 * dims.head_dim * 4
    steps = {
        "cross-attn": base + 4 * a + 3 * f + 2 * dims.text_tokens * dims.dim * act,
        "ffn": base + 3 * a + 2 * s * dims.ffn * act,
        "residual": base + 4 * a + 3 * f,
    }
    if ulysses > 1:
        steps["ulysses"] = base + 4 * a + 12 * a
    if ring > 1:
        steps["ring"] = base + 7 * a + 3 * a + 4 * a + a + 4 * f
    peak_step = max(steps, key=steps.get)
    return {**steps, "peak": steps[peak_step], "peak_step": peak_step, "tokens_per_rank": s, "base": base}


# -- measurement -----------------------------------------------------------------------------------
def _tracker():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class LiveTensors(TorchDispatchMode):
        """Bytes of the storages that ops allocated and are still referenced; peak since `reset`."""

        def __init__(self):
            super().__init__()
            self.live: dict[int, list[int]] = {}
            self.now = self.peak = 0

        def reset(self) -> int:
            self.peak = self.now
            return self.now

        def _release(self, ptr: int) -> None:
            entry = self.live.get(ptr)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    self.now -= entry[0]
                    del self.live[ptr]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_flatten(out)[0]:
                if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                    continue
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if not ptr:
                    continue
                entry = self.live.get(ptr)
                if entry is None:
                    entry = self.live[ptr] = [storage.nbytes(), 0]
                    self.now += entry[0]
                    self.peak = max(self.peak, self.now)
                entry[1] += 1
                weakref.finalize(tensor, self._release, ptr)
            return out

    return LiveTensors()


def _save_mini(directory: Path) -> None:
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from parallel.loading import tiny_models
    from parallel.families.wan import tiny as wan

    tok, umt5 = wan.tiny_umt5(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=MINI.heads, attention_head_dim=MINI.head_dim, in_channels=16,
            out_channels=16, text_dim=tiny_models.T5_DIM, freq_dim=32, ffn_dim=MINI.ffn, num_layers=MINI.layers,
            cross_attn_norm=True, rope_max_seq_len=64,
        )
    WanPipeline(tokenizer=tok, text_encoder=umt5, vae=wan.tiny_vae(2), scheduler=wan.tiny_scheduler(),
                transformer=transformer).save_pretrained(directory)


def transformer_peak(pipeline, run, ignore=None) -> int:
    """Peak bytes that the transformer calls made during `run()` allocate beyond what existed at entry;
    `ignore`: a module whose parameters and buffers are never counted (views of weights are not activations)."""
    tracker, peaks = _tracker(), []
    for tensor in [*ignore.parameters(), *ignore.buffers()] if ignore is not None else []:
        tracker.live[tensor.untyped_storage().data_ptr()] = [0, 1 << 62]  # never released: counted as nothing
    transformer = getattr(pipeline.transformer, "module", pipeline.transformer)
    start = transformer.register_forward_pre_hook(lambda *a: peaks.append(-tracker.reset()))
    stop = transformer.register_forward_hook(lambda *a: peaks.__setitem__(-1, peaks[-1] + tracker.peak))
    try:
        with tracker:
            run()
    finally:
        start.remove(), stop.remove()
    return max(peaks)


def mini_inputs(batch: int, video: tuple[int, int, int]) -> dict:
    import torch

    frames, height, width = video
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, 16, (frames - 1) // 4 + 1, height // 8, width // 8, generator=generator)
    embeds = torch.randn(batch, MINI.text_tokens, 32, generator=generator)
    return {"latents": latents, "prompt_embeds": embeds, "negative_prompt_embeds": embeds, "num_inference_steps": 1,
            "guidance_scale": 5.0, "height": height, "width": width, "output_type": "latent", "return_dict": False}


def worker(spec_path: str) -> int:
    """torchrun entry: measure every layout of the spec whose world size is this launch's."""
    import torch

    from parallel.layout.config import ParallelConfig
    from parallel.distributed import destroy_distributed_environment, init_distributed_environment
    from parallel.loading.pipelines import load_pipeline
    from parallel.model_executor.layout_scope import under_layout

    spec = json.loads(Path(spec_path).read_text())
    world = init_distributed_environment()
    torch.set_num_threads(1)
    results = {}
    for name in spec["layouts"]:
        u, r, cfg, dp = LAYOUTS[name]
        if u * r * cfg * dp != world.world_size:
            continue
        pipeline = load_pipeline(spec["model"], dtype="bf16")
        inputs = mini_inputs(dp, tuple(spec["video"]))
        with under_layout(pipeline, ParallelConfig(ulysses_degree=u, ring_degree=r, cfg_degree=cfg, dp_degree=dp)) as parallel:
            with torch.no_grad():
                peak = transformer_peak(pipeline, lambda: parallel(**inputs))
            mine = torch.tensor([peak], dtype=torch.int64)
            every = [torch.zeros_like(mine) for _ in range(world.world_size)]
            torch.distributed.all_gather(every, mine)
        results[name] = [int(t) for t in every]
    if world.rank == 0:
        Path(spec["output"]).write_text(json.dumps(results))
    destroy_distributed_environment()
    return 0


def measure(frames: int, height: int, width: int) -> dict[str, list[int]]:
    """Per-rank peak activation bytes of one transformer call on the mini model, per layout."""
    results: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "mini"
        _save_mini(model)
        sizes = sorted({math.prod(LAYOUTS[name]) for name in MEASURED})
        for nproc in sizes:
            spec = Path(tmp) / f"spec{nproc}.json"
            output = Path(tmp) / f"out{nproc}.json"
            spec.write_text(json.dumps({"model": str(model), "layouts": MEASURED, "video": [frames, height, width],
                                        "output": str(output)}))
            run = subprocess.run(torchrun_command(nproc, "-m", "bench.wan_memory", "--worker", str(spec)),
                                 cwd=ROOT, env=rank_environment(), capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                raise RuntimeError(run.stderr[-3000:])
            results.update(json.loads(output.read_text()))
    return results


# -- report ----------------------------------------------------------------------------------------
def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _mib(value: float) -> str:
    return f"{value / 2**20:.3f}"


def report(measured: dict[str, list[int]] | None, mini_video: tuple[int, int, int]) -> tuple[str, dict]:
    real_video = (81, 480, 832)
    tokens = video_tokens(*real_video)
    lines = [
        f"## Wan, 81 frames 832×480: {tokens} video tokens (21 latent frames × 30 × 52), bf16, text 512 tokens",
        "",
        "Per-rank activation memory of one transformer call (GiB; weights not included).",
        "",
    ]
    data: dict = {"real": {}, "mini": {}}
    for model, dims in MODELS.items():
        lines += [f"### {model}: {dims.heads} heads × {dims.head_dim}, FFN {dims.ffn}, {dims.layers} blocks", "",
                  f"Weights on every rank (sequence, CFG and data parallel replicate them): "
                  f"{_gib(dims.block_parameters * 2)} GiB of bf16 block weights per transformer"
                  + (f", {_gib(dims.block_parameters * 2 * dims.experts)} GiB for {dims.experts} experts; only one "
                     "runs at a time, so activations are per transformer call." if dims.experts > 1 else "."), "",
                  "| layout | tokens/rank | unsplit block-0 input + rotary | ffn | USP step | peak (step) | vs 1 rank |",
                  "|---|---|---|---|---|---|---|"]
        base = analytic_peak(dims, tokens, 1, 1)["peak"]
        for name, (u, r, cfg, dp) in LAYOUTS.items():
            if dims.heads % u:
                lines.append(f"| {name} | – | {dims.heads} heads do not split over ulysses {u} | | | | |")
                continue
            a = analytic_peak(dims, tokens, u, r)
            data["real"].setdefault(model, {})[name] = a
            usp = max(a.get("ulysses", 0), a.get("ring", 0))
            lines.append(f"| {name} | {a['tokens_per_rank']} | {_gib(a['base'])} | {_gib(a['ffn'])} | "
                         f"{_gib(usp) if usp else '–'} | **{_gib(a['peak'])}** ({a['peak_step']}) | {a['peak'] / base:.2f} |")
        lines.append("")
    mini_tokens = video_tokens(*mini_video)
    lines += [f"## Measured: mini Wan ({MINI.heads}×{MINI.head_dim}, FFN {MINI.ffn}, bf16), "
              f"{mini_video[0]} frames {mini_video[2]}×{mini_video[1]} = {mini_tokens} tokens", "",
              "| layout | measured per rank (MiB) | analytic (MiB), peak step | measured / analytic |", "|---|---|---|---|"]
    for name in MEASURED:
        u, r, _, _ = LAYOUTS[name]
        model = analytic_peak(MINI, mini_tokens, u, r)
        a = model["peak"]
        if measured and name in measured:
            ranks = measured[name]
            data["mini"][name] = {"measured": ranks, "analytic": a}
            shown = ", ".join(_mib(x) for x in ranks)
            lines.append(f"| {name} | {shown} | {_mib(a)}, {model['peak_step']} | {max(ranks) / a:.2f} |")
        else:
            lines.append(f"| {name} | (not measured) | {_mib(a)}, {model['peak_step']} | |")
    return "\n".join(lines), data


def memory_arguments(module: str, doc: str) -> argparse.ArgumentParser:
    """The options of the memory benches: --json, --no-measure, and the hidden --worker their ranks get."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("--no-measure", action="store_true", help="analytic tables only (no torchrun)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = memory_arguments("bench.wan_memory", __doc__).parse_args(argv)
    if args.worker:
        return worker(args.worker)
    mini_video = (33, 128, 128)  # 9 latent frames × 8 × 8 = 576 tokens
    measured = None if args.no_measure else measure(*mini_video)
    text, data = report(measured, mini_video)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"dims": {k: asdict(v) for k, v in MODELS.items()}, **data}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
