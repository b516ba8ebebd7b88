"""One timer for every cell: explicit threads, device sync, warm-up, per-block samples.

Built on ``torch.utils.benchmark.Timer``; each call of :meth:`CellTimer.block` adds one sample
(the mean time of one run within a block), so the sweep can interleave cells round by round.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

# A cell whose IQR exceeds this share of its median is not reliable (pyperf warns likewise when
# the standard deviation passes 10 % of the mean): neighbouring processes, frequency changes or
# too few samples moved its runs more than the differences a sweep is meant to show.
RELIABLE_DISPERSION = 0.10
CALIBRATION_SIZE = 1024  # n of the n×n matmul timed as the device's peak: 2n³ FLOPs per run


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
    wall: float = 0.0  # seconds the blocks took on the clock, the timing's own work included

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
        start = time.perf_counter()
        m = self._timer().timeit(self.number)
        self.samples.append(m.mean)
        self.runs += self.number
        self.wall += time.perf_counter() - start
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

    @property
    def dispersion(self) -> float | None:
        """IQR / median of the samples so far (None before any)."""
        return self.iqr / self.median if self.samples and self.median > 0 else None

    @property
    def spent(self) -> float:
        """Seconds of measured runs (what --min-time asks for). Less than the blocks took
        (``wall``): each block also sets up its timer and synchronises, which for a cell of
        well under a millisecond adds more than half as much again (1.6 times on a quiet
        machine)."""
        return sum(self.samples) * self.number

    def reliable(self) -> bool:
        d = self.dispersion
        return len(self.samples) >= 3 and d is not None and d <= RELIABLE_DISPERSION


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


def matmul_timer(device: str, dtype: torch.dtype, threads: int,
                 size: int = CALIBRATION_SIZE) -> CellTimer:
    """A timer of one n×n matmul: the device's peak FLOP/s for ``dtype`` (2n³ / median). The
    sweep runs a block of it in every round, beside the cells, so the peak is measured under the
    same conditions as they are."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return CellTimer(lambda: a @ b, device, threads)


def calibrate_matmul(device: str, dtype: torch.dtype, threads: int,
                     size: int = CALIBRATION_SIZE, seconds: float = 1.0) -> float:
    """This machine's matmul throughput (FLOP/s) for ``dtype``, measured on its own."""
    timer = matmul_timer(device, dtype, threads, size)
    timer.warm_up(seconds / 5)
    while timer.spent < seconds or len(timer.samples) < 3:
        timer.block()
    return 2 * size ** 3 / timer.median


def machine_state(window: float = 0.25, since: "Contention | None" = None) -> dict:
    """What else the machine is doing: load averages and how many CPUs were busy (non-idle
    jiffies in /proc/stat over ``window`` seconds, in CPUs). With ``since`` (a Contention
    started earlier), no wait: the CPUs other processes kept busy from then to now
    (``others_busy_cpus``). Empty where /proc is absent."""
    state: dict = {"cpus": os.cpu_count()}
    try:
        state["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    if since is not None:
        others = since.others()
        if others is not None:
            state["others_busy_cpus"] = others
        return state
    try:
        first = _cpu_jiffies()
        time.sleep(window)
        second = _cpu_jiffies()
    except (OSError, ValueError):
        return state
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])  # idle + iowait
    if total > 0:
        state["busy_cpus"] = round((total - idle) / total * len(_cpu_lines()), 2)
    return state


class Contention:
    """What other processes took from a cell since this object was made, two ways (None where
    /proc lacks the figures):

    - :meth:`others`: how many CPUs they kept busy, the machine's non-idle time (/proc/stat) less
      this process's own CPU time, over the wall time;
    - :meth:`waited`: the share of the time this process's threads were ready to run that they
      spent waiting for a CPU (the run-queue delay the scheduler keeps per thread in
      /proc/self/task/*/schedstat). This one needs no CPU count, so it holds where /proc/stat
      does not describe the CPUs this process may use (a cgroup quota, a VM's stolen time)."""

    def __init__(self) -> None:
        try:
            self.cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = os.cpu_count() or 1
        self.start = self._now()
        self.start_threads = _thread_schedstats()

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        try:
            jiffies = _cpu_jiffies()
        except (OSError, ValueError):
            return None
        busy = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")
        return busy, time.process_time(), time.monotonic()

    def others(self) -> float | None:
        now = self._now()
        if self.start is None or now is None or now[2] - self.start[2] < 0.05:
            return None
        busy, own, wall = (b - a for a, b in zip(self.start, now, strict=True))
        return round(min(max((busy - own) / wall, 0.0), float(self.cpus)), 2)

    def waited(self) -> tuple[float, float] | None:
        """(share of the threads' ready time spent waiting, seconds waited in all)."""
        now = _thread_schedstats()
        ran = waited = 0
        for tid, (run, wait) in now.items():  # threads alive at both readings
            if tid in self.start_threads:
                ran += run - self.start_threads[tid][0]
                waited += wait - self.start_threads[tid][1]
        if ran + waited <= 0 or waited < 0:
            return None
        return round(waited / (ran + waited), 3), waited / 1e9


def _thread_schedstats() -> dict[str, tuple[int, int]]:
    """Per thread of this process: nanoseconds on a CPU and waiting on a run queue."""
    stats = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return stats
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            stats[tid] = (int(run), int(wait))
        except (OSError, ValueError):
            continue  # the thread ended, or the kernel keeps no schedstat
    return stats


def _cpu_lines() -> list[str]:
    with open("/proc/stat") as f:
        return [line for line in f if line.startswith("cpu") and line[3].isdigit()]


def _cpu_jiffies() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]
