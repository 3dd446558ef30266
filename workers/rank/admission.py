"""Admission control at submit: refuse at once a job the pool should not start, naming the limit.

A job's size is its output pixels (batch × frames × height × width; a video's frames from its latent
frames and the pipeline's frames per latent frame) and its steps. Limits:
- `--max-megapixels`: the job's output megapixels;
- `--max-job-seconds`: its estimated run time;
- always, memory: its estimated peak must fit what this machine has free (CUDA's free memory on a GPU,
  MemAvailable on CPU), so a job can never take the machine down.
The estimates come from this pool's own last job (its seconds per step and peak memory above rest),
scaled linearly to the new job's pixels, and only up to MAX_SCALE times its size: from a much smaller
job, fixed per-step costs would make them far too high (and attention, quadratic in tokens, too low),
so such a job is not refused on a guess; before the first job, only --max-megapixels applies. Past
every limit, cancel and stop still work inside a step (jobs.CancelPoints).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEMORY_HEADROOM = 0.9  # of the free memory a job may plan to use
MAX_SCALE = 64.0  # the largest size ratio to the last job an estimate is trusted for


@dataclass(frozen=True)
class Measured:
    megapixels: float
    step_seconds: float
    peak_bytes: int


def megapixels(batch: int, height: int, width: int, frames: int = 1) -> float:
    return batch * frames * height * width / 1e6


def free_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Admission:
    def __init__(self, max_megapixels: float = 0.0, max_job_seconds: float = 0.0):
        self.max_megapixels, self.max_job_seconds = max_megapixels, max_job_seconds
        self.last: Measured | None = None

    def record(self, size: float, steps: int, seconds: float, peak_bytes: int) -> None:
        """What a finished job measured (rank 0's view: it runs what every rank runs, and answers clients)."""
        if size > 0 and steps > 0:
            self.last = Measured(size, seconds / steps, peak_bytes)

    def estimate(self, size: float, steps: int) -> tuple[float, int] | None:
        """Seconds and peak bytes for a job of `size` megapixels and `steps` steps; None without a job to scale from."""
        if self.last is None or size > MAX_SCALE * self.last.megapixels:
            return None
        ratio = size / self.last.megapixels
        return steps * self.last.step_seconds * ratio, int(self.last.peak_bytes * ratio)

    def check(self, size: float, steps: int) -> None:
        """Raise ValueError with the limit and how to raise it, for a job that must not start."""
        if self.max_megapixels and size > self.max_megapixels:
            raise ValueError(f"the job is {size:.1f} megapixels (batch × frames × height × width); this pool takes at most "
                             f"{self.max_megapixels:g} (--max-megapixels): ask for fewer pixels or restart the pool with a higher limit")
        estimate = self.estimate(size, steps)
        if estimate is None:
            return
        seconds, peak = estimate
        if self.max_job_seconds and seconds > self.max_job_seconds:
            raise ValueError(f"the job would take about {seconds:.0f} s ({steps} steps at {size:.1f} megapixels, scaled from "
                             f"the last job's {self.last.step_seconds:.2f} s per step at {self.last.megapixels:.2f}); this pool "
                             f"takes jobs up to {self.max_job_seconds:g} s (--max-job-seconds): ask for fewer steps or pixels "
                             "or restart the pool with a higher limit")
        free = free_bytes()
        if free and peak > MEMORY_HEADROOM * free:
            raise ValueError(f"the job would need about {peak / 2**30:.1f} GiB more memory per rank at {size:.1f} megapixels "
                             f"(scaled from the last job's {self.last.peak_bytes / 2**30:.2f} GiB at {self.last.megapixels:.2f}) "
                             f"but {free / 2**30:.1f} GiB is free: ask for fewer pixels or a smaller batch, or use more ranks")
