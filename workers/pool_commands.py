"""`python -m workers serve | join | sample`: the commands that start or use a pool's ranks (contract P).

They read the engine (model names, the request's flags, PNG decoding), so they are imported only when one of
them runs: `status`, `stop` and `keys` (cli.py) stay light.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace

from .client import JobCancelledError, JobFailed, PoolClient, PoolUnreachable
from .engine import config, engine, request
from .supervisor import Pool, PoolError, PoolSpec, SettingsRefused
from .wire.endpoints import free_endpoint

builtin_models = engine("loading.builtin_models")


def _pool_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--model", required=required,
                        help=f"diffusers pipeline folder, single-file checkpoint, or a built-in tiny model: {', '.join(builtin_models.NAMES)}")
    parser.add_argument("--vae", default=None, help="with a single-file --model: the VAE file that goes with it "
                        "(ComfyUI's models/vae), for image-to-video and decoding on the pool")
    parser.add_argument("--nproc", type=int, default=1, help="number of ranks")
    parser.add_argument("--text-encoders", action="store_true", help="also load the text encoders")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"], default=None, help="fp8: fp8 storage, bf16 compute")
    parser.add_argument("--threads-per-rank", type=int, default=None)
    parser.add_argument("--devices", default=None, help="CUDA cards for the ranks, e.g. 0,1 (default: all)")
    limits = parser.add_argument_group("limits (jobs past them are refused at submit; ranks that hang are ended)")
    limits.add_argument("--max-megapixels", type=float, default=0.0, metavar="MP",
                        help="largest job in output megapixels, batch × frames × height × width (default: no limit)")
    limits.add_argument("--max-job-seconds", type=float, default=0.0, metavar="S",
                        help="longest job, estimated from the pool's last job (default: no limit)")
    limits.add_argument("--hang-timeout", type=float, default=30.0, metavar="S",
                        help="a rank silent this long is hung: its job fails naming it and the pool restarts (default: 30)")
    config.add_parallel_arguments(parser)


def _node_arguments(parser: argparse.ArgumentParser, join: bool) -> None:
    """Several machines: passed to torchrun's elastic launcher (c10d rendezvous hosted by node 0)."""
    group = parser.add_argument_group("several machines (torchrun c10d rendezvous)")
    group.add_argument("--nnodes", type=int, required=join, default=1, help="machines in the pool")
    group.add_argument("--node-rank", type=int, required=join, default=0,
                       help="this machine's number: 0 serves clients, 1 … nnodes-1 join")
    group.add_argument("--rdzv-endpoint", required=join, default=None, help="HOST:PORT of node 0's rendezvous")
    group.add_argument("--rdzv-id", default="xdit-pool", help="the pool's rendezvous id (the same on every machine)")


def add_parsers(commands, client_keys, insecure_help: str) -> None:
    """serve, join and sample; `client_keys(parser)` adds the client's --curve-dir and --insecure-tcp."""
    serve = commands.add_parser("serve", help="run a pool in the foreground (SIGTERM stops every rank)")
    _pool_arguments(serve, required=True)
    serve.add_argument("--endpoint", default="tcp://127.0.0.1:5599")
    serve.add_argument("--curve-dir", default=None,
                       help="keys from `python -m workers keys` (server.key_secret, clients/*.key); required off loopback "
                            "(default: your own keys, made on first use, which your clients find by themselves)")
    serve.add_argument("--insecure-tcp", action="store_true",
                       help=f"serve a loopback endpoint with {insecure_help}; only for clients that cannot speak CURVE")
    _node_arguments(serve, join=False)

    join = commands.add_parser("join", help="run this machine's ranks of node 0's pool (several machines)")
    _pool_arguments(join, required=True)
    _node_arguments(join, join=True)

    sample = commands.add_parser("sample", help="run one job (on --endpoint, or on a pool started for it)")
    _pool_arguments(sample, required=False)
    sample.add_argument("--endpoint", default=None)
    source = sample.add_mutually_exclusive_group(required=True)
    source.add_argument("--inputs", help="safetensors file with the pipeline's tensor inputs (contract E's IN)")
    source.add_argument("--prompt", help="encode this prompt on the pool with the pipeline's own text encoders")
    sample.add_argument("--negative-prompt", default="", help="with --prompt (default: empty)")
    sample.add_argument("--seed", type=int, default=0, help="with --prompt: the initial noise, as the pipeline draws it")
    sample.add_argument("--image", action="append", default=[], metavar="PICTURE",
                        help="with --prompt: a reference picture for an edit model whose text encoder sees it, "
                             "encoded with both prompts (repeat it for several, of one size)")
    sample.add_argument("--output", required=True, help="OUT.safetensors (latents) or OUT.png (decoded with the model's VAE)")
    request.add_request_arguments(sample)
    sample.add_argument("--scheduler", default=None)
    client_keys(sample)


def _spec(args, endpoint: str | None, curve_dir: str | None = None, insecure_tcp: bool = False):
    builtin_models.check_model(args.model, args.vae)
    return PoolSpec(
        model=args.model, vae=args.vae, nproc=args.nproc, endpoint=endpoint, parallel=config.config_from_args(args),
        auto=config.auto_layout_from_args(args),
        text_encoders=args.text_encoders, dtype=args.dtype, threads_per_rank=args.threads_per_rank, devices=args.devices,
        curve_dir=curve_dir, insecure_tcp=insecure_tcp, nnodes=getattr(args, "nnodes", 1),
        node_rank=getattr(args, "node_rank", 0),
        rdzv_endpoint=getattr(args, "rdzv_endpoint", None), rdzv_id=getattr(args, "rdzv_id", "xdit-pool"),
        max_megapixels=args.max_megapixels, max_job_seconds=args.max_job_seconds, hang_timeout_s=args.hang_timeout,
    )


def _run_in_foreground(pool, banner: str) -> int:
    """Supervise until SIGTERM/SIGINT or a client's stop; the pool keeps restarting meanwhile."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pool.spawn()
    announced = False
    while not stop.is_set() and pool.running:
        if pool.ready and not announced and pool.state == "ready":
            print(banner, flush=True)
            announced = True
        stop.wait(0.2)
    pool.stop()
    if pool.state == "error":
        print(f"error: {pool.error}", file=sys.stderr, flush=True)
        return 2 if pool.refused else 1
    print("xdit pool stopped", flush=True)
    return 0


def serve(args) -> int:
    pool = Pool(_spec(args, args.endpoint, args.curve_dir, args.insecure_tcp))
    nodes = f" over {args.nnodes} nodes" if args.nnodes > 1 else ""
    return _run_in_foreground(pool, f"xdit pool serving {args.model} on {args.endpoint} with {pool.spec.world_size} "
                                    f"rank(s){nodes} [{pool.spec.describe_layout()}]")


def join(args) -> int:
    pool = Pool(_spec(args, None))
    return _run_in_foreground(pool, f"xdit node {args.node_rank} joined the pool at {args.rdzv_endpoint} with "
                                    f"{args.nproc} rank(s) [{pool.spec.describe_layout()}]")


def _check_sample_files(args) -> None:
    """Mistakes that need no pool: say so before one starts."""
    if args.inputs and not os.path.isfile(args.inputs):
        raise ValueError(f"--inputs {args.inputs}: no such file; write one with `python -m parallel.make_inputs "
                         "--model M --prompt ... --out IN.safetensors`, or pass --prompt instead")
    if args.image and not args.prompt:
        raise ValueError("--image goes with --prompt (the pictures are encoded with it); with --inputs, put them in "
                         "the file as `image`, [N, 3, H, W] in [0, 1]")
    if args.image:
        engine("model_executor.prompt_inputs").reference_pictures(args.image)  # readable, one size
    if not args.output.endswith((".safetensors", ".png")):
        raise ValueError(f"--output {args.output}: end it in .safetensors (latents) or .png (an image)")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {args.output}: the folder {folder} does not exist; create it first")


def _job_inputs(client: PoolClient, args) -> dict:
    if args.inputs:
        from safetensors.torch import load_file

        return load_file(args.inputs)
    image = engine("model_executor.prompt_inputs").reference_pictures(args.image) if args.image else None
    return client.encode(args.prompt, image=image, negative_prompt=args.negative_prompt, seed=args.seed,
                         height=args.height, width=args.width)


def _write_output(latents, args, model: str) -> None:
    if args.output.endswith(".png"):
        folder = builtin_models.resolve_model(model)
        engine("cli.decode").decode_to_png(folder, latents, args.height, args.width, args.output)
    else:
        from safetensors.torch import save_file

        save_file({"latents": latents.contiguous()}, args.output)


def sample(args) -> int:
    _check_sample_files(args)
    params = request.request_from_args(args).to_params()  # the pool checks the call map against its family
    if args.scheduler:
        params["scheduler"] = args.scheduler
    pool = None
    endpoint = args.endpoint
    if endpoint is None:
        if not args.model:
            raise ValueError("sample needs --endpoint of a running pool, or --model (and --nproc) to start one for this job")
        endpoint = free_endpoint()
        args.text_encoders = args.text_encoders or bool(args.prompt)
        # The ranks' own output (loading bars, a failed job's traceback) goes to a log; the error line names it.
        log_file = os.path.join(tempfile.gettempdir(), f"xdit-sample-{os.getpid()}.log")
        pool = Pool(replace(_spec(args, endpoint, insecure_tcp=args.insecure_tcp), log_file=log_file))
    curve_dir = args.curve_dir if pool is None else None  # a pool started here serves with this user's own keys
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        if pool is not None:
            pool.start()
        with PoolClient(endpoint, curve_dir=curve_dir, insecure=args.insecure_tcp) as client:
            start = time.perf_counter()

            def on_step(message):
                p = message.params
                print(f"step {p['index']}/{p['total']} {p['elapsed']:.2f} s", file=sys.stderr, flush=True)

            model = args.model or (client.status()["model"] if args.output.endswith(".png") else "")
            inputs = _job_inputs(client, args)
            latents = client.sample(inputs, params, on_step=on_step, should_cancel=interrupted.is_set)
            _write_output(latents, args, model)
            print(f"xdit: job done in {time.perf_counter() - start:.3f} s -> {args.output}", flush=True)
            if "cache" in client.last_result:
                print(f"xdit: {client.last_result['cache']['text']}", flush=True)
            if pool is not None:
                os.remove(pool.spec.log_file)
            return 0
    except JobCancelledError as error:
        print(f"cancelled: {error}", file=sys.stderr)
        return 130
    except (JobFailed, PoolUnreachable, PoolError) as error:
        log = f" (the ranks' log: {pool.spec.log_file})" if pool is not None else ""
        print(f"error: {error}{log}", file=sys.stderr)
        refused = isinstance(error, SettingsRefused) or isinstance(error, JobFailed) and error.mistake
        return 2 if refused else 1  # a layout or inputs that cannot run, against a job or a pool that failed
    finally:
        if pool is not None:
            pool.stop()


