"""What the overlapped Ulysses hides (usp.py's head groups), on an emulated link: one USP attention call timed with
its heads in 1 group (no overlap) and in more, every all-to-all held until `--link` would have delivered it.

    python -m bench.overlap [--link 0.2,30] [--ranks 2] [--heads 16] [--tokens 2048] [--head-dim 64]
                            [--groups 1,2,4,8] [--runs 5] [--json OUT.json]

The ranks run over gloo on this machine's CPUs, one thread each; `--link` (config.Link.parse: nvlink, pcie4,
25gbe, 10gbe or GBYTES_PER_S,LATENCY_US) delays each collective's completion to when a link of that bandwidth and
latency, carrying this rank's messages one after another, would finish it (bench/emulated_link.py, unscaled; the
real loopback transfer still runs underneath). The default, 0.2 GB/s, makes the transfer about a fifth of a call next to this CPU's attention, as
over Ethernet next to a GPU's. So the time a schedule saves is the transfer it hides behind attention, as on a GPU
whose copies run beside its compute; what a GPU would add (NCCL's own cost, the kernels' efficiency on smaller head
groups) is not here.
Every rank checks that each group count's output equals one group's bit for bit.

`--loopback` measures instead what the overlap has to work with over plain loopback (no emulated link): Q, K and
V's all-to-all alone, the attention alone, and the two at once (the all-to-all in flight while the attention runs,
as a head group's schedule does). Where together ≈ alone + alone, the copies compete with the attention for the same
cores and there is nothing to hide them behind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

from parallel.cli.launch import ROOT, rank_environment, torchrun_command
from parallel.cli.torchrun_exit import exit_after_work
from parallel.layout.config import Link

from .emulated_link import EmulatedLink, emulating


def rank_main(args: argparse.Namespace) -> None:
    import torch

    from parallel.distributed import (destroy_distributed_environment, get_ring_group, get_ulysses_group,
                                      init_distributed_environment, initialize_model_parallel)
    from parallel.layout.config import ParallelConfig

    torch.set_num_threads(1)
    world = init_distributed_environment(backend="gloo")
    initialize_model_parallel(ParallelConfig(ulysses_degree=world.world_size))
    torch.manual_seed(world.rank)
    rows = (_loopback_costs(args, world, get_ulysses_group()) if args.loopback
            else _group_times(args, world, get_ulysses_group(), get_ring_group()))
    if world.rank == 0:
        Path(args.rank_json).write_text(json.dumps(rows))
    destroy_distributed_environment()


def _group_times(args: argparse.Namespace, world, ulysses, ring) -> list[dict]:
    """One USP attention call under the emulated link, with its heads in each group count: median ms, and whether
    its output equals the first count's bit for bit."""
    import torch

    from parallel.model_executor.attention import pick_kernel, usp_attention

    link = Link.parse(args.link)  # its own bandwidth: the default is already slow next to this CPU
    emulated = EmulatedLink(args.link, link.bytes_per_s, link.latency_s, scale=1.0)
    q, k, v = torch.randn(3, 1, args.heads, args.tokens // world.world_size, args.head_dim).unbind(0)
    kernel = pick_kernel(q)
    rows, reference = [], None
    for groups in args.groups:
        def call():
            with emulating(emulated):
                return usp_attention(q, k, v, ulysses=ulysses, ring=ring, kernel=kernel, head_groups=groups)

        out = call()
        reference = out if reference is None else reference
        rows.append({"groups": groups, "ms": _median_ms(world, call, args.runs),
                     "equal": bool(torch.equal(out, reference))})
    return rows


def _median_ms(world, run, runs: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(runs):
        world.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _loopback_costs(args: argparse.Namespace, world, ulysses) -> list[dict]:
    """--loopback: Q, K, V's all-to-all, one rank's attention after it, and both at once, each its median ms."""
    import torch

    from parallel.model_executor.attention import pick_kernel

    local = torch.randn(3, 1, args.heads, args.tokens // world.world_size, args.head_dim).unbind(0)
    q, k, v = (torch.randn(1, args.heads // world.world_size, args.tokens, args.head_dim) for _ in range(3))
    kernel = pick_kernel(q)

    def exchange():
        return [ulysses.start_all_to_all(t, scatter_dim=1, gather_dim=2) for t in local]

    def attend():
        kernel(q, k, v, args.head_dim ** -0.5)

    def together():
        handles = exchange()
        attend()
        for handle in handles:
            handle.wait()

    return [{"all_to_all_ms": _median_ms(world, lambda: [h.wait() for h in exchange()], args.runs),
             "attention_ms": _median_ms(world, attend, args.runs), "together_ms": _median_ms(world, together, args.runs)}]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", default="0.2,30", help="the emulated link (default 0.2 GB/s, 30 us)")
    parser.add_argument("--ranks", type=int, default=2, help="Ulysses degree (default 2)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048, help="sequence length, over all ranks")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=lambda text: [int(g) for g in text.split(",")], default=[1, 2, 4, 8],
                        help="head group counts to time, comma-separated; the first is the reference (default 1,2,4,8)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--loopback", action="store_true", help="time the all-to-all, the attention and both at once "
                        "over plain loopback (no emulated link) instead")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--rank-json", help=argparse.SUPPRESS)  # set by the launcher for its ranks
    args = parser.parse_args(argv)
    Link.parse(args.link)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.rank_json:
        rank_main(args)
        exit_after_work(0)  # past gloo's threads at interpreter teardown (torchrun_exit.py)
    out = args.json or ROOT / "bench" / "out" / "overlap.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    passed = ["--link", args.link, "--heads", str(args.heads), "--tokens", str(args.tokens), "--head-dim",
              str(args.head_dim), "--groups", ",".join(map(str, args.groups)), "--runs", str(args.runs),
              *(["--loopback"] if args.loopback else [])]
    done = subprocess.run(torchrun_command(args.ranks, "-m", "bench.overlap", *passed, "--rank-json", str(out)),
                          cwd=ROOT, env=rank_environment(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rows = json.loads(out.read_text())
    if args.loopback:
        row = rows[0]
        print(f"Ulysses {args.ranks} over loopback, {args.heads} heads × {args.tokens} tokens × {args.head_dim}: Q/K/V "
              f"all-to-all {row['all_to_all_ms']:.2f} ms, attention {row['attention_ms']:.2f} ms, both at once "
              f"{row['together_ms']:.2f} ms (hidden: {row['all_to_all_ms'] + row['attention_ms'] - row['together_ms']:.2f} ms)")
        return rows
    base = rows[0]["ms"]
    print(f"USP attention, Ulysses {args.ranks}, {args.heads} heads × {args.tokens} tokens × {args.head_dim}, "
          f"emulated link {args.link}:")
    for row in rows:
        print(f"  {row['groups']} head group(s): {row['ms']:8.2f} ms  ({base / row['ms']:.2f}x)  "
              f"equal to {rows[0]['groups']} group(s): {row['equal']}")
    return rows


if __name__ == "__main__":
    main()
