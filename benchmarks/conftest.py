"""Shared pieces of the benchmark suite.

pytest-benchmark does not synchronise devices: every timed callable goes through ``synced``.
Assertions here are on ratios measured in one run (machine-independent), never on absolute
times. With --benchmark-disable each benchmark runs once as a smoke test: ratio assertions are
skipped (reported as skipped), since one run is no measurement, and so are the processes
that only serve as a timing's baseline; a command that a measuring run starts as a fresh
interpreter runs as a child forked from one that has imported torch (``processes``), started
ahead of its test, two at a time beside the in-process benchmarks (a test declares its
commands with ``runs``), and the bounds on its peak memory are still asserted.
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

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
    imported what the commands import (torch, torch._dynamo, Transformers' Llama, torchinfo,
    tfcli's CLI), so that each pays only for its own work (0.3-1.6 s of CPU each instead of
    1.6-4.6 s). Its peak RSS counts the inherited pages it touches and what it allocates: not
    a fresh process's figure, but within 70 MiB of it for these commands (forked minus fresh,
    measured: -66 to +55 MiB), well inside the bounds asserted on it (190 MiB or more above
    either).

    The commands a test declares (:func:`runs`) are started *ahead*, as soon as the tests are
    collected, ``at_once`` at a time, while the session runs the tests before it (the
    in-process benchmarks); the test then takes the result of its command. A command nobody
    declared runs when asked, before any still waiting."""

    measuring = False

    SERVER = """
import json, os, runpy, select, signal, sys, time, traceback
import torch, torch._dynamo  # torch's fake and meta tensors import torch._dynamo on first use
for name in ("transformers.models.llama.modeling_llama", "torchinfo", "tfcli.cli"):
    try:
        __import__(name)
    except ImportError:
        pass
at_once = int(sys.argv[1])
waiting, running, unread = [], {}, b""
while True:
    while waiting and len(running) < at_once:
        ident, how, what, args = waiting.pop(0)
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
        running[child] = ident, start
    if select.select([0], [], [], 0.005 if running else None)[0]:
        data = os.read(0, 1 << 16)
        if not data:  # stdin closed: the session is over (no teardown of torch, about a second)
            for child in running:
                os.kill(child, signal.SIGKILL)
            os._exit(0)
        *lines, unread = (unread + data).split(b"\\n")
        for line in lines:
            ident, first, how, what, *args = json.loads(line)
            waiting.insert(0 if first else len(waiting), (ident, how, what, args))
    for child in list(running):
        done, status, usage = os.wait4(child, os.WNOHANG)
        if done:
            ident, start = running.pop(child)
            print(json.dumps([ident, time.perf_counter() - start, usage.ru_maxrss / 1024,
                              os.waitstatus_to_exitcode(status),
                              usage.ru_utime + usage.ru_stime]), flush=True)
"""

    def __init__(self, at_once: int = 2) -> None:
        self.server = subprocess.Popen([sys.executable, "-c", self.SERVER, str(at_once)],
                                       text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._lock = threading.Lock()
        self._count = itertools.count()  # requests' numbers
        self._futures: dict[int, Future] = {}  # request -> its figures, once the child ends
        self._ahead: dict[tuple[str, ...], list[Future]] = {}  # a command -> its runs ahead
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _submit(self, args: list[str], first: bool) -> Future:
        assert args[0] == sys.executable and args[1] in ("-m", "-c"), args
        with self._lock:  # the reader thread pops what it answers
            ident = next(self._count)
            future = self._futures[ident] = Future()
        self.server.stdin.write(json.dumps([ident, first, *args[1:]]) + "\n")
        self.server.stdin.flush()
        return future

    def ahead(self, commands: Iterable[list[str]]) -> None:
        """Start ``commands`` now, in order, ``at_once`` at a time (each taken by :meth:`run`
        given the same arguments)."""
        for args in commands:
            self._ahead.setdefault(tuple(args), []).append(self._submit(args, first=False))

    def run(self, args: list[str]) -> Usage:
        started = self._ahead.get(tuple(args))
        future = started.pop(0) if started else self._submit(args, first=True)
        seconds, mib, code, cpu = future.result()
        assert code == 0, f"{args} exited with {code}"
        return Usage(seconds, mib, cpu)

    def _read(self) -> None:
        for line in self.server.stdout:
            ident, *figures = json.loads(line)
            with self._lock:
                future = self._futures.pop(ident)
            future.set_result(figures)
        with self._lock:  # the server is gone: nothing still asked for will come
            left, self._futures = list(self._futures.values()), {}
        for future in left:
            future.set_exception(RuntimeError("the smoke run's fork server ended"))

    def untaken(self) -> list[tuple[str, ...]]:
        """Commands started ahead that no test has asked for (yet)."""
        return [args for args, started in self._ahead.items() for _ in started]

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait()
        self._reader.join()

    def stop(self) -> None:
        """End the server at once, whatever it is doing (it may still be importing)."""
        self.server.kill()
        self.close()


def runs(commands: Callable[..., list[list[str]]]):
    """Mark a test with the commands it runs in a smoke run (``processes.run``), as a function
    of the test's parameters (by name) and of ``where``, a directory of the session's that the
    test also gets as the ``shared_dir`` fixture (for files its commands read): they are
    started ahead of the test (:class:`ForkedProcesses`)."""
    return pytest.mark.smoke_runs(commands)


def write_once(path: Path, text: str) -> None:
    """``text`` into ``path``, unless it holds it already; whole or not at all (os.replace),
    since a command started ahead may be reading it."""
    if path.exists() and path.read_text() == text:
        return
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def _declared(item, where: str) -> list[list[str]]:
    marker = item.get_closest_marker("smoke_runs")
    if marker is None:
        return []
    commands = marker.args[0]
    params = getattr(getattr(item, "callspec", None), "params", {})
    given = {**params, "where": where}
    return commands(**{name: given[name] for name in inspect.signature(commands).parameters})


_FORKED = pytest.StashKey[ForkedProcesses]()
_SHARED = pytest.StashKey[str]()


def pytest_configure(config) -> None:
    """A smoke run (--benchmark-disable) starts its fork server now, so that the server's
    imports (about 3 s of CPU) overlap the collection of the tests, instead of following it."""
    config.addinivalue_line("markers", "smoke_runs(commands): what a smoke run starts ahead "
                                       "for the test (benchmarks/conftest.py: runs)")
    if config.getoption("benchmark_disable"):
        config.stash[_FORKED] = ForkedProcesses()


def pytest_collection_finish(session) -> None:
    """A smoke run's fork server (started at configuration) is given the commands the selected
    tests declare as soon as the tests are known, so that those commands overlap the
    in-process benchmarks; a selection that runs none stops the server.

    Hypothesis's pytest plugin (the [test] extra installs hypothesis for tests/) imports
    hypothesis as the session ends, to report on the tests that used it: about a second,
    since pytest rewrites the asserts of every module of a plugin's distribution as it is
    imported. A selection that has not imported hypothesis by now has none of its tests (the
    benchmarks use none), so the plugin is taken out of the session."""
    hypothesis_plugin = session.config.pluginmanager.get_plugin("hypothesispytest")
    if hypothesis_plugin is not None and "hypothesis" not in sys.modules:
        session.config.pluginmanager.unregister(hypothesis_plugin)
    if _FORKED not in session.config.stash:
        return
    if any("processes" in item.fixturenames for item in session.items):
        where = _shared_dir(session.config)
        forked = session.config.stash[_FORKED]
        forked.ahead(args for item in session.items for args in _declared(item, where))
    else:
        session.config.stash[_FORKED].stop()
        del session.config.stash[_FORKED]


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Commands started ahead that no test took: a skipped test's, or a test whose ``runs``
    no longer matches what it runs (its command then ran twice)."""
    if _FORKED in config.stash:
        for args in config.stash[_FORKED].untaken():
            terminalreporter.write_line("started ahead, not asked for: "
                                        + " ".join(args[1:])[:150])


def _shared_dir(config) -> str:
    if _SHARED not in config.stash:
        config.stash[_SHARED] = tempfile.mkdtemp(prefix="tfcli-bench-")
    return config.stash[_SHARED]


def pytest_unconfigure(config) -> None:
    if _FORKED in config.stash:
        config.stash[_FORKED].close()
    if _SHARED in config.stash:
        shutil.rmtree(config.stash[_SHARED], ignore_errors=True)


@pytest.fixture
def shared_dir(request) -> Path:
    """The session's directory for the files a benchmark's commands read (see :func:`runs`)."""
    return Path(_shared_dir(request.config))


@pytest.fixture(scope="session")
def processes(request) -> Processes:
    """How commands run: fresh interpreters when measuring; in a smoke run children of one
    interpreter that imported torch once (started as the session is configured)."""
    if not request.config.getoption("benchmark_disable"):
        return Processes()
    return request.config.stash[_FORKED]


PYTHON = sys.executable
TFCLI = [PYTHON, "-m", "tfcli"]
