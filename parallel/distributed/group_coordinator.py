"""One process group and the few collectives the engine needs on it.

Every collective short-circuits when the group has one rank, so a layout with degree 1 in some
dimension costs nothing there. `bytes_sent` counts what this rank put on the wire (the payload an
ideal implementation of the collective sends), so benchmarks can compare layouts by traffic.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class Pending:
    """A collective in flight: `wait()` blocks until it is done and returns its result. It holds the buffers the
    collective reads until then (`keep`), so they outlive the call that started it."""

    def __init__(self, work: dist.Work | None, result: Callable[[], torch.Tensor], keep: tuple = ()):
        self._work, self._result, self._keep = work, result, keep

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work, self._keep = None, ()
        return self._result()


class GroupCoordinator:
    def __init__(self, name: str, ranks: list[int], group: dist.ProcessGroup | None):
        self.name = name
        self.ranks = list(ranks)
        self.group = group
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank_in_group = self.ranks.index(self.rank)
        self.bytes_sent = 0

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name}, ranks={self.ranks}, me={self.rank_in_group})"

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member in ring order."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every member's `tensor` along `dim`, in group-rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        self.bytes_sent += tensor.nbytes * (self.world_size - 1)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Member i sends chunk j of `scatter_dim` to member j and concatenates what it receives on `gather_dim`."""
        return self.start_all_to_all(tensor, scatter_dim, gather_dim).wait()

    def start_all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> "Pending":
        """`all_to_all` started without waiting (async_op), so compute can run while it travels; `wait()` gives its
        result. Every member must start its collectives on a group in the same order."""
        if self.world_size == 1:
            return Pending(None, lambda: tensor)
        chunks = tensor.chunk(self.world_size, dim=scatter_dim)
        send = torch.stack(chunks).contiguous()
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self.bytes_sent += send.nbytes * (self.world_size - 1) // self.world_size
        return Pending(work, lambda: torch.cat(recv.unbind(0), dim=gather_dim), (send,))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        dist.all_reduce(tensor, op=op, group=self.group)
        self.bytes_sent += tensor.nbytes * 2 * (self.world_size - 1) // self.world_size
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast in place from group rank `src`."""
        if self.world_size == 1:
            return tensor
        dist.broadcast(tensor, src=self.ranks[src], group=self.group)
        if self.rank_in_group == src:
            self.bytes_sent += tensor.nbytes * (self.world_size - 1)
        return tensor

    def ring_exchange(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Start sending `tensor` to the next member and receiving the previous member's; wait on the works."""
        recv = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next_rank, group=self.group),
            dist.P2POp(dist.irecv, recv, self.prev_rank, group=self.group),
        ]
        works = dist.batch_isend_irecv(ops)
        self.bytes_sent += tensor.nbytes
        return recv, works

    def isend_next(self, tensor: torch.Tensor) -> dist.Work:
        """Send to the next member without waiting (pipeline stages); wait on the returned work."""
        tensor = tensor.contiguous()
        self.bytes_sent += tensor.nbytes
        return dist.isend(tensor, dst=self.next_rank, group=self.group)

    def recv_prev(self, buffer: torch.Tensor) -> torch.Tensor:
        """Receive into `buffer` from the previous member."""
        dist.recv(buffer, src=self.prev_rank, group=self.group)
        return buffer

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
