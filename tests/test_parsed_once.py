"""A message is read once per hop: one submit, from a client through real ZMQ sockets to rank 0 and over the
rank broadcast to rank 1, is decoded once on each rank and its request typed once on each, never again.

Every process of a real 2-rank `serve` pool imports tests/parse_counter/sitecustomize.py (on PYTHONPATH),
which counts, per process and kind, each header read (`workers.wire.protocol.read_header`: every decode on
every hop goes through it) and each typed read of a request (`parallel.fields.from_plain` of a Submit or a
SampleRequest), into a file this test reads.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from parallel.loading import tiny_models
from pool_helpers import PARAMS, reference, serving
from xdit_test_helpers import TOLERANCE

COUNTER = Path(__file__).resolve().parent / "parse_counter"


def counts(log: Path, job: str) -> collections.Counter:
    """(process, what) → how often, for the lines of `job` (and the typed reads, which carry no job id)."""
    seen = collections.Counter()
    for line in log.read_text().splitlines():
        process, what, name = line.split(" ", 2)
        if name in (job, "-"):
            seen[process, what] += 1
    return seen


def test_one_submit_is_decoded_once_per_hop(tiny_model_dirs, tmp_path, monkeypatch):
    log = tmp_path / "reads.log"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(COUNTER), os.environ.get("PYTHONPATH")))))
    monkeypatch.setenv("XDIT_PARSE_COUNTS", str(log))
    model = tiny_model_dirs["pixart-alpha"]
    inputs = tiny_models.make_inputs("pixart-alpha", height=64, width=64)
    with serving(model, tmp_path, "--nproc", "2", "--ulysses-degree", "2") as client:
        log.write_text("")  # what start-up and the idle client's status calls read is not the job's
        job = client.submit(inputs, PARAMS, job="job-counted")
        latents = client._follow(job, None, None).tensors["latents"]
    assert (latents - reference(model, "pixart-alpha", inputs)).abs().max().item() <= TOLERANCE

    seen = counts(log, "job-counted")
    ranks = sorted({process for process, _ in seen if process.startswith("rank")})
    assert ranks == ["rank0", "rank1"], seen
    for rank in ranks:
        assert seen[rank, "header:submit"] == 1, (rank, seen)  # one decode per hop
        assert seen[rank, "typed:Submit"] == 1, (rank, seen)  # its request typed once, there
        assert seen[rank, "typed:SampleRequest"] == 0, (rank, seen)  # and never parsed again as a request
