from __future__ import annotations

import gc
import os
import sys

# One torch thread here and in every process a test starts: the suite keeps two things
# running at once (the in-process tests and one background job, tests/background.py) on a
# two-core machine, and more threads than cores make OpenMP's waiting workers spin on the
# cores the other needs. Set before torch is imported; the processes inherit it.
os.environ["OMP_NUM_THREADS"] = "1"
# No test may reach the network: an hf:ORG/NAME id missing from a test's cache would otherwise
# be asked of the Hub (and wait out its retries). Tests of that path unset it themselves.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from tfcli.cli import app  # noqa: E402

torch.set_num_threads(1)


def _sample_the_machine_briefly() -> None:
    """bench records what else the machine is doing as a sweep starts: busy CPUs sampled over
    250 ms of sleep. The figure is only printed (tfcli/render/bench.py), and the tests that
    read it run tfcli in processes of their own (tests/test_bench.py's busy_sweep and
    bench_json_run); the sweeps run in this process (and tests/test_readme.py's examples,
    which import this module) would otherwise sleep about 5 s in all. Here the sample takes
    10 ms."""
    import functools

    import tfcli.bench.sweep
    from tfcli.bench.timer import machine_state

    tfcli.bench.sweep.machine_state = functools.partial(machine_state, window=0.01)


_sample_the_machine_briefly()


class Result:
    def __init__(self, exit_code: int, stdout: str, stderr: str,
                 exception: BaseException | None) -> None:
        self.exit_code = exit_code
        self.stdout = stdout
        self.stderr = stderr
        self.exception = exception


_COMMAND = None


def invoke(args, env: dict | None = None) -> Result:
    """tfcli in this process as the console script runs it, stdout and stderr apart.

    What Typer's ``CliRunner.invoke`` does, less one thing: it rebuilds the Click command
    from the commands' annotations on every call (about 40 ms; the suite invokes tfcli over
    a thousand times), where the command is built here once per session."""
    global _COMMAND
    if _COMMAND is None:
        from typer.main import get_command

        _COMMAND = get_command(app)
    with CliRunner().isolation(env=env) as (out, err, _):
        exception = None
        try:
            _COMMAND.main(args=list(args), prog_name="tfcli")  # as the console script
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if code:
                exception = stop
        except Exception as caught:  # as CliRunner: the test reads it from the result
            code, exception = 1, caught
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        text = [stream.getvalue().decode("utf-8", "replace").replace("\r\n", "\n")
                for stream in (out, err)]
        return Result(code, *text, exception)


def run_cli(*args: str, env: dict | None = None) -> Result:
    """tfcli in-process as the ``cli`` fixture runs it (100 columns), for module fixtures."""
    return invoke(args, env={"COLUMNS": "100", **(env or {})})


@pytest.fixture
def cli():
    """Run tfcli in-process as the console script would, with stdout and stderr apart."""
    return run_cli


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.txt from the current output")


@pytest.fixture
def golden(request):
    """Compare text with tests/golden/NAME; --update-golden rewrites the file instead."""
    from pathlib import Path

    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = Path(__file__).parent / "golden" / name
        if update or not path.exists():
            if not update:
                pytest.fail(f"{path} is missing; run pytest --update-golden and review it")
            path.write_text(text)
        assert text == path.read_text(), f"{name} changed; review, then pytest --update-golden"

    return check


@pytest.fixture
def ctrl_c_at_block(monkeypatch):
    """Press Ctrl-C (raise KeyboardInterrupt) when the bench timer's n-th block starts."""
    from tfcli.bench.timer import CellTimer

    def arm(n: int) -> None:
        calls, original = {"n": 0}, CellTimer.block

        def block(self):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
            return original(self)

        monkeypatch.setattr(CellTimer, "block", block)

    return arm


# --- checks that run in processes of their own (tests/background.py) ----------------------------


@pytest.fixture(scope="session")
def fake_world():
    """What each script registered in tests/fake_world.py printed, by name (its job's result)."""
    import background

    return background.result("fake_world")


@pytest.fixture(scope="session")
def ran():
    """``ran(*args)``: the run of tfcli with ``args`` that a test module named with
    tests/ahead.py's ``ahead``, as ``run_cli`` returned it (its job's result)."""
    import background

    outcomes = background.result("ran")
    return lambda *args: Result(*outcomes[args], None)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "quiet: runs before the background jobs start (it needs idle CPUs)")
    _start_the_fork_server_early(config)


def _start_the_fork_server_early(config) -> None:
    """In a run of the whole suite, the fork server (tests/forked.py) imports torch while the
    tests are collected, on the core collection leaves idle (about 2.5 s of CPU), not after,
    when the first jobs fork from it. A run of some files starts it on first use, if ever."""
    import threading
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if config.args and all(Path(arg).resolve() == here for arg in config.args):
        import forked

        threading.Thread(target=forked._address, name="fork-server-start", daemon=True).start()


def pytest_collection_modifyitems(session, config, items):
    """Tests that need a quiet machine run first, before any background job starts; tests
    that read a background job's result run last, when the jobs have had the whole session
    to finish beside the in-process tests, in the order their jobs should end (by the
    seconds the jobs declare): the readers of a job done long ago do their own work while
    the last jobs finish, instead of after them. The order is otherwise kept."""
    import background

    ends = background.expected_ends(name for item in items for name in item.fixturenames)

    def place(item) -> tuple[int, float]:
        if item.get_closest_marker("quiet") is not None:
            return 0, 0.0
        jobs = [ends[name] for name in item.fixturenames if name in ends]
        return (2, max(jobs)) if jobs else (1, 0.0)

    items.sort(key=place)  # stable


def pytest_runtest_setup(item):
    """At the first test that does not need a quiet machine: start the background jobs that
    the selected tests use."""
    import background

    session = item.session
    if item.get_closest_marker("quiet") is None and not getattr(session, "_jobs_started", False):
        session._jobs_started = True
        background.start(name for each in session.items for name in each.fixturenames)


def pytest_sessionfinish(session):
    import background

    background.stop()
    _ENDING["status"] = int(session.exitstatus)
    if _pytest_is_the_program() and not _warnings_are_errors(session.config):
        gc.freeze()  # pytest's last collection then walks nothing: see "the end of the process"


# --- the end of the process ---------------------------------------------------------------------
# After a session the interpreter would spend seconds ending itself: the teardown of torch's,
# Transformers' and the tests' modules, and the collections it makes on the way (test_zoo.py
# alone: 3.9-4.3 s outside the session's own time with it, 2.0-2.1 s, the interpreter's start,
# without it). Nothing of it is a check: the session's verdict is decided and printed. So, as
# tfcli's own commands end (tfcli/cli/process.py), the process ends after the last hook:
# atexit handlers run (the fork server's folder goes), the streams are flushed, then os._exit
# with the session's status. Only where pytest is the program (not pytest.main() inside
# another one).
#
# pytest makes one more full collection (for unraisable exceptions) in its own
# pytest_unconfigure, before this one: 2.0 s of the test process's thread, after everything
# else has finished (py-spy over a whole run), over everything a thousand tests left. What it can
# find is an object in a cycle whose __del__ raises; pytest prints that as a warning after the
# summary, and it changes the outcome only where warnings are errors (-W error: exit status 1).
# So, unless a filter makes warnings errors, everything is frozen out of the collector as the
# session finishes, and that collection walks nothing. What is given up: the warning for such
# an object left after the last of the collections between tests ("garbage collection" below:
# what those find is reported at the next test, as pytest reports any unraisable exception).

_ENDING: dict[str, int] = {}


def _pytest_is_the_program() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return (os.path.basename(sys.argv[0]) in ("pytest", "py.test")
            or getattr(spec, "name", None) in ("pytest", "pytest.__main__"))


def _warnings_are_errors(config) -> bool:
    """Whether a warning filter of the session (python -W or PYTHONWARNINGS, pytest -W, the
    filterwarnings setting) turns some warnings into errors."""
    filters = [*sys.warnoptions, *(config.known_args_namespace.pythonwarnings or []),
               *config.getini("filterwarnings")]
    return any(str(each).strip().startswith("error") for each in filters)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    import atexit

    if "status" not in _ENDING or not _pytest_is_the_program():
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(_ENDING["status"])


def pytest_terminal_summary(terminalreporter):
    import background

    lines = background.summary()
    if lines:
        terminalreporter.write_sep("-", "background jobs (tests/background.py)")
        for line in lines:
            terminalreporter.write_line(line)


# --- garbage collection ------------------------------------------------------------------------
# The test process holds what a thousand tests left behind (modules, caches, fixtures): a full
# collection walks all of it, about 0.5 s late in the session, and bench's sweep makes one
# after every length. Each test runs with the objects that existed before it frozen
# (gc.freeze: left out of collections), so what it collects is its own garbage; now and then,
# when the heap has grown 2.5-fold since the last full collection, one full collection
# between tests reclaims what earlier tests left in cycles. At 1.5-fold the test process spent
# 5.0 s of its thread in full collections (7.9 s in all collections) and peaked at 1.05 GB
# resident; at 2.5-fold 2.7 s (5.5 s), 1.23 GB (the whole suite, gc.callbacks timing them).

_HEAP = {"after_full": 0}  # the heap's size after the last full collection


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    gc.freeze()
    try:
        return (yield)
    finally:
        gc.unfreeze()
        if _objects() > 2.5 * _HEAP["after_full"]:
            gc.collect()
            _HEAP["after_full"] = _objects()


def _objects() -> int:
    """The heap's size, in the blocks Python's small-object allocator has handed out: what
    a full collection walks grows with it. Read without walking anything (counting the
    collector's objects walks all of them: ~70 ms late in the session, 7 s a session)."""
    return sys.getallocatedblocks()


# --- the frame stack ---------------------------------------------------------------------------
# The tests run as tfcli's console script runs its commands: on a wide stretch of Python's frame
# stack (tfcli/_stack.py), where deep replays do not map and unmap a 16 KiB chunk of it at each
# crossing of a chunk's edge (Python 3.11 and 3.12). Measured on tests/test_zoo.py and
# tests/test_subjects.py: 2.8 s of system time and 30 s in all before, 1.0 s and 27 s after.

@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    from _pytest.main import pytest_runtestloop as run_the_tests

    from tfcli._stack import on_a_wide_stack

    return on_a_wide_stack(run_the_tests, session)
