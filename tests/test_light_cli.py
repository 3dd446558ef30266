"""`python -m workers status` and `stop` import neither torch nor diffusers: asking a pool how it is must not cost
a model library's import (seconds on a loaded box). The commands run for real against a real pool elsewhere
(tests/test_pool.py); here, in a fresh interpreter, what they import."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers.wire.endpoints import free_endpoint
from xdit_test_helpers import ROOT

HEAVY = ("torch", "diffusers", "transformers")


def modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))"
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return set(eval(run.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("command", ["status", "stop"])
def test_status_and_stop_import_no_model_library(command):
    code = ("from workers.cli import main\n"
            f"print(main([{command!r}, '--endpoint', {free_endpoint()!r}]))")  # nothing listens there: exit 1, one line
    assert not modules_after(code) & set(HEAVY)


def test_the_negative_control_sample_does_import_them():
    """What the test above would catch: the commands that run jobs read the engine, torch included."""
    assert "torch" in modules_after("from workers.cli import build_parser\nbuild_parser()")
