"""The benchmarked model: a medium Flux.1-like pipeline built in code, big enough to be compute-bound.

The test models in parallel/loading/tiny_models.py run a step in about a millisecond, so timing them measures
Python and collective latency, not parallel speed-up. MEDIUM keeps Flux.1's structure (double- then
single-stream blocks, joint attention with the text in front, packed 2×2 latents, RoPE, distilled
guidance embedding) at 8 heads × 64 and 4 + 4 blocks. At 512×512 that is 1024 image tokens; 128 text
tokens keep the 8:1 image:text ratio of Flux.1 at 1024×1024 with 512 T5 tokens, which matters
because the engine replicates the text tokens on every sequence-parallel rank where they do not divide
by the degree (here they do, so Ulysses and Ring shard text and image alike, as diffusers CP does).
TINY is the test model itself, for a fast end-to-end check of the benchmark machinery.

Text encoders are left out (prompts arrive as embeddings, as in contract E); the tiny VAE and the
scheduler come from tiny_models and the VAE never runs (output_type="latent").
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from parallel.loading import tiny_models

from .analytic import ModelDims

MEDIUM_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=4, num_single_layers=4, attention_head_dim=64, num_attention_heads=8,
    joint_attention_dim=256, pooled_projection_dim=256, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
)


@dataclass(frozen=True)
class BenchModel:
    name: str
    transformer: dict | None  # FluxTransformer2DModel config; None: the tiny test transformer
    height: int
    width: int
    text_tokens: int
    steps: int
    guidance_scale: float = 3.5  # Flux's distilled guidance: no second branch
    true_cfg_scale: float = 2.0  # real CFG, for the CFG-parallel layouts

    def pipeline(self, seed: int = 0) -> FluxPipeline:
        """The same weights on every rank: everything is built under fixed seeds."""
        donor = tiny_models.build_tiny_pipeline("flux", seed=seed)
        transformer = donor.transformer
        if self.transformer is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                transformer = FluxTransformer2DModel(**self.transformer).eval()
        pipeline = FluxPipeline(
            scheduler=donor.scheduler, vae=donor.vae, transformer=transformer,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        )
        pipeline.set_progress_bar_config(disable=True)
        return pipeline

    def inputs(self, pipeline: FluxPipeline, seed: int = 0) -> dict[str, torch.Tensor]:
        """Contract-E style tensors: packed noise, and prompt embeddings for both guidance branches."""
        config = pipeline.transformer.config
        generator = torch.Generator().manual_seed(seed)
        tokens = self.image_tokens(pipeline)
        tensors = {"latents": torch.randn(1, tokens, config.in_channels, generator=generator)}
        for prefix in ("", "negative_"):
            text = (1, self.text_tokens, config.joint_attention_dim)
            tensors[prefix + "prompt_embeds"] = torch.randn(text, generator=generator)
            tensors[prefix + "pooled_prompt_embeds"] = torch.randn(1, config.pooled_projection_dim, generator=generator)
        return tensors

    def call_kwargs(self, true_cfg: bool) -> dict:
        return {
            "num_inference_steps": self.steps, "guidance_scale": self.guidance_scale, "height": self.height,
            "width": self.width, "true_cfg_scale": self.true_cfg_scale if true_cfg else 1.0,
            "output_type": "latent", "return_dict": False,
        }

    def image_tokens(self, pipeline: FluxPipeline) -> int:
        side = 2 * pipeline.vae_scale_factor  # Flux packs 2×2 latent pixels into one token
        return (self.height // side) * (self.width // side)

    def dims(self, pipeline: FluxPipeline) -> ModelDims:
        config = pipeline.transformer.config
        return ModelDims(
            image_tokens=self.image_tokens(pipeline), text_tokens=self.text_tokens,
            heads=config.num_attention_heads, head_dim=config.attention_head_dim,
            double_blocks=config.num_layers, single_blocks=config.num_single_layers,
            out_channels=config.out_channels or config.in_channels,
            element_bytes=next(pipeline.transformer.parameters()).element_size(),  # fp32, or bf16 on a GPU
        )


MODELS = {
    # One step per run keeps a round short: the shared host drifts over tens of seconds, and ratios are
    # only trustworthy between runs timed close together.
    "medium": BenchModel("medium-flux", MEDIUM_TRANSFORMER, height=512, width=512, text_tokens=128, steps=1),
    "tiny": BenchModel("tiny-flux", None, height=64, width=64, text_tokens=16, steps=2),
    # FLUX.1-dev's width, heads and embeddings with 12 of its 57 blocks (1.8B parameters): for a GPU.
    "large": BenchModel("large-flux", {**MEDIUM_TRANSFORMER, "num_layers": 4, "num_single_layers": 8,
                                       "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                                       "pooled_projection_dim": 768, "axes_dims_rope": (16, 56, 56)},
                        height=1024, width=1024, text_tokens=512, steps=1),
}


def with_blocks(model: BenchModel, blocks: tuple[int, int] | None) -> BenchModel:
    """`model` with (double, single) Flux blocks where given: a lent GPU's time is short, and a per-block
    ratio (fp8 against bf16) needs few blocks."""
    if blocks is None:
        return model
    return replace(model, transformer={**model.transformer, "num_layers": blocks[0], "num_single_layers": blocks[1]})


def start_drive(spec: dict):
    """A benchmark rank's start: one thread, the world joined, the spec's model built, and the inputs and
    call arguments of a run of spec["steps"] steps without true CFG. Returns (world, model, pipeline,
    inputs, kwargs)."""
    from parallel.distributed import init_distributed_environment

    torch.set_num_threads(1)
    world = init_distributed_environment()
    model = MODELS[spec["model"]]
    pipeline = model.pipeline()
    inputs = {k: v for k, v in model.inputs(pipeline).items() if not k.startswith("negative")}
    inputs = on_gpu(pipeline, inputs)
    return world, model, pipeline, inputs, {**model.call_kwargs(true_cfg=False), "num_inference_steps": spec["steps"]}


def on_gpu(pipeline, inputs: dict) -> dict:
    """On a GPU: `pipeline` moved to this rank's device in bf16 and the inputs with it (returned); on a CPU
    both stay as built, fp32."""
    if not torch.cuda.is_available():
        return inputs
    pipeline.to("cuda", torch.bfloat16)
    return {k: v.to("cuda", torch.bfloat16) for k, v in inputs.items()}


def synchronize() -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts that work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def launch_per_rank_count(module: str, spec: dict, json_out, nprocs=(1, 2)) -> dict[int, dict]:
    """Run `python -m <module> --drive SPEC` under torchrun once per rank count; each drive writes its raw
    result to spec["result"]. Returns {nproc: raw result}."""
    import json
    import subprocess

    from parallel.cli.launch import ROOT, rank_environment, torchrun_command

    raws = {}
    for nproc in nprocs:
        spec_file, result = json_out.with_suffix(f".{nproc}.spec.json"), json_out.with_suffix(f".{nproc}.raw.json")
        spec_file.write_text(json.dumps({**spec, "result": str(result)}))
        subprocess.run(torchrun_command(nproc, "-m", module, "--drive", str(spec_file)), cwd=ROOT,
                       env=rank_environment(), check=True)
        raws[nproc] = json.loads(result.read_text())
    return raws


def timed_rounds(pipelines: dict, inputs: dict, kwargs: dict, runs: int) -> tuple[dict, dict, dict]:
    """Time every pipeline on the same inputs, round by round, the order alternating; round 0 is a warm-up
    kept apart. Returns ({name: [seconds]}, {name: last output}, {name: warm-up seconds})."""
    import time

    import torch.distributed as dist

    times = {name: [] for name in pipelines}
    warmup, outputs = {}, {}
    for round_ in range(runs + 1):
        for name in pipelines if round_ % 2 == 0 else list(pipelines)[::-1]:
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                outputs[name] = pipelines[name](**inputs, **kwargs)[0]
            synchronize()
            elapsed = time.perf_counter() - start
            dist.barrier()
            if round_:
                times[name].append(elapsed)
            else:
                warmup[name] = elapsed
    return times, outputs, warmup


def alternating(sides: dict, runs: int) -> tuple[dict, dict]:
    """Time each callable `runs` times, round by round with the order alternating, after an untimed warm-up
    round. Returns ({name: [seconds]}, {name: its warm-up result})."""
    import time

    results = {name: run() for name, run in sides.items()}
    times = {name: [] for name in sides}
    for round_ in range(runs):
        for name in sides if round_ % 2 == 0 else list(sides)[::-1]:
            start = time.perf_counter()
            sides[name]()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return times, results


@contextlib.contextmanager
def one_rank_pool(pipeline):
    """A pool of one rank (one thread) serving `pipeline` from a temporary folder, and a client of it; on a
    GPU the pool computes in bf16, as `on_gpu` puts the in-process side."""
    from workers.client import PoolClient
    from workers.wire.endpoints import free_endpoint
    from workers.supervisor.pool import Pool, PoolSpec

    with tempfile.TemporaryDirectory() as tmp:
        pipeline.save_pretrained(tmp)
        pool = Pool(PoolSpec(model=tmp, nproc=1, endpoint=free_endpoint(), threads_per_rank=1,
                             dtype="bf16" if torch.cuda.is_available() else None)).start()
        client = PoolClient(pool.spec.endpoint)
        try:
            yield client
        finally:
            client.close()
            pool.stop()


def side_by_side_arguments(module: str, doc: str, runs: int, steps: int) -> argparse.ArgumentParser:
    """The options every side-by-side bench takes: --tiny or --large, --runs, --steps, --json
    (bench/out/<name>.json) and the hidden --drive SPEC its torchrun ranks get; the bench adds its own."""

    name = module.rsplit(".", 1)[-1]
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the tiny test model: checks the machinery only")
    size.add_argument("--large", action="store_true",
                      help="FLUX.1-dev's width with 12 of its blocks, 1024² (for GPUs: each rank on its own, bf16)")
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "out" / f"{name}.json")
    parser.add_argument("--drive", type=Path, help=argparse.SUPPRESS)
    return parser


def model_key(args) -> str:
    """The MODELS key the options chose: tiny, large or (neither) medium."""
    return "tiny" if args.tiny else "large" if args.large else "medium"


def parse_or_drive(parser, argv, drive):
    """The parsed options; None after running `drive` on a rank (the --drive SPEC torchrun passes it)."""
    import json

    args = parser.parse_args(argv)
    if args.drive:
        from parallel.cli.torchrun_exit import exit_after_work

        drive(json.loads(args.drive.read_text()))
        exit_after_work(0)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    return args
