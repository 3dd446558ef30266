"""This machine's share of a pool, supervised: what it is made of (spec.py), its ranks started and ended (ranks.py)
where they meet (parallel/cli/rendezvous.py), watched and restarted (pool.py), and the stand-in that answers clients while rank 0
cannot (standin.py)."""

from .pool import Pool, PoolError, SettingsRefused
from .spec import PoolSpec

__all__ = ["Pool", "PoolError", "PoolSpec", "SettingsRefused"]
