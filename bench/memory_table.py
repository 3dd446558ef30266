"""Per-rank memory with --shard-weights: weights + activations for FLUX.2 [dev], Qwen-Image, Wan 2.2 A14B, LTX-2.3
and MiniMax-H3.

    python -m bench.memory_table [--json OUT.json] [--no-measure]

Weights per rank are exact counts: the transformer built on the meta device from its released config
(no memory), its block parameters sharded over the world (FSDP2: ÷ ranks, plus the one block gathered
while it runs) and the rest whole on every rank. Activations are the analytic models of one transformer
call at one rank's share of the tokens (`flux2_peak`, `qwen_peak`; Wan's is bench/wan_memory.py's, LTX-2's and
MiniMax-H3's bench/av_memory.py's),
written from diffusers' blocks and this engine's sequence-parallel attention, and checked here against
mini models of the same blocks measured on real torchrun ranks (every tensor the call allocates, the
model's own weights excluded). A layout fits a 24 GB card when weights + activations leave 10% of it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command

from . import av_memory, wan_memory

CARD = 24 * 10**9  # bytes of a 24 GB card
HEADROOM = 0.9  # what a layout may plan to use of it (allocator, CUDA context)
RANKS = (2, 4, 8)
ACT = 2  # bf16


@dataclass(frozen=True)
class Joint:
    """An image model over a joint image + text sequence, at one resolution."""

    family: str  # "flux2" | "qwen"
    dim: int
    heads: int
    head_dim: int
    mlp: int  # hidden width of the MLP
    image_tokens: int
    text_tokens: int


# -- activations -----------------------------------------------------------------------------------------
def _local(m: Joint, ulysses: int, ring: int, text_sharded: bool) -> tuple[int, int]:
    sp = ulysses * ring
    return math.ceil(m.image_tokens / sp), math.ceil(m.text_tokens / sp) if text_sharded else m.text_tokens


def flux2_peak(m: Joint, ulysses: int, ring: int, text_sharded: bool = True) -> dict[str, float]:
    """Bytes one rank holds at the steps of a FLUX.2 transformer call that can be its peak.

    The largest steps are in the single-stream blocks, over the joint sequence of L = t + s local tokens
    (t text, s image; a = L·D·act, f = MLP width / D). Following Flux2SingleTransformerBlock and its
    parallel processor, alive at the concatenation before to_out: the block input and its modulated norm
    (2a), the fused QKV + MLP projection ((3 + 2f)·a), q and k after norm and rotary (2a), the attention
    output (a), the SwiGLU product (f·a) and the concatenation itself ((1 + f)·a): (9 + 4f)·a.
    In the attention step, beside the block input, norm, projection and q, k ((7 + 2f)·a): under Ulysses
    the stacked q/k/v, its all-to-all send and receive buffers and their concatenation (4 × 3 × the tokens
    that travel: the joint sequence when the text is sharded, else the image's), and, when the output's
    all-to-all starts before they are released, its send and receive buffers (2 × one); under Ring the stacked
    q/k/v (3a), the K/V block in use and the one in flight (4a), q/k/v joined with the text (3a), the
    block's output (a) and four fp32 terms of the log-sum-exp merge (8a). Every rank keeps its tokens'
    rotary tables in fp32 (cos and sin: 2·L·hd·4, and the image's own before the join, 2·s·hd·4).
    """
    s, t = _local(m, ulysses, ring, text_sharded)
    a = (s + t) * m.dim * ACT
    f = m.mlp / m.dim
    rotary = 2 * (s + t) * m.head_dim * 4 + 2 * s * m.head_dim * 4
    steps = {"single-block concat": (9 + 4 * f) * a + rotary}
    if ulysses > 1:
        travel = (s + t if text_sharded else s) * m.dim * ACT
        steps["ulysses all-to-all"] = (7 + 2 * f) * a + (12 + 2) * travel + rotary
    if ring > 1:
        steps["ring merge"] = (7 + 2 * f) * a + (3 + 4 + 3 + 1 + 8) * a + rotary
    return _peak(steps, s + t)


def qwen_peak(m: Joint, ulysses: int, ring: int, text_sharded: bool = False) -> dict[str, float]:
    """Bytes one rank holds at the steps of a Qwen-Image transformer call that can be its peak.

    Its blocks keep the streams apart: s local image tokens (i = s·D·act), the text (t tokens, w = t·D·act)
    replicated, as its plan says. The image MLP step holds the block input, its norm and modulated norm,
    the attention output, the gated residual and the stream's other two living tensors (7i), the MLP's
    up-projection and its GELU (2 × F/D · i), and five tensors of the text stream (5w). Under Ulysses,
    the attention step holds the image q/k/v's all-to-all buffers (stacked, received, concatenated: 9i),
    q/k/v joined with the text (3 × (i + w)), the same over the whole sequence with 1/ulysses of the heads
    (3 × (S + t)·D·act / ulysses), six image tensors of the block (6i), three of the text (3w) and the
    output all-to-all's send and receive buffers where it starts before the input's are released (2i). Under
    Ring: the stacked q/k/v and the K/V block in use and in flight (7i), the joined and transposed q/k/v
    and the block's output (7 × (i + w)), four fp32 merge terms (8 × (i + w)), five image tensors of the
    block (5i) and three of the text (3w). The rotary tables are complex64 (8 bytes per pair): the cached
    one of 4096 positions and the image's whole table twice (2·S·hd/2·8; its shards are views of it).
    """
    s, t = _local(m, ulysses, ring, False)
    i, w = s * m.dim * ACT, t * m.dim * ACT
    rotary = 4096 * m.head_dim // 2 * 8 + 2 * m.image_tokens * m.head_dim // 2 * 8
    steps = {"image mlp": 7 * i + 2 * m.mlp / m.dim * i + 5 * w + rotary}
    if ulysses > 1:
        whole = (m.image_tokens + t) * m.dim * ACT / ulysses
        steps["ulysses all-to-all"] = 9 * i + 3 * (i + w) + 3 * whole + 6 * i + 3 * w + 2 * i + rotary
    if ring > 1:
        steps["ring merge"] = 7 * i + 15 * (i + w) + 5 * i + 3 * w + rotary
    return _peak(steps, s)


def _peak(steps: dict[str, float], tokens: int) -> dict[str, float]:
    peak = max(steps, key=steps.get)
    return {**steps, "peak": steps[peak], "peak_step": peak, "tokens_per_rank": tokens}


# -- measurement ------------------------------------------------------------------------------------------
MINI = {
    "flux2": Joint("flux2", dim=128, heads=4, head_dim=32, mlp=384, image_tokens=256, text_tokens=32),
    "qwen": Joint("qwen", dim=128, heads=4, head_dim=32, mlp=512, image_tokens=256, text_tokens=32),
}
# name: (ulysses, ring, cfg)
MEASURED = {"1 rank": (1, 1, 1), "ulysses2": (2, 1, 1), "ring2": (1, 2, 1), "cfg2": (1, 1, 2)}


def mini_pipeline(family: str):
    """The tiny pipeline of the family with a mini transformer of the real model's proportions, in bf16."""
    import torch
    from diffusers import Flux2Transformer2DModel, QwenImageTransformer2DModel

    from parallel.loading import tiny_models

    m = MINI[family]
    if family == "flux2":
        pipe = tiny_models.build_tiny_pipeline("flux2-klein", seed=0)
        transformer = tiny_models._seeded(0, Flux2Transformer2DModel, in_channels=128, num_layers=2, num_single_layers=2,
                                          attention_head_dim=m.head_dim, num_attention_heads=m.heads, joint_attention_dim=48,
                                          axes_dims_rope=(8, 8, 8, 8), guidance_embeds=False)
    else:
        pipe = tiny_models.build_tiny_pipeline("qwen-image", seed=0)
        transformer = tiny_models._seeded(0, QwenImageTransformer2DModel, in_channels=64, out_channels=16, num_layers=2,
                                          attention_head_dim=m.head_dim, num_attention_heads=m.heads,
                                          joint_attention_dim=tiny_models.T5_DIM, axes_dims_rope=(8, 12, 12))
    pipe = type(pipe)(**{**pipe.components, "transformer": transformer})
    return pipe.to(torch.bfloat16)


def mini_call(family: str, cfg: bool) -> dict:
    import torch

    from parallel.loading import tiny_models

    m = MINI[family]
    side = math.isqrt(m.image_tokens) * 16  # 2×2-packed latent tokens of a side × side image
    inputs = tiny_models.make_inputs("flux2-klein" if family == "flux2" else "qwen-image", height=side, width=side,
                                     text_tokens=m.text_tokens, negative=cfg)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    guidance = 4.0 if cfg else 1.0  # without CFG no negative: the pipeline would encode an empty one at full length
    scale = {"guidance_scale": guidance} if family == "flux2" else {"true_cfg_scale": guidance}
    return {**inputs, **scale, "num_inference_steps": 1, "height": side, "width": side, "output_type": "latent",
            "return_dict": False}


def worker(spec_path: str) -> int:
    """torchrun entry: the transformer call's peak per rank for every layout of this launch's world size."""
    import torch

    from parallel.layout.config import ParallelConfig
    from parallel.distributed import destroy_distributed_environment, init_distributed_environment
    from parallel.model_executor.layout_scope import under_layout

    spec = json.loads(Path(spec_path).read_text())
    world = init_distributed_environment()
    torch.set_num_threads(1)
    results = {}
    for family in (*MINI, *av_memory.MINI):
        av = family in av_memory.MINI
        pipeline = av_memory.mini_pipeline(family) if av else mini_pipeline(family)
        for name, (u, r, cfg) in MEASURED.items():
            if u * r * cfg != world.world_size or (cfg > 1 and not av_memory.CFG.get(family, True)):
                continue
            inputs = av_memory.mini_call(family) if av else mini_call(family, cfg > 1)
            with under_layout(pipeline, ParallelConfig(ulysses_degree=u, ring_degree=r, cfg_degree=cfg)) as parallel:
                with torch.no_grad():
                    peak = wan_memory.transformer_peak(pipeline, lambda: parallel(**inputs), ignore=pipeline.transformer)
            mine = torch.tensor([peak], dtype=torch.int64)
            every = [torch.zeros_like(mine) for _ in range(world.world_size)]
            torch.distributed.all_gather(every, mine)
            results.setdefault(family, {})[name] = [int(x) for x in every]
    if world.rank == 0:
        Path(spec["output"]).write_text(json.dumps(results))
    destroy_distributed_environment()
    return 0


def measure() -> dict:
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in sorted({math.prod(layout) for layout in MEASURED.values()}):
            spec, output = Path(tmp) / f"spec{nproc}.json", Path(tmp) / f"out{nproc}.json"
            spec.write_text(json.dumps({"output": str(output)}))
            run = subprocess.run(torchrun_command(nproc, "-m", "bench.memory_table", "--worker", str(spec)),
                                 cwd=ROOT, env=rank_environment(), capture_output=True, text=True, timeout=900)
            if run.returncode != 0:
                raise RuntimeError(run.stderr[-3000:])
            for family, rows in json.loads(output.read_text()).items():
                results.setdefault(family, {}).update(rows)
    return results


# -- the table for the released models ----------------------------------------------------------------------
FLUX2_DEV = Joint("flux2", dim=6144, heads=48, head_dim=128, mlp=18432, image_tokens=(1024 // 16) ** 2, text_tokens=512)
QWEN_IMAGE = Joint("qwen", dim=3072, heads=24, head_dim=128, mlp=12288, image_tokens=(1328 // 16) ** 2, text_tokens=512)
WAN_A14B = wan_memory.MODELS["Wan 2.2 A14B (Wan 2.1 14B: one expert)"]
WAN_VIDEO = (81, 720, 1280)
# model: (what it is, its diffusers transformer class and released config, experts, whether it has CFG)
RELEASED = {
    "FLUX.2 [dev]": ("1024², text 512", "Flux2Transformer2DModel", {}, 1, False),
    "Qwen-Image": ("1328², text 512", "QwenImageTransformer2DModel", {}, 1, True),
    "Wan 2.2 A14B": ("81 frames 1280×720, text 512", "WanTransformer3DModel",
                     {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40,
                      "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256}, 2, True),
    # diffusers' defaults are LTX-2's 48-block layout; LTX-2.3 adds gated attention, cross-attention modulation and
    # split rotary tables (as ComfyUI's LTXAV files of 2.3 hold them), its prompt modulation fed by the connectors
    "LTX-2.3": ("121 frames 1280×704 at 24 fps: 14,080 video tokens, audio 126 (whole on every rank), text 2 × 1024, "
                "CFG's two branches in one call", "LTX2VideoTransformer3DModel",
                {"rope_type": "split", "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True,
                 "audio_cross_attn_mod": True, "perturbed_attn": True, "use_prompt_embeddings": False}, 1, True),
    "MiniMax-H3": ("5 s, 124 frames 1280×704: 32,560 video rows, audio 414, text 512, one packed sequence, "
                   "guidance-distilled (no CFG)", "MiniMaxH3Transformer3DModel", {}, 1, False),
}
LTX2_3, MINIMAX_H3 = av_memory.released_ltx2(), av_memory.released_h3()
# heads that Ulysses splits: LTX-2's video self-attention (audio and text attend locally), MiniMax-H3's one sequence
HEADS = {"FLUX.2 [dev]": FLUX2_DEV.heads, "Qwen-Image": QWEN_IMAGE.heads, "Wan 2.2 A14B": WAN_A14B.heads,
         "LTX-2.3": av_memory._defaults("LTX2VideoTransformer3DModel")["num_attention_heads"],
         "MiniMax-H3": av_memory._defaults("MiniMaxH3Transformer3DModel")["num_attention_heads"]}


def weight_bytes(cls_name: str, config: dict, experts: int, ranks: int, act: int = ACT) -> dict[str, int]:
    """Per-rank weight bytes with --shard-weights: the transformer built on the meta device (exact counts);
    block parameters ÷ ranks, plus two whole blocks (the running one and the next, whose all-gather FSDP2
    issues ahead), and the rest replicated; Wan 2.2 A14B holds two such experts."""
    import diffusers
    import torch

    from parallel.loading.weight_sharding import transformer_blocks

    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**config)
    blocks = [sum(p.numel() for p in block.parameters()) for block in transformer_blocks(model)]
    total = sum(p.numel() for p in model.parameters())
    sharded = experts * sum(blocks) * act / ranks
    return {"total": total * experts * act, "sharded": int(sharded), "gathered": 2 * max(blocks) * act,
            "replicated": (total - sum(blocks)) * experts * act,
            "per_rank": int(sharded) + 2 * max(blocks) * act + (total - sum(blocks)) * experts * act}


def whole_bytes(cls_name: str, config: dict, experts: int) -> dict[str, int]:
    """Per-rank weight bytes without sharding (what a pool holds by default): every expert whole on every rank, in
    bf16, and in fp8 as ComfyUI's scaled-fp8 files keep it (the blocks' linear weights one byte each, with one fp32
    scale per layer; the rest bf16)."""
    import diffusers
    import torch

    from parallel.loading.weight_sharding import transformer_blocks

    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**config)
    linear = [layer.weight.numel() for block in transformer_blocks(model) for layer in block.modules()
              if isinstance(layer, torch.nn.Linear)]
    total = sum(p.numel() for p in model.parameters())
    return {"bf16": experts * total * ACT, "fp8": experts * (sum(linear) + 4 * len(linear) + (total - sum(linear)) * ACT)}


def loader_pair(heads: int) -> list[str]:
    """Wan 2.2 A14B as its template builds it with Load Diffusion Model (xDiT Pool): two loaders, one pool, both
    experts on every rank (each MODEL calls its own); per rank, whole in fp8 or bf16, or sharded (bf16)."""
    what, cls_name, config, experts, _ = RELEASED["Wan 2.2 A14B"]
    whole = whole_bytes(cls_name, config, experts)
    lines = [f"**Wan 2.2 A14B's two loaders on one pool** ({what}; Ulysses over the ranks, the activations of one "
             "call; the pool holds both experts, so no expert is reloaded between the template's two samplers):", "",
             "| ranks | weights per rank | activations | total | 24 GB |", "|---:|---|---:|---:|:---:|"]
    fits = CARD * HEADROOM
    for ranks in RANKS:
        act = activation("Wan 2.2 A14B", ranks if heads % ranks == 0 else 1, 1)["peak"]
        for label, weights in (("both experts whole, fp8 (the template's files)", whole["fp8"]),
                               ("both experts whole, bf16", whole["bf16"]),
                               ("`shard_weights`, bf16", weight_bytes(cls_name, config, experts, ranks)["per_rank"])):
            total = weights + act
            lines.append(f"| {ranks} | {label}: {_gib(weights)} | {_gib(act)} | {_gib(total)} | "
                         f"{'✓' if total <= fits else '✗'} |")
    return lines + [""]


def layouts(ranks: int, heads: int, cfg: bool) -> dict[str, tuple[int, int, int]]:
    """(ulysses, ring, cfg) of every layout of `ranks` that splits the work of one sample."""
    out = {}
    for c in (1, 2) if cfg else (1,):
        for u in (d for d in range(1, ranks // c + 1) if (ranks // c) % d == 0 and heads % d == 0):
            r = ranks // c // u
            if c * u * r == ranks:
                name = "×".join(part for part in (f"cfg{c}" if c > 1 else "", f"ulysses{u}" if u > 1 else "",
                                                  f"ring{r}" if r > 1 else "") if part)
                out[name] = (u, r, c)
    return out


def activation(model: str, u: int, r: int, c: int = 1) -> dict[str, float]:
    if model == "LTX-2.3":
        return av_memory.ltx2_peak(LTX2_3, u, r, batch=2 // c)
    if model == "MiniMax-H3":
        return av_memory.h3_peak(MINIMAX_H3, u, r)
    if model == "Wan 2.2 A14B":
        return wan_memory.analytic_peak(WAN_A14B, wan_memory.video_tokens(*WAN_VIDEO), u, r)
    if model == "FLUX.2 [dev]":
        return flux2_peak(FLUX2_DEV, u, r, text_sharded=True)
    return qwen_peak(QWEN_IMAGE, u, r)


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def report(measured: dict | None) -> tuple[str, dict]:
    fits = CARD * HEADROOM
    lines = [f"Per-rank memory with `--shard-weights`, bf16 (GiB): transformer weights + the activations of one "
             f"transformer call; ✓ fits a 24 GB card with 10% to spare ({_gib(fits)} GiB).", ""]
    data: dict = {"real": {}, "mini": {}}
    for model, (what, cls_name, config, experts, cfg) in RELEASED.items():
        heads = HEADS[model]
        lines += [f"**{model}** ({what}):", "", "| ranks | layout | weights | activations (peak step) | total | 24 GB |",
                  "|---:|---|---:|---:|---:|:---:|"]
        for ranks in RANKS:
            weights = weight_bytes(cls_name, config, experts, ranks)
            for name, (u, r, c) in layouts(ranks, heads, cfg).items():
                act = activation(model, u, r, c)
                total = weights["per_rank"] + act["peak"]
                data["real"].setdefault(model, {})[f"{ranks}:{name}"] = {"weights": weights, "activations": act}
                lines.append(f"| {ranks} | {name} | {_gib(weights['per_rank'])} | {_gib(act['peak'])} ({act['peak_step']}) | "
                             f"{_gib(total)} | {'✓' if total <= fits else '✗'} |")
        lines.append("")
    lines += loader_pair(WAN_A14B.heads)
    table = ["| model | layout | measured per rank (bytes) | analytic | measured / analytic |",
             "|---|---|---:|---:|---:|"]
    ltx2, h3 = av_memory.MINI["ltx2"], av_memory.MINI["minimax_h3"]
    lines += ["Measured on mini models of the same blocks (D 128, 4 heads of 32, 256 image + 32 text tokens, bf16, "
              "real torchrun ranks), against the same analytic models at the mini shape:", "", *table]
    lines += _mini_rows(measured, data, MINI,
                        lambda f, u, r, c: (flux2_peak if f == "flux2" else qwen_peak)(MINI[f], u, r))
    lines += ["", f"And the video-with-sound families (bench/av_memory.py: the built-in tiny LTX-2, "
              f"{ltx2.video_tokens:,} video + {ltx2.audio_tokens} audio tokens, CFG's two branches batched; a mini "
              f"MiniMax-H3 of the released proportions, {h3.rows:,} packed rows), the largest rank of each layout:",
              "", *table]
    lines += _mini_rows(measured, data, av_memory.MINI, av_memory.mini_peak)
    return "\n".join(lines), data


def _mini_rows(measured: dict | None, data: dict, families, peak) -> list[str]:
    """One row per family and measured layout (none for CFG where the family has no second branch)."""
    lines = []
    for family in families:
        for name, (u, r, c) in MEASURED.items():
            if c > 1 and not av_memory.CFG.get(family, True):
                continue
            a = peak(family, u, r, c)["peak"]
            if measured and name in measured.get(family, {}):
                worst = max(measured[family][name])
                data["mini"].setdefault(family, {})[name] = {"measured": measured[family][name], "analytic": a}
                lines.append(f"| {family} | {name} | {worst:,} | {a:,.0f} | {worst / a:.3f} |")
            else:
                lines.append(f"| {family} | {name} | (not measured) | {a:,.0f} | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = wan_memory.memory_arguments("bench.memory_table", __doc__).parse_args(argv)
    if args.worker:
        return worker(args.worker)
    text, data = report(None if args.no_measure else measure())
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
