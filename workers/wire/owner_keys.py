"""The owner's own CURVE keys: the folder every pool and client of one user finds by itself.

A pool's client endpoint is CURVE-authenticated even on loopback, because loopback is shared by every user of
the machine. For that to cost the owner nothing, `serve`, the one-shot `sample`, the ComfyUI nodes' pools and
every PoolClient of one user agree on one folder without being told: $XDIT_CURVE_DIR if set, else
<cache>/xdit-pool/keys ($XDG_CACHE_HOME, else ~/.cache), in the layout `python -m workers keys` writes
(auth.create_keys), created on first use. Another user cannot read it, so their clients fail at the handshake.

The folder must be private (this user's, closed to group and others): anyone who can read it can pass for
the owner. One that is not is refused, not repaired: someone may have opened it on purpose.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from .auth import ENV, SERVER, create_keys

FIX = f"set {ENV} to a folder of your own"


def folder() -> Path:
    """Where this user's keys are (whether or not they exist yet)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "xdit-pool" / "keys"


def owner_folder() -> Path:
    """This user's key folder, with its keys written on first use; refused (ValueError, one line) if not private."""
    path = folder()
    try:
        if not path.is_dir() or not any(path.iterdir()):
            _create(path)
        check_private(path)
    except PermissionError as error:
        raise ValueError(f"cannot use the CURVE key folder {path}: permission denied on {error.filename} "
                         f"(another user's folder?); {FIX}") from None
    return path


def check_private(path: Path) -> None:
    info = path.stat()
    if info.st_uid != os.getuid():
        raise ValueError(f"the CURVE key folder {path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): "
                         f"its keys would let you pass for its owner, or its owner for you; {FIX}")
    if info.st_mode & 0o077:
        raise ValueError(f"the CURVE key folder {path} is open to group or others (mode {stat.S_IMODE(info.st_mode):o}): "
                         f"anyone who reads it can pass for you; run `chmod 700 {path}`, or {FIX}")


def _create(path: Path) -> None:
    """Write the keys beside the folder and move them in at once, so two first uses at the same time (ComfyUI and
    a CLI, parallel tests) end up with one set of keys: the second move fails on the first one's folder."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))  # 0700
    try:
        create_keys(staging)
        os.replace(staging, path)  # replaces an empty folder, fails on one that holds keys
    except OSError:
        if not (path / f"{SERVER}.key_secret").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
