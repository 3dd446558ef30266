"""Which card each rank of this machine uses and how NCCL reaches the others, decided before NCCL starts.

Consumer boxes break NCCL's defaults in three ways, and each is decided here, from three device queries only
(so the decision is unit-tested with the queries stubbed, tests/test_devices.py):

- **No peer access.** Cards that cannot read each other's memory (most GeForce cards, some boards and IOMMU
  settings) make NCCL's peer-to-peer transport hang at the first collective instead of failing. Where any two of
  this machine's cards lack peer access (`torch.cuda.can_device_access_peer`), the ranks set NCCL_P2P_DISABLE=1
  before NCCL starts (NCCL then goes through host memory), log it, and the pool's status says `p2p: off`. A
  NCCL_P2P_DISABLE the user set is kept as given. Nothing is refused: where peer access exists, nothing changes.
- **Mixed cards.** Every rank holds the same share of the model and waits for the others at every collective, so
  the smallest card limits the model and the slowest paces the step. The status lists every card and says when
  they differ (`mixed_cards`); rank 0, which alone also holds the text encoders, the VAE and the client endpoint,
  is placed on the card with the most memory.
- **More ranks than cards.** NCCL refuses two ranks on one card, deep inside its start-up. A rank count above the
  card count is refused here in one line, unless `--share-gpus` asks for it: then the cards are shared round-robin
  and the world runs over gloo (which copies CUDA tensors through host memory for its collectives; the layouts
  that need point-to-point sends or FSDP's collectives are refused for it in layout/config.py).

Without CUDA the ranks run on the CPU over gloo and none of this applies.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from typing import Protocol

P2P_ENV = "NCCL_P2P_DISABLE"


class DeviceError(ValueError):
    """This machine's cards cannot run the requested ranks; one line naming the numbers and the fix."""


@dataclass(frozen=True)
class Card:
    index: int  # the CUDA index as the ranks see it (after CUDA_VISIBLE_DEVICES / --devices)
    name: str
    memory_bytes: int
    multiprocessors: int
    capability: tuple[int, int]

    def describe(self) -> str:
        return f"cuda:{self.index} {self.name} ({self.memory_bytes / 2**30:.0f} GiB, {self.multiprocessors} SMs)"


class DeviceQueries(Protocol):
    def count(self) -> int: ...

    def card(self, index: int) -> Card: ...

    def peer(self, source: int, target: int) -> bool: ...


class CudaQueries:
    """The real queries (torch.cuda); the tests stub this class's three methods."""

    def count(self) -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def card(self, index: int) -> Card:
        import torch

        p = torch.cuda.get_device_properties(index)
        return Card(index, p.name, p.total_memory, p.multi_processor_count, (p.major, p.minor))

    def peer(self, source: int, target: int) -> bool:
        import torch

        return torch.cuda.can_device_access_peer(source, target)


@dataclass(frozen=True)
class DevicePlan:
    """The decision for this machine's `ranks` ranks; every rank of the machine computes the same one."""

    ranks: int
    cards: tuple[Card, ...] = ()  # every card the ranks may use; () on a CPU machine
    order: tuple[int, ...] = ()  # the card index of local rank r is order[r % len(order)]
    p2p: str = "n/a"  # "on", "off" (NCCL_P2P_DISABLE=1), or "n/a" (one card, or none)
    environment: dict[str, str] = field(default_factory=dict)  # what to set before NCCL starts
    shared: bool = False  # more ranks than cards (--share-gpus): the world runs over gloo
    notes: tuple[str, ...] = ()  # what the log says

    @property
    def backend(self) -> str:
        return "nccl" if self.cards and not self.shared else "gloo"

    def device_of(self, local_rank: int) -> int | None:
        """The CUDA index local rank `local_rank` runs on; None on the CPU."""
        return self.order[local_rank % len(self.order)] if self.order else None

    @property
    def mixed(self) -> bool:
        used = {self.device_of(r) for r in range(self.ranks)} if self.cards else set()
        kinds = {(c.name, c.memory_bytes, c.multiprocessors) for c in self.cards if c.index in used}
        return len(kinds) > 1

    @property
    def smallest(self) -> Card | None:
        used = [c for c in self.cards if c.index in {self.device_of(r) for r in range(self.ranks)}]
        return min(used, key=lambda c: (c.memory_bytes, c.index)) if used else None

    def status(self) -> dict:
        """The pool status' fields: `p2p`, `cards` (one row per local rank: its card), `mixed_cards`."""
        by_index = {c.index: c for c in self.cards}
        rows = [{"rank": r, **asdict(by_index[self.device_of(r)])} for r in range(self.ranks)] if self.cards else []
        return {"p2p": self.p2p, "cards": rows, "mixed_cards": self.mixed}


def plan_devices(ranks: int, queries: DeviceQueries | None = None, share_gpus: bool = False,
                 environment: dict[str, str] | None = None) -> DevicePlan:
    """The plan for `ranks` ranks on this machine (`environment`: this process's, for a NCCL_P2P_DISABLE the user
    set). Raises DeviceError for more ranks than cards without `share_gpus`."""
    queries = queries or CudaQueries()
    environment = os.environ if environment is None else environment
    count = queries.count()
    if count == 0:
        return DevicePlan(ranks)
    if ranks > count and not share_gpus:
        raise DeviceError(f"{ranks} ranks on this machine but {count} CUDA card{'s' * (count > 1)}: NCCL takes one card "
                          f"per rank; use {count} rank{'s' * (count > 1)} (--nproc / --nproc-per-node), or add "
                          "--share-gpus to share the cards (over gloo, slower)")
    cards = tuple(queries.card(i) for i in range(count))
    pool = cards if ranks > count else cards[:ranks]  # shared round-robin, or the first `ranks` cards as before
    biggest = max(pool, key=lambda c: (c.memory_bytes, -c.index))
    order = (biggest.index, *[c.index for c in pool if c is not biggest])
    notes: list[str] = []
    used = sorted(set(order))
    missing = [(a, b) for a in used for b in used if a != b and not queries.peer(a, b)]
    env: dict[str, str] = {}
    if len(used) < 2:
        p2p = "n/a"
    elif P2P_ENV in environment:
        p2p = "off" if environment[P2P_ENV] not in ("", "0") else "on"
        notes.append(f"NCCL peer-to-peer {p2p}: {P2P_ENV}={environment[P2P_ENV]} as set")
    elif missing:
        p2p, env = "off", {P2P_ENV: "1"}
        pairs = ", ".join(f"{a}→{b}" for a, b in missing[:4]) + (" …" if len(missing) > 4 else "")
        notes.append(f"NCCL peer-to-peer off ({P2P_ENV}=1): cards without peer access ({pairs}); collectives go "
                     "through host memory")
    else:
        p2p = "on"
    plan = DevicePlan(ranks, cards, order, p2p, env, ranks > count)
    if plan.shared:
        notes.append(f"{ranks} ranks share {count} card{'s' * (count > 1)} (--share-gpus): the world runs over gloo")
    if plan.mixed:
        smallest = plan.smallest
        notes.append(f"mixed cards: {'; '.join(c.describe() for c in cards if c.index in used)}. Every rank holds the "
                     f"same share of the model, so {smallest.describe()} sets the limit and the slowest card paces "
                     f"each step; rank 0 (text encoders, VAE, client endpoint) runs on cuda:{order[0]}")
    return replace(plan, notes=tuple(notes))


def check_rank_count(ranks: int, devices: str | None, share_gpus: bool, queries: DeviceQueries | None = None) -> None:
    """Before a pool starts (no CUDA context made): `ranks` per machine against the cards `devices` (a
    CUDA_VISIBLE_DEVICES list, e.g. "0,1") names, or every card."""
    count = len([d for d in devices.split(",") if d.strip()]) if devices else (queries or CudaQueries()).count()
    if count and ranks > count and not share_gpus:
        where = f"--devices {devices} names" if devices else "this machine has"
        raise DeviceError(f"--nproc {ranks} but {where} {count} CUDA card{'s' * (count > 1)}: NCCL takes one card per "
                          f"rank; use --nproc {count}, or add --share-gpus to share the cards (over gloo, slower)")


_PLAN: DevicePlan | None = None


def apply(plan: DevicePlan) -> DevicePlan:
    """In a rank, before the process group starts: NCCL's environment, this rank's card, the log lines (local rank 0)."""
    global _PLAN
    os.environ.update(plan.environment)
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = plan.device_of(local)
    if device is not None:
        import torch

        torch.cuda.set_device(device)
    if local == 0:
        for note in plan.notes:
            print(f"xdit: {note}", flush=True)
    _PLAN = plan
    return plan


def status_fields() -> dict:
    """This machine's plan for the pool's status (empty before a rank applied one)."""
    return _PLAN.status() if _PLAN is not None else {}
