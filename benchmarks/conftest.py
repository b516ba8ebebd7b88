"""Shared pieces of the benchmark suite.

pytest-benchmark does not synchronise devices: every timed callable goes through ``synced``.
Assertions here are on ratios measured in one run (machine-independent), never on absolute
times. With --benchmark-disable each benchmark runs once as a smoke test: ratio assertions are
skipped (reported as skipped), since one run is no measurement, and so are the processes
that only serve as a timing's baseline; a command that a measuring run starts as a fresh
interpreter runs as a child forked from one that has imported torch (``processes``), and the
bounds on its peak memory are still asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

import pytest

from tfcli.bench.timer import synchronize


def synced(fn, device: str = "cpu"):
    def run():
        out = fn()
        synchronize(device)
        return out

    return run


@pytest.fixture
def measuring(request) -> bool:
    """False under --benchmark-disable: run once, assert no ratio."""
    return not request.config.getoption("benchmark_disable")


class Usage(NamedTuple):
    """One command's run: wall seconds, peak RSS (MiB), user + system CPU seconds."""

    seconds: float
    mib: float
    cpu: float


class Processes:
    """Commands (``[python, "-m", "tfcli", ...]``, ``[python, "-c", CODE]``) run as fresh
    interpreters, as a user starts them: what measuring runs time and weigh."""

    measuring = True

    # A child's ru_maxrss includes what its parent held when it forked (before exec), so the
    # command is started from a small helper interpreter rather than from this (large) process.
    HELPER = """
import os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
print(time.perf_counter() - start, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status),
      usage.ru_utime + usage.ru_stime)
"""

    def run(self, args: list[str]) -> Usage:
        out = subprocess.run([sys.executable, "-c", self.HELPER, *args], capture_output=True,
                             text=True, check=True).stdout.split()
        assert out[2] == "0", f"{args} exited with {out[2]}"
        return Usage(float(out[0]), float(out[1]), float(out[3]))

    def best_of(self, args: list[str], repeat: int) -> tuple[float, float]:
        """The fastest wall time of ``repeat`` runs and the largest peak RSS (MiB)."""
        runs = [self.run(args) for _ in range(repeat)]
        return min(r.seconds for r in runs), max(r.mib for r in runs)

    def cpu_seconds(self, args: list[str]) -> float:
        """User + system CPU seconds of one run: steadier than wall time on a machine shared
        with other work."""
        return self.run(args).cpu

    def baseline(self, args: list[str], repeat: int) -> float | None:
        """Seconds of a process that is only there to be subtracted from or divided into a
        timing (``python -c "import torch"`` beside a command): None in a smoke run, which
        asserts no timing and so does not start it."""
        return self.best_of(args, repeat)[0] if self.measuring else None


class ForkedProcesses(Processes):
    """A smoke run's commands: each a child forked from one interpreter that has already
    imported what the commands import (torch, torch._dynamo, Transformers' Llama, torchinfo),
    so that each pays only for its own work (0.4-1.7 s of CPU each instead of 1.6-4.6 s).
    Its peak RSS counts the inherited pages it touches and what it allocates: not a fresh
    process's figure, but within 70 MiB of it for these commands (forked minus fresh, measured:
    -66 to +55 MiB), well inside the bounds asserted on it (190 MiB or more above either)."""

    measuring = False

    SERVER = """
import json, os, runpy, sys, time, traceback
import torch, torch._dynamo  # torch's fake and meta tensors import torch._dynamo on first use
for name in ("transformers.models.llama.modeling_llama", "torchinfo"):
    try:
        __import__(name)
    except ImportError:
        pass
for line in sys.stdin:
    how, what, *args = json.loads(line)
    start = time.perf_counter()
    child = os.fork()
    if child == 0:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        code = 0
        try:
            if how == "-m":
                sys.argv = [what, *args]
                runpy.run_module(what, run_name="__main__", alter_sys=True)
            else:
                sys.argv = ["-c", *args]
                exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else int(end.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status, usage = os.wait4(child, 0)
    print(json.dumps([time.perf_counter() - start, usage.ru_maxrss / 1024,
                      os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime]),
          flush=True)
os._exit(0)  # stdin closed: the session is over (no teardown of torch, about a second)
"""

    def __init__(self) -> None:
        self.server = subprocess.Popen([sys.executable, "-c", self.SERVER], text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, args: list[str]) -> Usage:
        assert args[0] == sys.executable and args[1] in ("-m", "-c"), args
        self.server.stdin.write(json.dumps(args[1:]) + "\n")
        self.server.stdin.flush()
        seconds, mib, code, cpu = json.loads(self.server.stdout.readline())
        assert code == 0, f"{args} exited with {code}"
        return Usage(seconds, mib, cpu)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait()


_FORKED = pytest.StashKey[ForkedProcesses]()


def pytest_collection_finish(session) -> None:
    """A smoke run (--benchmark-disable) whose selection runs commands starts their server as
    soon as the tests are known, so that its imports overlap the in-process benchmarks; a
    selection without any starts none."""
    if session.config.getoption("benchmark_disable") and any(
            "processes" in item.fixturenames for item in session.items):
        session.config.stash[_FORKED] = ForkedProcesses()


def pytest_unconfigure(config) -> None:
    if _FORKED in config.stash:
        config.stash[_FORKED].close()


@pytest.fixture(scope="session")
def processes(request) -> Processes:
    """How commands run: fresh interpreters when measuring; in a smoke run children of one
    interpreter that imported torch once (started at collection's end)."""
    if not request.config.getoption("benchmark_disable"):
        return Processes()
    return request.config.stash[_FORKED]


PYTHON = sys.executable
TFCLI = [PYTHON, "-m", "tfcli"]
