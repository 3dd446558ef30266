"""The work every rank runs, as rank 0 decided it: broadcast with the wire's own codec.

Rank 0 holds each job as the typed message its server read (wire/messages.py), already checked against the
family; it sends that message to the other ranks over a gloo group (so the same code works under NCCL): the
header's length, the header, then each tensor. The other ranks read the header against the work kinds below
and build the tensors the broadcast fills: one read of the message per rank, none after. Rank 0 keeps its own
object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from ..engine import fields
from ..wire import protocol
from ..wire.messages import Decode, Evaluate, Kind, Submit
from ..wire.protocol import Message


class ModelCall(Evaluate, kind="model_call"):
    """A model call as the ranks run it: its conditioning filled in from what earlier calls sent (rank 0's cache),
    and whether the ranks gather their memory for the status afterwards (at most once a second)."""

    census: bool = fields.declared(False)


class Probe(Kind, kind="probe"):
    """Between jobs, every second: an all-reduce that notices a lost peer (and keeps gloo's timeout away)."""



class Shutdown(Kind, kind="shutdown"):
    """The pool stops: every rank leaves the job loop."""



WORK_KINDS: dict[str, type[Kind]] = {kind.TYPE: kind for kind in (Submit, Decode, ModelCall, Probe, Shutdown)}


def broadcast_work(work: Message | None, group: dist.ProcessGroup | None) -> Message:
    """Rank 0 passes `work`; every rank returns the same message."""
    if dist.get_rank() == 0:
        assert work is not None
        header, tensors = protocol.encode_header(work)
        length = torch.tensor([len(header)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=group)
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8) if dist.get_rank() == 0 else torch.empty(int(length), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=group)
    if dist.get_rank() == 0:
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=group)
        return work
    read = protocol.read_header(payload.numpy().tobytes(), WORK_KINDS, max_bytes=int(length))
    received = {}
    for name, dtype, shape in protocol.check_specs(read, WORK_KINDS):
        received[name] = torch.empty(shape, dtype=dtype)
        dist.broadcast(received[name], src=0, group=group)
    return protocol.assemble(read, received)
