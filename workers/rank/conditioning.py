"""Conditioning a pool keeps between model calls, so a ComfyUI prompt sends it once (xDiT Model).

A model call names each conditioning tensor by a key, the hash of its dtype, shape and bytes
(`key_of`), and sends the tensor only when the pool may not hold it. The pool checks that a tensor
sent with a key hashes to it (no client can plant a tensor under another's key), keeps at most
MAX_ENTRIES / MAX_BYTES, least recently used out first, and answers a call naming a key it does not
hold with an error marked `missing`, after which the client sends the tensor again.

Every rank also keeps the conditioning it computed with, on its device in the compute dtype
(`RankConditioning`), so a later call of the same prompt moves only the latents and sigma from rank 0 to
the ranks and from the host to the GPU.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..wire.messages import key_of

MAX_ENTRIES = 64
MAX_BYTES = 2 << 30
MAX_DEVICE_BYTES = 512 << 20  # per rank, in the compute dtype: a 512-token prompt 4096 wide is 4 MiB in bf16


class NotHeld(ValueError):
    """A call names conditioning the pool does not hold (evicted, or the pool restarted): send it again."""

    missing = True


class _RecentTensors:
    """Tensors by key, at most `max_entries` and `max_bytes` of them, the least recently used dropped first."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def _held(self, key: str) -> torch.Tensor | None:
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def _keep(self, key: str, tensor: torch.Tensor) -> None:
        if self._held(key) is not None:
            return
        self._entries[key] = tensor
        self.bytes += tensor.nbytes
        while len(self._entries) > self.max_entries or (self.bytes > self.max_bytes and len(self._entries) > 1):
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.nbytes


class ConditioningCache(_RecentTensors):
    """Rank 0's conditioning by key (used from the client server's thread only)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        super().__init__(max_entries, max_bytes)

    def resolve(self, keys: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with every conditioning named in `keys` filled in; those sent along are kept."""
        tensors = dict(tensors)
        for name, key in keys.items():
            if name in tensors:
                if key_of(tensors[name]) != key:
                    raise ValueError(f"conditioning {name!r} does not hash to its key {key}; send key_of(tensor)")
                self._keep(key, tensors[name])
            elif (held := self._held(key)) is not None:
                tensors[name] = held
            else:
                raise NotHeld(f"the pool does not hold conditioning {name!r} ({key}): it was evicted or the pool "
                              "restarted; send it with the call")
        return tensors


class RankConditioning(_RecentTensors):
    """Every rank's conditioning of recent model calls, on its device, by key.

    Every rank sees the same calls in the same order (jobs.broadcast_work) and keeps and evicts them by the
    same rule, so rank 0 knows what every rank holds without asking: it leaves held conditioning out of the
    broadcast (`to_send`), and every rank fills it back in from its own copy (`on_device`).
    """

    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_DEVICE_BYTES):
        super().__init__(max_entries, max_bytes)

    def to_send(self, keys: dict[str, str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rank 0, before the broadcast: the call's tensors less the conditioning every rank holds."""
        return {name: t for name, t in tensors.items() if not (name in keys and keys[name] in self._entries)}

    def on_device(self, keys: dict[str, str], tensors: dict[str, torch.Tensor], device: torch.device,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every rank, after the broadcast: the call's tensors on `device` (floating point as `dtype`), the
        conditioning left out taken from this rank's copy, the conditioning sent kept."""
        out = {name: t.to(device, dtype if t.is_floating_point() else t.dtype) for name, t in tensors.items()}
        for name, key in keys.items():
            if name in tensors:
                self._keep(key, out[name])
            elif (held := self._held(key)) is not None:
                out[name] = held
            else:  # the ranks' copies diverged (a rank failed inside an earlier call): the call fails, loudly
                raise RuntimeError(f"this rank does not hold conditioning {name!r} ({key}) that rank 0 left out")
        return out
