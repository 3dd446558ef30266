"""The layouts the benchmark times, and which suite times which, on how many ranks.

Every torchrun job runs one rank count. Its 1-rank baseline runs the plain diffusers pipeline on rank 0
while the other ranks wait in a gloo barrier (a blocking socket read, not a spin: measured to leave
rank 0's time unchanged), so T(1) is taken with the same one thread per rank, in the same process,
interleaved round by round with the N-rank layouts it is compared against. The wrapped 1-rank
pipeline needs a world of exactly one rank (degrees must multiply to the world size), so the
overhead suite is its own 1-rank job.

Two single-thread processes need not run at full speed side by side (SMT siblings, a shared host,
memory bandwidth). The calibration layout diffusers-1-xN runs the plain 1-rank job on all N ranks at
once, with no communication: T(1) / T(xN) is the efficiency the machine itself allows, measured in the
same rounds, and the report divides every N-rank efficiency of that job by it ("vs hardware").
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout.config import ParallelConfig


@dataclass(frozen=True)
class Layout:
    name: str
    engine: str  # diffusers: the plain pipeline (rank 0 only); xdit: our wrapper; diffusers-cp: enable_parallelism
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    true_cfg: bool = False  # Flux's real CFG (true_cfg_scale > 1): two transformer calls per step
    replicas: int = 1  # diffusers only: this many ranks each run the whole 1-rank job at the same time
    overlap_groups: int | None = None  # xdit Ulysses head groups (usp.py, `--ulysses-overlap-groups`): 1 off

    @property
    def ranks(self) -> int:
        return self.ulysses * self.ring * self.cfg * self.replicas

    @property
    def baseline(self) -> str:
        """The 1-rank layout this one's efficiency is measured against (same guidance, same work)."""
        return "diffusers-1-cfg" if self.true_cfg else "diffusers-1"

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(cfg_degree=self.cfg, ring_degree=self.ring, ulysses_degree=self.ulysses,
                              ulysses_overlap_groups=self.overlap_groups)

    def describe(self) -> str:
        if self.replicas > 1:
            return f"{self.engine} 1 rank, {self.replicas} copies at once (hardware ceiling)"
        degrees = [f"{k}{v}" for k, v in (("U", self.ulysses), ("R", self.ring), ("CFG", self.cfg)) if v > 1]
        return (f"{self.engine} {'×'.join(degrees) or '1 rank'}" + (" (true CFG)" if self.true_cfg else "")
                + (" (no overlap)" if self.overlap_groups == 1 else ""))


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("diffusers-1", "diffusers"),
        Layout("diffusers-1-cfg", "diffusers", true_cfg=True),
        Layout("diffusers-1-x2", "diffusers", replicas=2),
        Layout("diffusers-1-x4", "diffusers", replicas=4),
        Layout("xdit-1", "xdit"),
        Layout("xdit-ulysses2", "xdit", ulysses=2, overlap_groups=2),  # the overlap on (degrees given, auto is off)
        Layout("xdit-ulysses2-no-overlap", "xdit", ulysses=2, overlap_groups=1),
        Layout("xdit-ring2", "xdit", ring=2),
        Layout("xdit-cfg2", "xdit", cfg=2, true_cfg=True),
        Layout("xdit-ulysses2-ring2", "xdit", ulysses=2, ring=2),
        Layout("diffusers-cp-ulysses2", "diffusers-cp", ulysses=2),
        Layout("diffusers-cp-ring2", "diffusers-cp", ring=2),
    )
}

# suite -> {ranks in the torchrun job: layouts timed together, baselines first}
SUITES: dict[str, dict[int, list[str]]] = {
    "overhead": {1: ["diffusers-1", "xdit-1"]},
    "efficiency": {
        2: ["diffusers-1", "diffusers-1-cfg", "diffusers-1-x2", "xdit-ulysses2", "xdit-ring2", "xdit-cfg2"],
        4: ["diffusers-1", "diffusers-1-x4", "xdit-ulysses2-ring2"],
    },
    "diffusers-cp": {
        2: ["diffusers-1", "diffusers-1-x2", "xdit-ulysses2", "xdit-ulysses2-no-overlap", "xdit-ring2",
            "diffusers-cp-ulysses2", "diffusers-cp-ring2"],
    },
}


def jobs_for(suites: list[str]) -> dict[int, list[str]]:
    """One job per rank count with the union of the suites' layouts, so `all` times each layout once."""
    jobs: dict[int, list[str]] = {}
    for suite in suites:
        for ranks, names in SUITES[suite].items():
            jobs.setdefault(ranks, [])
            jobs[ranks] += [n for n in names if n not in jobs[ranks]]
    return jobs
