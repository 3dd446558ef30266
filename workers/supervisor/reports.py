"""What the supervisor does with each report of its ranks (wire/control.py): one handler per kind, in a table.

Mixed into the Pool (pool.py), whose state the handlers update: the ranks' pids, beats and readiness, the running
job and its errors, and the verdict after a job fails on every rank here alike.
"""

from __future__ import annotations

import functools
import logging
import time

from ..wire import control
from ..wire.control import Report, order

WAITING = "waiting for nodes"
STOP_GRACE_S = 3.0  # after a client's stop, ranks still busy this long are ended


class Reports:
    @functools.cached_property
    def _handlers(self):
        """What the supervisor does with each kind of report (wire/control.py)."""
        return {control.Beat: self._on_beat, control.Hello: self._on_hello, control.BindRequest: self._on_bind_request,
                control.Ready: self._on_ready, control.Failed: self._on_failed, control.WorldLost: self._on_world_lost,
                control.JobStarted: self._on_job_started, control.JobEnded: self._on_job_ended,
                control.Stopped: self._on_stopped, control.JobError: self._on_job_error}

    def _on_beat(self, identity: bytes, report: Report) -> None:
        self._beats[report.rank] = time.monotonic()
        if report.body.stopping and self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + STOP_GRACE_S

    def _on_hello(self, identity: bytes, report: Report) -> None:
        self.pids[report.rank] = report.body.pid
        if self.state == WAITING:  # torchrun starts ranks only once every node is in the rendezvous
            self.state = "starting"

    def _on_bind_request(self, identity: bytes, report: Report) -> None:
        if self._standin is not None:
            self._standin.close()
        self._control.send_multipart([identity, order(control.BindOk())])

    def _on_ready(self, identity: bytes, report: Report) -> None:
        self._beats[report.rank] = time.monotonic()
        self._ranks_ready.add(report.rank)
        self.nodes = list(report.body.nodes) or self.nodes
        if len(self._ranks_ready) == self.spec.nproc:
            self.state = "ready"
            self._ready.set()
            logging.getLogger("xdit.launcher").info("pool ready: %d of %d ranks here, restarts=%d", self.spec.nproc,
                                                    self.spec.world_size, self.restarts)

    def _on_failed(self, identity: bytes, report: Report) -> None:
        if report.body.fatal:
            self._start_failed(f"rank {report.rank} failed to start: {report.body.error}", report.body.mistake)
        else:
            self._world_broke(report.rank, report.body.error)

    def _on_world_lost(self, identity: bytes, report: Report) -> None:
        self._world_broke(report.rank, report.body.error)

    def _on_job_started(self, identity: bytes, report: Report) -> None:
        self._current_job = (report.body.job, report.body.client)
        self._job_errors = {}

    def _on_job_ended(self, identity: bytes, report: Report) -> None:
        self._current_job = None
        self.jobs_done = report.body.jobs_done

    def _on_stopped(self, identity: bytes, report: Report) -> None:
        """A client asked rank 0 to stop the pool; ranks are exiting cleanly."""
        self._stop_requested.set()

    def _on_job_error(self, identity: bytes, report: Report) -> None:
        self._job_errors.setdefault(report.rank, report.body.error)
        self._job_error_since = self._job_error_since or time.monotonic()
        if len(self._job_errors) == self.spec.nproc:  # every rank here failed alike: resume (ranks confirm world-wide)
            first = min(self._job_errors)
            verdict = order(control.Resume(rank=first, error=self._job_errors[first]))
            for r in self.spec.local_ranks:
                self._control.send_multipart([f"rank{r}".encode(), verdict])
            self._job_errors, self._job_error_since = {}, 0.0
