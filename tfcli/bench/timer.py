"""One timer for every cell: explicit threads, device sync, warm-up, per-block samples.

Built on ``torch.utils.benchmark.Timer``; each call of :meth:`CellTimer.block` adds one sample
(the mean time of one run within a block), so the sweep can interleave cells round by round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


@dataclass
class CellTimer:
    fn: Callable[[], object]
    device: str
    threads: int
    samples: list[float] = field(default_factory=list)  # seconds per run, one per block
    runs: int = 0
    number: int = 1  # runs per block, set by warm_up

    def _timer(self):
        from torch.utils.benchmark import Timer

        device = self.device

        def run() -> None:
            self.fn()
            synchronize(device)

        return Timer(stmt="run()", globals={"run": run}, num_threads=self.threads)

    def warm_up(self, block_seconds: float) -> float:
        """Run until lazy initialisation is done; choose runs per block. Returns one run's time."""
        timer = self._timer()
        timer.timeit(1)  # first call: allocator, kernel selection, lazy init
        once = timer.timeit(1).mean
        self.number = max(1, int(block_seconds / max(once, 1e-9)))
        return once

    def block(self) -> float:
        m = self._timer().timeit(self.number)
        self.samples.append(m.mean)
        self.runs += self.number
        return m.mean * self.number

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[2] - q[0]


def peak_memory(fn: Callable[[], object], device: str) -> tuple[int, str]:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before, and the method."""
    if device.startswith("cuda"):
        synchronize(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated() - base, "cuda max_memory_allocated"
    if device == "cpu":
        from tfcli.inspection.memory import profile_peak_bytes

        return profile_peak_bytes(fn), "profiler allocation events"
    return 0, "not measured on this device"


def calibrate_matmul(device: str, dtype: torch.dtype, threads: int, size: int = 2048,
                     seconds: float = 1.0) -> float:
    """This machine's matmul throughput (FLOP/s) for ``dtype``: the peak to compare with."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    timer = CellTimer(lambda: a @ b, device, threads)
    timer.warm_up(seconds / 5)
    while sum(timer.samples) * timer.number < seconds or len(timer.samples) < 3:
        timer.block()
    return 2 * size ** 3 / timer.median
