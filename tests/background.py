"""Checks that wait on processes of their own start with the session and run beside the rest.

Some checks spend their time in other processes: torch.distributed on a fake or a real process
group, tfcli run as the console script under an address-space limit, a closed stdout or a
signal. Run where their tests stand, the suite would wait for each in turn with one of the
machine's two cores idle. Instead each is a *job*, registered (at import) under the name of
the fixture that hands its result to the tests. When the session starts, the jobs that some
selected test needs start in a background thread, while the in-process tests run in the
main one; the tests that read a job's result run last, in the order their jobs should end
(tests/conftest.py orders them, by expected_ends), and the fixture waits for its job if it
is still running. A job that raises makes its fixture raise, so its tests fail; none is
skipped.

Jobs that compute run one at a time in one background thread, the longest first, beside the
in-process tests in the main one: on a 2-core machine the two threads keep both cores busy, where two
job threads beside the tests put three runners on two cores and the in-process tests, the
thread the session waits for, had to share theirs (measured, the difference was within the
machine's drift: the suite took 157 s and 166 s in clean clones this way, 172-192 s in the
checkout either way). With one thread the jobs are the longer side, so when a test needs a
job still waiting its turn, the test's thread takes it from the queue and runs it itself,
and while it waits for a running one it runs the next in line: the last jobs run on both
cores. Every process a job starts runs at a lower priority (``nice`` 5): the in-process tests, one
thread the session cannot end before, get a core whenever they want one, and the jobs take
what is left. Not lower: on a machine busy with other work, jobs at nice 10 would get a
tenth of what a nice-0 process gets and could run past their time limits.

A job that mostly waits (real ranks sleeping to a deadline, a signal's delivery: declared with
``waits=True``) runs in a second background thread of its own, beside the computing jobs: while
it waits, no core is left idle for it; while it computes, the in-process tests still come
first (nice 0 against the jobs' 5).

A job runs while in-process tests change the working directory and the environment (a test
may set torchrun's variables, or plant a ``json.py`` in the directory it runs in): the
processes a job starts get the directory and the environment the session started with.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

_JOBS: dict[str, Callable[[], Any]] = {}
_COSTS: dict[str, float] = {}  # job -> the seconds it declares (the order jobs start in)
_WAITS: set[str] = set()  # jobs that mostly wait: they run in the waiting lane
_FUTURES: dict[str, Future] = {}
_PROCESSES: list[subprocess.Popen] = []
_LOCK = threading.Lock()
_POOL: dict[bool, ThreadPoolExecutor] = {}  # waits -> the thread its jobs run in, once started
NICE = 5  # the priority jobs' processes run at, below the in-process tests
# what set the priority and an address-space limit without a preexec_fn (see popen)
_NICE_PROGRAM, _PRLIMIT_PROGRAM = shutil.which("nice"), shutil.which("prlimit")
_CWD, _ENV = os.getcwd(), dict(os.environ)  # as the session started (this is imported then)
_TIMES: dict[str, list[float]] = {}  # job -> [seconds it ran, seconds tests waited for it]
_TAKEN: set[str] = set()  # jobs a test's thread took from the queue and ran itself


def job(fixture: str, cost: float, waits: bool = False) -> Callable:
    """Register the decorated function (no arguments) as the job whose result ``fixture``
    returns; ``cost``: about how many seconds it runs on a quiet machine (the longest
    start first; the summary at the end of a session shows what each took); ``waits``: it
    spends much of them waiting, not computing (it runs in the waiting lane). The fixture must
    have that name and be a parameter of the tests that read it, or a fixture they use (not
    fetched with ``request.getfixturevalue``): that is how the session sees which jobs its
    tests need, and which tests to run last."""

    def register(fn: Callable[[], Any]) -> Callable[[], Any]:
        assert fixture not in _JOBS, f"two jobs for fixture {fixture!r}"
        _JOBS[fixture] = fn
        _COSTS[fixture] = cost
        if waits:
            _WAITS.add(fixture)
        return fn

    return register


def _in_order(fixtures: Iterable[str]) -> list[str]:
    """The jobs behind ``fixtures``, in the order they start: the longest first."""
    wanted = set(fixtures)
    return sorted((name for name in _JOBS if name in wanted), key=lambda name: -_COSTS[name])


def expected_ends(fixtures: Iterable[str]) -> dict[str, float]:
    """When each job behind ``fixtures`` should end, in declared seconds from the start, were
    they started together (one after another in their lane)."""
    lanes, ends = {False: 0.0, True: 0.0}, {}
    for name in _in_order(fixtures):
        lanes[name in _WAITS] += _COSTS[name]
        ends[name] = lanes[name in _WAITS]
    return ends


def start(fixtures: Iterable[str]) -> list[str]:
    """Start the jobs behind ``fixtures`` (the fixtures the selected tests use), the longest
    first, each in its lane's background thread."""
    names = [name for name in _in_order(fixtures) if name not in _FUTURES]
    for name in names:
        waits = name in _WAITS
        if waits not in _POOL:
            _POOL[waits] = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="waiting" if waits else "background")
        _FUTURES[name] = _POOL[waits].submit(_timed, name)
    return names


def _timed(name: str) -> Any:
    start = time.monotonic()
    try:
        return _JOBS[name]()
    finally:
        _TIMES.setdefault(name, [0.0, 0.0])[0] = time.monotonic() - start


def result(fixture: str) -> Any:
    """The result of the job behind ``fixture``: when the session started it, waited for, and
    while it runs in the background thread this thread runs jobs still waiting their turn (the
    next in line first); run here and now when the session did not start it (a test module run
    on its own outside pytest's hooks)."""
    future = _FUTURES.get(fixture)
    if future is None:
        return _JOBS[fixture]()
    start, others = time.monotonic(), 0.0
    try:
        if not _take(fixture):
            while not future.done():
                began = time.monotonic()
                if not any(_take(name) for name in _FUTURES):
                    break
                others += time.monotonic() - began  # not waiting: running another job
        return _FUTURES[fixture].result()
    finally:
        _TIMES.setdefault(fixture, [0.0, 0.0])[1] += time.monotonic() - start - others


def _take(name: str) -> bool:
    """Run the job ``name`` in this thread if it is still waiting in the queue (its outcome
    then stands in for the background thread's, for every fixture that reads it)."""
    if not _FUTURES[name].cancel():  # running, or done
        return False
    _TAKEN.add(name)
    future = _FUTURES[name] = Future()
    try:
        future.set_result(_timed(name))
    except Exception as err:  # noqa: BLE001 - its fixtures raise it, as from the background thread
        future.set_exception(err)
    return True


def summary() -> list[str]:
    """A line per job that ran: its seconds, and how long tests waited for it (the time the
    background added to the session)."""
    return [f"{name} (declares {_COSTS[name]:g} s{', waits' if name in _WAITS else ''}): "
            f"ran {ran:.1f} s"
            + (" in the tests' thread" if name in _TAKEN else f", tests waited {waited:.1f} s")
            for name, (ran, waited) in _TIMES.items()]


def session_env() -> dict[str, str]:
    """The environment as the session started, for a job that adds to it."""
    return dict(_ENV)


def popen(args: list[str], address_space: int | None = None, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` in the session's first directory and environment (unless given),
    at priority ``NICE``, with at most ``address_space`` bytes of it (RLIMIT_AS, soft and
    hard) if given, ``preexec_fn`` (if given) run after those; killed at the end of the
    session if it is still running (a session stopped early by ``-x`` or Ctrl-C does not wait
    for it).

    Without a ``preexec_fn`` the priority and the limit are set by nice(1) and prlimit(1),
    which set them on themselves and exec the command (the same pid): Python then starts the
    process with vfork, where a ``preexec_fn`` makes it fork, copying the page tables of this
    process (1.2 GB late in the session) with the GIL held: 70-90 ms each, 10 ms this way."""
    then = kwargs.pop("preexec_fn", None)
    if then is None and _NICE_PROGRAM and (address_space is None or _PRLIMIT_PROGRAM):
        limit = [] if address_space is None else [_PRLIMIT_PROGRAM, f"--as={address_space}"]
        args = [_NICE_PROGRAM, "-n", str(NICE), *limit, *args]
    else:
        def lowered() -> None:
            os.nice(NICE)
            if address_space is not None:
                resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
            if then is not None:
                then()

        kwargs["preexec_fn"] = lowered
    kwargs.setdefault("cwd", _CWD)
    kwargs.setdefault("env", dict(_ENV))
    proc = subprocess.Popen(args, **kwargs)
    with _LOCK:
        _PROCESSES.append(proc)
    return proc


def run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` through :func:`popen`; past ``timeout`` seconds the process is
    killed and the job fails, saying so."""
    proc = popen(args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{args[:4]}... did not finish within {timeout} s") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def stop() -> None:
    """At the session's end: jobs not yet begun are dropped, processes still running killed."""
    for pool in _POOL.values():
        pool.shutdown(wait=False, cancel_futures=True)
    with _LOCK:
        for proc in _PROCESSES:
            if proc.poll() is None:
                proc.kill()
    for pool in _POOL.values():
        pool.shutdown(wait=True)
