"""A link slowed down on purpose (bench only): the collectives of a timed call delayed as a real link would delay them.

    python -m bench all --link pcie4 [--gpu-tflops 400]

Over CPU loopback a collective costs almost nothing next to the compute, so how a layout and the overlap of
communication with compute behave on the links users have (PCIe, Ethernet) cannot be seen. Here each message
takes `latency + bytes / bandwidth` of the named link (parallel/layout/config.py's LINKS, the figures the link table
and `--layout auto` price), stretched by how much slower this CPU computes than the GPU the figures are for
(`scale` = the GPU's dense TFLOP/s ÷ this CPU's, one thread, measured): the communication keeps the share of a step
it would have on that GPU and link. A rank's link carries one message at a time: one sent while another travels
is delivered after it. A collective the caller waits on at once (all_to_all_single, all_gather,
send / recv, broadcast, all_reduce) returns no sooner than that; an asynchronous one (async_op=True,
batch_isend_irecv: Ring's exchange) is due that long after it started, so compute done meanwhile hides it, as on a
real link. diffusers' context parallelism (functional collectives) waits at once. PipeFusion's isend is not
delayed; its receiver waits the transfer from when it asks (pessimistic where the send went out early). Only inside `emulating()`: the product path
never sees it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from parallel.layout.config import LINKS, Link


@dataclass(frozen=True)
class EmulatedLink:
    name: str
    bytes_per_s: float  # the real link's
    latency_s: float
    scale: float  # this CPU's compute time ÷ the GPU's for the same work

    def delay(self, nbytes: float, messages: int = 1) -> float:
        return Link(self.bytes_per_s, self.latency_s).seconds(nbytes, messages) * self.scale

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def cpu_tflops(size: int = 384, repeats: int = 8) -> float:
    """This process's dense fp32 matmul speed (its threads, as the bench's ranks run), in TFLOP/s."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def link_for(name: str, gpu_tflops: float, own_tflops: float) -> EmulatedLink:
    if name not in LINKS:
        raise ValueError(f"--link {name!r}: give one of {', '.join(LINKS)}")
    return EmulatedLink(name, *LINKS[name], scale=gpu_tflops / own_tflops)


def from_spec(spec: dict, rank: int) -> tuple[EmulatedLink | None, float | None]:
    """A bench job's SPEC link ({"name", "gpu_tflops"} or absent), stretched by rank 0's measured compute speed
    (every rank gets the same), and that speed in TFLOP/s."""
    if not spec.get("link"):
        return None, None
    speed = torch.tensor([cpu_tflops() if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(speed, src=0)
    return link_for(spec["link"]["name"], spec["link"]["gpu_tflops"], speed.item()), speed.item()


def stretched(link: EmulatedLink) -> Link:
    """The link as this CPU sees it under emulation: what a model that prices this machine's compute should price."""
    return Link(link.bytes_per_s / link.scale, link.latency_s * link.scale)


def _size(group) -> int:
    return group.size() if group is not None else dist.get_world_size()


class _DueWork:
    """An asynchronous collective's work that completes no sooner than its emulated arrival."""

    def __init__(self, work, due: float):
        self._work, self._due = work, due

    def wait(self, *args, **kwargs):
        done = self._work.wait(*args, **kwargs)
        _sleep_until(self._due)
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


def _sleep_until(due: float) -> None:
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)


@contextlib.contextmanager
def emulating(link: EmulatedLink | None) -> Iterator[None]:
    """Inside: torch.distributed's collectives (and the functional ones diffusers' CP uses) delayed as `link`."""
    if link is None:
        yield
        return
    # name → (its tensor's position and keyword, its group's position, (bytes, group size) → bytes one rank puts on
    # its link and messages)
    sent = {
        "all_to_all_single": (1, "input", 4, lambda b, n: (b * (n - 1) // n, n - 1)),
        "all_gather": (1, "tensor", 2, lambda b, n: (b * (n - 1), n - 1)),
        "all_gather_into_tensor": (1, "input_tensor", 2, lambda b, n: (b * (n - 1), 1)),
        "broadcast": (0, "tensor", 2, lambda b, n: (b, 1)),
        "all_reduce": (0, "tensor", 2, lambda b, n: (2 * b * (n - 1) // n, 1)),
        "send": (0, "tensor", 2, lambda b, n: (b, 1)),
        "recv": (0, "tensor", 2, lambda b, n: (b, 1)),  # from when it is asked for: pessimistic
    }
    originals = {name: getattr(dist, name) for name in [*sent, "batch_isend_irecv"]}
    free_at = [0.0]  # when this rank's link is done with what it carries

    def due(seconds: float) -> float:
        free_at[0] = max(time.perf_counter(), free_at[0]) + seconds
        return free_at[0]
    functional = {name: getattr(funcol, name) for name in ("all_to_all_single", "all_gather_tensor")}

    def delayed(name):
        def call(*args, **kwargs):
            index, keyword, group_index, share = sent[name]
            nbytes, messages = share(_arg(args, kwargs, index, keyword).nbytes, _size(_group(args, kwargs, group_index)))
            arrives = due(link.delay(nbytes, max(messages, 1)))
            result = originals[name](*args, **kwargs)
            if kwargs.get("async_op"):
                return _DueWork(result, arrives)
            _sleep_until(arrives)
            return result
        return call

    def batch_isend_irecv(ops):  # Ring's K/V exchange: due when the larger direction has crossed
        nbytes = max(sum(op.tensor.nbytes for op in ops if op.op is dist.isend),
                     sum(op.tensor.nbytes for op in ops if op.op is dist.irecv))
        arrives = due(link.delay(nbytes))
        return [_DueWork(work, arrives) for work in originals["batch_isend_irecv"](ops)]

    def functional_call(name, group_index, sent_of):
        def call(x, *args, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[group_index - 1]
            arrives = due(link.delay(*sent_of(x, _size(group))))
            result = funcol.wait_tensor(functional[name](x, *args, **kwargs))
            _sleep_until(arrives)
            return result
        return call

    for name in sent:
        setattr(dist, name, delayed(name))
    dist.batch_isend_irecv = batch_isend_irecv
    funcol.all_to_all_single = functional_call("all_to_all_single", 3, lambda x, n: (x.nbytes * (n - 1) // n, n - 1))
    funcol.all_gather_tensor = functional_call("all_gather_tensor", 2, lambda x, n: (x.nbytes * (n - 1), n - 1))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        for name, original in functional.items():
            setattr(funcol, name, original)


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else args[index]


def _group(args: tuple, kwargs: dict, index: int):
    return kwargs.get("group", args[index] if len(args) > index else None)
