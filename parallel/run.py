"""One-shot parallel sampling (contract E in docs/architecture.md).

    python -m parallel.run --nproc-per-node N --model DIR --inputs IN.safetensors \
        --output OUT.safetensors --steps S --guidance-scale G --height H --width W [--call NAME=VALUE]
        [layout flags | --layout auto [--link LINK]]
    torchrun --nproc-per-node N -m parallel.run ...      (the same run, torchrun's launch)

IN holds the tensor keyword arguments of the pipeline's `__call__` (latents, prompt_embeds, ...; write
one from a prompt with `python -m parallel.make_inputs`); OUT gets `latents`: what the same pipeline
returns with output_type="latent", and what the pipeline returns beside them under its own names (LTX-2: `audio`,
the audio latents). The family's own call parameters come with `--call NAME=VALUE` (or
the shorthands `--true-cfg-scale`, `--num-frames`). DIR may be a built-in tiny model name
(builtin_models.py). A mistake ends in one `error:` line from rank 0 and no traceback. Started with
`--nproc-per-node` by itself (cli/launcher.py), the run exits 2 on a refused layout or bad input, 1 on a failed
job and 128 + N on signal N; under torchrun, whose only failure status is 1, a refusal stops it with 137
(torchrun_exit.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .cli.arguments import ArgumentParser
from .distributed.devices import DeviceError
from .layout.config import LayoutError, Link, add_parallel_arguments, auto_layout_from_args, config_from_args
from .loading import builtin_models
from .families import FAMILIES
from .cli.launch import apply_threads_per_rank, die_with_parent
from .loading.pipelines import DTYPES, FLOW_SCHEDULERS, SCHEDULERS, load_pipeline, set_scheduler
from .request import add_request_arguments, request_from_args
from .cli import launcher, rendezvous
from .cli.torchrun_exit import exit_after_work, exit_quietly
from .loading.weight_sharding import parameter_shares

INPUT_NAMES = FAMILIES.tensor_inputs()


class _Parser(ArgumentParser):
    """Argument mistakes: one line from rank 0 only, and no torchrun traceback."""

    def exit(self, status: int = 0, message: str | None = None) -> None:
        if status == 0:
            super().exit(status, message)
        exit_quietly(status)

    def error(self, message: str) -> None:
        if os.environ.get("RANK", "0") == "0":
            super().error(message)
        exit_quietly(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(prog="python -m parallel.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="diffusers pipeline folder (save_pretrained layout)")
    parser.add_argument("--vae", default=None, help="with a single-file --model: the VAE file that goes with it "
                        "(ComfyUI's models/vae; image-to-video models need it)")
    parser.add_argument("--inputs", help="safetensors file with the pipeline's tensor arguments")
    parser.add_argument("--output", help="safetensors file to write (key: latents)")
    add_request_arguments(parser)
    parser.add_argument("--scheduler", choices=["default", *SCHEDULERS, *FLOW_SCHEDULERS], default="default")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: as saved")
    parser.add_argument("--attention-kernel", default=None, help="force a kernel (math, cpu_flash, flash_attn, ...)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="sample this many times and report the last (warm) run's time; the output is the same")
    parser.add_argument("--list-supported", action="store_true", help="print the capability table and exit")
    add_parallel_arguments(parser)
    args = parser.parse_args(argv)
    if not args.list_supported and not (args.model and args.inputs and args.output):
        parser.error("--model, --inputs and --output are required")
    try:
        args.auto = auto_layout_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def check_files(args: argparse.Namespace) -> None:
    """Mistakes in the paths, before any rank starts to work."""
    builtin_models.check_model(args.model, args.vae)
    if not os.path.isfile(args.inputs):
        raise ValueError(f"--inputs {args.inputs}: no such file; write one with "
                         f"`python -m parallel.make_inputs --model {args.model} --prompt ... --out {args.inputs}`")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: the folder {folder} does not exist; create it first")


def read_inputs(path: str) -> dict[str, torch.Tensor]:
    try:
        tensors = load_file(path)
    except SafetensorError as error:
        raise ValueError(f"--inputs {path} is not a safetensors file ({error}); write one with python -m parallel.make_inputs") from None
    unknown = sorted(set(tensors) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"{path} has tensors {unknown} that are not pipeline inputs; allowed: {list(INPUT_NAMES)}")
    if "latents" not in tensors:
        raise ValueError(f"{path} has no 'latents' tensor: the initial noise must be given")
    return tensors


def _auto_layout(pipeline, base, args: argparse.Namespace, inputs: dict[str, torch.Tensor], world):
    """--layout auto: the fastest predicted layout for this job; rank 0 prints the prediction table."""
    from .layout.choice import auto_layout, describe

    link = Link.parse(args.auto.link) if args.auto.link else None
    request = request_from_args(args, None, type(pipeline).__name__)  # checked against the family after
    device, dtype = pipeline.transformer.device, pipeline.transformer.dtype
    tensors = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    chosen, predictions, links = auto_layout(pipeline, base, request.pipeline_kwargs(tensors), world.world_size, link,
                                             args.attention_kernel)
    if world.rank == 0:
        print(f"xdit: layout auto on {world.world_size} ranks chose [{chosen.describe()}]; predicted per step:", flush=True)
        for line in describe(predictions, links, measured=link is None):
            print(f"xdit:   {line}", flush=True)
    return chosen


def launch(nproc: int, argv: list[str]) -> int:
    """`--nproc-per-node N` outside torchrun: the mistakes one process can see, then the ranks (cli/launcher.py)."""
    args = parse_args(argv)
    if args.list_supported:
        from .model_executor import capability_table

        print(capability_table())
        return 0
    try:
        check_files(args)
        if args.auto is None:  # --layout auto chooses the degrees for the ranks it has
            config_from_args(args).check(nproc)
    except (LayoutError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return launcher.launch(nproc, argv)


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    if "RANK" not in os.environ:
        nproc, argv = launcher.nproc_of(argv)
        if nproc is not None:
            return launch(nproc, argv)
    args = parse_args(argv)
    from .model_executor import capability_table, wrap_pipeline

    if args.list_supported:
        print(capability_table())
        return 0

    from .distributed import destroy_distributed_environment, init_distributed_environment, initialize_model_parallel

    try:
        store = os.environ.get(launcher.STORE_ENV)  # started by the launcher: its store, on loopback
        world = init_distributed_environment(share_gpus=args.share_gpus, store=store and rendezvous.join(
            store, int(os.environ["WORLD_SIZE"])))
    except DeviceError as error:  # before the world exists: every rank of this machine says it alike; one prints
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {error}", file=sys.stderr, flush=True)
        exit_quietly(2)
    apply_threads_per_rank()
    try:
        check_files(args)
        config = config_from_args(args)
        if args.auto is None:
            initialize_model_parallel(config)
        inputs = read_inputs(args.inputs)
        model = builtin_models.resolve_model_on_ranks(args.model, int(os.environ.get("LOCAL_RANK", 0)), world.barrier)
        pipeline = load_pipeline(model, dtype=args.dtype, shard_weights=config.shard_weights, offload=config.offload,
                                 vae=args.vae)
        set_scheduler(pipeline, args.scheduler)
        if args.auto is not None:
            config = _auto_layout(pipeline, config, args, inputs, world)
            initialize_model_parallel(config)
        parallel = wrap_pipeline(pipeline, attention_kernel=args.attention_kernel)
        request = request_from_args(args, parallel.call_parameters, type(pipeline).__name__)
        device, dtype = pipeline.transformer.device, pipeline.transformer.dtype
        tensors = {k: v.to(device, dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        shares = parameter_shares(pipeline) if config.shard_weights else None
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            output = parallel(**request.pipeline_kwargs(tensors), output_type="latent", return_dict=False)
            elapsed = time.perf_counter() - start
        if world.rank == 0:
            outputs = {"latents": output[0], **dict(zip(parallel.extra_outputs, output[1:]))}
            save_file({name: tensor.float().cpu().contiguous() for name, tensor in outputs.items()}, args.output)
            print(
                f"xdit: {type(pipeline).__name__} {args.height}x{args.width} {args.steps} steps on "
                f"{world.world_size} rank(s) [{parallel.parallel_config.describe()}]: {elapsed:.3f} s "
                f"-> {args.output}",
                flush=True,
            )
            if parallel.fp8_matmul:
                print(f"xdit: {parallel.fp8_matmul} fp8 layers multiply in fp8 (torch._scaled_mm)", flush=True)
            if shares is not None:
                held = "; ".join(f"{', '.join(f'{s:.3f}' for s in share)} of {name}'s" for name, share in shares.items())
                print(f"xdit: each rank holds {held} parameter bytes", flush=True)
            if parallel.cache_report is not None:
                print(f"xdit: {parallel.cache_report.describe()}", flush=True)
            if config.compile:
                from .model_executor.compile import describe, report

                print(f"xdit: {describe(report())}", flush=True)
        return 0
    except (LayoutError, ValueError, FileNotFoundError) as error:
        if world.rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        exit_quietly(2)
    finally:
        destroy_distributed_environment()


if __name__ == "__main__":
    exit_after_work(main())
