"""What hiding communication behind attention saves, priced: the head groups of the overlapped Ulysses and Ring's
K/V prefetch (model_executor/attention/usp.py), on a link that carries one message at a time.

Both schedules are replayed as usp.py runs them: a message is due `latency + bytes / bandwidth` after both it is
sent and the link is free (one NCCL stream, or bench/emulated_link.py), and compute waits only for the data it
needs. So the overlap hides about min(transfer, the compute it can run beside), less the latency its extra messages
add; head groups are worth it only where that balance is positive (many bytes per message next to the attention
of a group), and off where latency dominates. Pure arithmetic: `--layout auto` prices every layout with it
(prediction.py) and resolves `--ulysses-overlap-groups` auto from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Link

# More head groups must save at least this share of a layer's time: the model leaves out what smaller groups cost
# besides latency (kernels' efficiency on fewer heads, a Python loop turn per group).
PAYS = 0.03


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer on one rank: its attention's compute for every head it keeps, and what it sends."""

    attention_s: float
    send_bytes: float = 0.0  # Ulysses' Q/K/V all-to-all (0: Ulysses degree 1)
    back_bytes: float = 0.0  # Ulysses' output all-to-all
    ring: int = 1  # Ring degree: the key blocks attended one after another
    exchange_bytes: float = 0.0  # one of Ring's K/V exchanges

    def seconds(self, groups: int, collective: Link, p2p: Link) -> float:
        """End to end with the heads in `groups`: every group's Q/K/V in one all-to-all, the next group's leaving
        before this group attends and this group's output after, behind it on the link; inside a group, Ring's
        next K/V block in flight while the current one is attended to."""
        group_s = self._ring_seconds(self.attention_s / groups, self.exchange_bytes / groups, p2p)
        if not self.send_bytes:
            return groups * group_s
        link = 0.0

        def send(start: float, nbytes: float) -> float:
            nonlocal link
            link = max(start, link) + collective.seconds(nbytes / groups)
            return link

        arrives, now, done = send(0.0, self.send_bytes), 0.0, 0.0
        for group in range(groups):
            now = max(now, arrives)
            if group + 1 < groups:
                arrives = send(now, self.send_bytes)
            now += group_s
            done = send(now, self.back_bytes)
        return done

    def _ring_seconds(self, attention_s: float, exchange_bytes: float, p2p: Link) -> float:
        block, exchange = attention_s / self.ring, p2p.seconds(exchange_bytes)
        arrives, now = exchange, block  # the first exchange leaves before the local block is attended to
        for step in range(1, self.ring):
            now = max(now, arrives)
            if step + 1 < self.ring:
                arrives = now + exchange
            now += block
        return now if self.ring > 1 else attention_s

    def serial_seconds(self, collective: Link, p2p: Link) -> float:
        """Nothing overlapped: every message, then the attention."""
        ulysses = collective.seconds(self.send_bytes + self.back_bytes, 2) if self.send_bytes else 0.0
        ring = p2p.seconds(self.exchange_bytes * (self.ring - 1), self.ring - 1)
        return ulysses + ring + self.attention_s

    def best_groups(self, heads: int, collective: Link, p2p: Link) -> int:
        """The head group count (1: off; at most one group per head of the `heads` this rank keeps) whose layer is
        fastest, a larger count only where it saves at least PAYS of the layer."""
        if not self.send_bytes:
            return 1
        best, best_s = 1, self.seconds(1, collective, p2p)
        for groups in range(2, heads + 1):
            seconds = self.seconds(groups, collective, p2p)
            if seconds < best_s * (1 - PAYS):
                best, best_s = groups, seconds
        return best


def head_groups(heads: int, setting: int | None) -> int:
    """The head groups a layer runs with, from `--ulysses-overlap-groups` (at most one per head). None, left
    unresolved (degrees given, no `--layout auto` to price the link), is off: on a latency-bound link groups cost
    more than they hide (measured), and over loopback nothing is left to hide them behind."""
    return 1 if setting is None else max(1, min(setting, heads))
