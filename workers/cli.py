"""`python -m workers serve | sample | status | stop` (contract P in DESIGN.md)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time

from parallel.config import LayoutError, add_parallel_arguments, config_from_args

from .client import JobCancelledError, JobFailed, PoolClient, PoolUnreachable


def free_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def _pool_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--model", required=required, help="diffusers pipeline folder")
    parser.add_argument("--nproc", type=int, default=1, help="number of ranks")
    parser.add_argument("--text-encoders", action="store_true", help="also load the text encoders")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None)
    parser.add_argument("--threads-per-rank", type=int, default=None)
    add_parallel_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers", description="xDiT pool: persistent parallel sampling")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run a pool in the foreground (SIGTERM stops every rank)")
    _pool_arguments(serve, required=True)
    serve.add_argument("--endpoint", default="tcp://127.0.0.1:5599")

    sample = commands.add_parser("sample", help="run one job (on --endpoint, or on a pool started for it)")
    _pool_arguments(sample, required=False)
    sample.add_argument("--endpoint", default=None)
    sample.add_argument("--inputs", required=True)
    sample.add_argument("--output", required=True)
    sample.add_argument("--steps", type=int, default=20)
    sample.add_argument("--guidance-scale", type=float, default=4.5)
    sample.add_argument("--true-cfg-scale", type=float, default=None)
    sample.add_argument("--height", type=int, default=1024)
    sample.add_argument("--width", type=int, default=1024)
    sample.add_argument("--scheduler", default=None)

    for name, text in (("status", "print the pool's status"), ("stop", "stop a pool")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--endpoint", required=True)
        if name == "status":
            command.add_argument("--json", action="store_true")
    return parser


def _spec(args, endpoint: str):
    from .launcher import PoolSpec

    return PoolSpec(
        model=args.model, nproc=args.nproc, endpoint=endpoint, parallel=config_from_args(args),
        text_encoders=args.text_encoders, dtype=args.dtype, threads_per_rank=args.threads_per_rank,
    )


def serve(args) -> int:
    from .launcher import Pool

    pool = Pool(_spec(args, args.endpoint))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    pool.start()
    print(f"xdit pool serving {args.model} on {args.endpoint} with {args.nproc} rank(s) "
          f"[{pool.spec.parallel.describe()}]", flush=True)
    while not stop.is_set() and pool.running:
        stop.wait(0.2)
    pool.stop()
    print("xdit pool stopped", flush=True)
    return 0 if pool.state != "error" else 1


def sample(args) -> int:
    from safetensors.torch import load_file, save_file

    from .launcher import Pool

    params = {"steps": args.steps, "guidance_scale": args.guidance_scale, "height": args.height, "width": args.width}
    if args.true_cfg_scale is not None:
        params["true_cfg_scale"] = args.true_cfg_scale
    if args.scheduler:
        params["scheduler"] = args.scheduler
    pool = None
    endpoint = args.endpoint
    if endpoint is None:
        if not args.model:
            raise SystemExit("sample needs --endpoint of a running pool, or --model (and --nproc) to start one")
        endpoint = free_endpoint()
        pool = Pool(_spec(args, endpoint)).start()
    interrupted = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        with PoolClient(endpoint) as client:
            start = time.perf_counter()

            def on_step(message):
                p = message.params
                print(f"step {p['index']}/{p['total']} {p['elapsed']:.2f} s", file=sys.stderr, flush=True)

            latents = client.sample(load_file(args.inputs), params, on_step=on_step, should_cancel=interrupted.is_set)
            save_file({"latents": latents.contiguous()}, args.output)
            print(f"xdit: job done in {time.perf_counter() - start:.3f} s -> {args.output}", flush=True)
            return 0
    except JobCancelledError as error:
        print(f"cancelled: {error}", file=sys.stderr)
        return 130
    except (JobFailed, PoolUnreachable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if pool is not None:
            pool.stop()


def status(args) -> int:
    with PoolClient(args.endpoint) as client:
        try:
            info = client.status()
        except PoolUnreachable as error:
            info = {"state": "unreachable", "error": str(error)}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0 if info["state"] != "unreachable" else 1


def stop(args) -> int:
    with PoolClient(args.endpoint) as client:
        client.stop()
    return 0


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return {"serve": serve, "sample": sample, "status": status, "stop": stop}[args.command](args)
    except (LayoutError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except PoolUnreachable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
