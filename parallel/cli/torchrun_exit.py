"""Ending a torchrun worker on a user mistake with one `error:` line and no torchrun traceback.

torchrun turns a worker's non-zero exit into ~40 lines of ChildFailedError traceback. Rank 0, once it
has printed its one line, SIGKILLs its torchrun agent instead (the shell sees exit status 137); every
rank of the agent then dies by its parent-death signal (launch.die_with_parent). Other ranks only wait for that, so rank 0's
line is always printed first. Outside torchrun this is a plain exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time

OTHER_RANKS_WAIT_S = 30.0  # a rank whose rank 0 did not fail alike exits by itself after this


def _parent_is_torchrun() -> bool:
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            command = cmdline.read()
    except OSError:
        return False
    return b"torch.distributed.run" in command or b"torchrun" in command


def exit_after_work(code: int) -> None:
    """Exit a torchrun worker that has finished (its process group destroyed) with `code`, skipping the interpreter's
    teardown: there gloo's threads abort the process now and then ("terminate called without an active exception",
    about 1 run in 10 of a 2-rank bench job, with no Python frame left), turning a finished run into exit -6."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_quietly(code: int) -> None:
    """Exit with `code`; under torchrun, stop the whole run without its traceback (see the module)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _parent_is_torchrun():
        if os.environ.get("RANK", "0") == "0":
            os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(OTHER_RANKS_WAIT_S)
    os._exit(code)
