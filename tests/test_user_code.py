"""User code that ends or wedges the process (issue 25).

The model calls os._exit(), crashes, raises a BaseException or a KeyboardInterrupt of its own,
leaves a thread running, or holds a module tree with a cycle or 5,000 levels: each is one
``tfcli:`` line naming what the model did and a documented exit code (1: the model's run
failed; 2: a module tree tfcli cannot walk), with no traceback and no hang, whether it
happens while the model's file is imported, while it is built or in its forward pass.

Cases run in this process (Typer's runner) where that shows the behaviour; here os._exit is a
stand-in that raises, so the old behaviour fails the test instead of ending pytest. A crash, a
thread at exit and one real os._exit run as `python -m tfcli` in the background job queue
(tests/background.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import background
import forked

LIMIT_AS = 3 * 2**30  # torch, a model and Rich fit

# What the model's code does, and the words tfcli's line must hold.
ACTIONS = {
    "os-exit": ("import os\nos._exit(3)", "the model called os._exit(3)"),
    "base-exception": ("class Halt(BaseException):\n    pass\nraise Halt('no more')",
                       "the model raised Halt: no more"),
    "generator-exit": ("raise GeneratorExit('closed')", "the model raised GeneratorExit: closed"),
    "keyboard-interrupt": ("raise KeyboardInterrupt",
                           "the model raised KeyboardInterrupt itself (no Ctrl-C or signal came)"),
    "segfault": ("import ctypes\nctypes.string_at(0)",
                 "the model crashed the process with a segmentation fault (SIGSEGV)"),
    # while torch's profiler runs (bench measures peak memory with it), when tfcli points fd 2
    # at /dev/null: the line was lost there (exit 1, nothing printed)
    "segfault-profiled": ("import ctypes, torch\nif torch.autograd.profiler._is_profiler_enabled:\n"
                          "    ctypes.string_at(0)",
                          "the model crashed the process with a segmentation fault (SIGSEGV) "
                          "while bench ran it"),
    "thread": ("import threading, time\n"
               "if not any(t.name == 'spin' for t in threading.enumerate()):\n"
               "    threading.Thread(target=time.sleep, args=(3600,), name='spin').start()",
               "tfcli: note: the model left 1 thread running (spin)"),
    "sigint": ("import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)",
               "tfcli: interrupted (Ctrl-C)"),
}
STAGES = {"import": "while m.py was imported", "constructor": "while it was built",
          "forward": "forward pass"}
COMMANDS = {
    "params": ["params", "--seq-len", "4"],  # the fake-tensor replay runs the forward pass
    "shapes": ["shapes"],
    "masks": ["masks", "--check"],
    "bench": ["bench", "--what", "model", "--seq-lens", "4", "--pass", "fwd",
              "--min-time", "0.005", "--max-time", "0.02"],
}


def model_file(action: str, stage: str) -> str:
    """A model whose code does ``action`` in ``stage``."""
    call = {s: "act()" if s == stage else "pass" for s in STAGES}
    return f"""import torch


def act():
{textwrap.indent(ACTIONS[action][0], "    ")}


{call["import"]}


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        {call["constructor"]}

    def forward(self, x):
        {call["forward"]}
        return self.proj(x)
"""


def arguments(command: str, model: str = "m.py:M") -> list[str]:
    shape = "x=float32[B,L,4]" if command == "bench" else "x=float32[B,4]"
    return [*COMMANDS[command], "--model", model, "--input", shape]


def run_here(where, monkeypatch, args: list[str]):
    from conftest import invoke

    monkeypatch.chdir(where)
    return invoke(args, env={"COLUMNS": "100", "NO_COLOR": "1", "TFCLI_TRACEBACK": None})


def one_line(stderr: str, command: str) -> str:
    """The line that says it; bench prints a line per cell first, then its own last line."""
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith("tfcli: "), stderr
    if command != "bench":
        assert len(lines) == 1, stderr
    return stderr


class Escaped(Exception):
    """The model's os._exit() reached the interpreter's own: tfcli did not stand in for it."""


# --- in this process: what would end tfcli is a failed run, exit 1 ---------------------------


def _in_process_cases():
    """os._exit and KeyboardInterrupt (which bench's sweep and Ctrl-C handling also meet) in
    every command's forward pass, the BaseExceptions in two each; in the import and the
    constructor, which every command reaches by the same code, one command each, in turn."""
    names = list(COMMANDS)
    forward = {"os-exit": names, "base-exception": ["params", "masks"],
               "generator-exit": ["shapes", "bench"], "keyboard-interrupt": names}
    for i, (action, commands) in enumerate(forward.items()):
        yield action, "import", names[i]
        yield action, "constructor", names[(i + 1) % len(names)]
        yield from ((action, "forward", command) for command in commands)


@pytest.mark.parametrize("action,stage,command", list(_in_process_cases()),
                         ids=lambda v: str(v))
def test_what_would_end_tfcli_is_a_failed_run(tmp_path, monkeypatch, action, stage, command):
    """os._exit() (exit code 3, nothing printed), a BaseException or GeneratorExit (a
    traceback), a KeyboardInterrupt the model raised itself (reported as Ctrl-C, 130): each
    becomes one line naming what the model did and where, exit 1."""
    def escaped(code):
        raise Escaped(f"os._exit({code}) reached the interpreter")

    monkeypatch.setattr(os, "_exit", escaped)
    (tmp_path / "m.py").write_text(model_file(action, stage))
    result = run_here(tmp_path, monkeypatch, arguments(command))
    assert result.exit_code == 1, (result.exit_code, result.stderr, result.exception)
    stderr = one_line(result.stderr, command)
    assert ACTIONS[action][1] in stderr and STAGES[stage] in stderr, stderr
    assert os._exit is escaped  # put back as it was


def test_a_module_named_by_import_path_says_where_too(tmp_path, monkeypatch):
    """--model package.module:NAME: the line points at the model's own line, not at the
    stand-in for os._exit that raised for it."""
    monkeypatch.setattr(os, "_exit", lambda code: pytest.fail("os._exit reached"))
    (tmp_path / "exits_on_import_25.py").write_text(model_file("os-exit", "import"))
    result = run_here(tmp_path, monkeypatch, arguments("params", "exits_on_import_25:M"))
    assert result.exit_code == 1, (result.exit_code, result.stderr, result.exception)
    assert (f"the model called os._exit(3) while exits_on_import_25 was imported "
            f"({tmp_path / 'exits_on_import_25.py'}:6)") in one_line(result.stderr, "params")


def test_a_model_file_imports_its_siblings_but_shadows_nothing(tmp_path, monkeypatch):
    """Issue 25: FILE.py's folder is on the import path so that its siblings import by name,
    but after the standard library and installed packages: a wave.py lying beside the model
    (a standard module torch or tfcli could import later) is not the one imported."""
    monkeypatch.delitem(sys.modules, "wave", raising=False)
    (tmp_path / "wave.py").write_text("raise SystemExit('planted wave imported')\n")
    (tmp_path / "sibling_25.py").write_text("WIDTH = 4\n")
    (tmp_path / "m.py").write_text(
        "import torch\nfrom sibling_25 import WIDTH\n\n\n"
        "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.proj = torch.nn.Linear(WIDTH, WIDTH)\n\n"
        "    def forward(self, x):\n        return self.proj(x)\n")
    result = run_here(tmp_path, monkeypatch, ["params", "--model", "m.py:M"])
    assert result.exit_code == 0, result.stderr
    assert "20" in result.stdout  # 4 × 4 + 4 parameters, from the sibling's WIDTH
    import wave

    assert Path(wave.__file__).parent != tmp_path


def test_a_module_beside_the_model_is_found_for_the_models_code_alone(tmp_path, monkeypatch):
    """Issue 25: a module that is not installed (torch probes for triton) lying beside the
    model was imported when torch or tfcli asked for it on their own account. The model's
    folder serves the model's own code only: its imports at load time and in forward, not
    anyone else's."""
    (tmp_path / "not_installed_25.py").write_text("VALUE = 25\n")
    (tmp_path / "m.py").write_text(
        "import torch\n\n\n"
        "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.proj = torch.nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        from not_installed_25 import VALUE\n"
        "        return self.proj(x) * VALUE\n")
    monkeypatch.delitem(sys.modules, "not_installed_25", raising=False)
    result = run_here(tmp_path, monkeypatch, ["shapes", "--model", "m.py:M", "--input",
                                              "x=float32[B,4]"])
    assert result.exit_code == 0, result.stderr  # the model's forward found it
    sys.modules.pop("not_installed_25", None)
    with pytest.raises(ModuleNotFoundError):  # this file is not the model's
        import not_installed_25  # noqa: F401


def test_profile_traces_go_where_the_user_asked_when_the_model_changes_directory(
        tmp_path, monkeypatch):
    """Issue 25: a model that changes directory in its forward pass moved bench --profile's
    traces into its own directory (the profiler's steps run the model; tfcli changes the
    directory back only after the calls it wraps). Every output path is absolute before the
    model runs."""
    (tmp_path / "away").mkdir()
    (tmp_path / "m.py").write_text(
        "import os, torch\nAWAY = os.path.abspath('away')\n\n\n"
        "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.p = torch.nn.Linear(4, 4)\n\n"
        "    def forward(self, x):\n        os.chdir(AWAY)\n        return self.p(x)\n")
    result = run_here(tmp_path, monkeypatch, [
        "bench", "--what", "model", "--model", "m.py:M", "--input", "x=float32[B,L,4]",
        "--seq-lens", "4", "--pass", "fwd", "--min-time", "0.005", "--max-time", "0.02",
        "--profile", "traces"])
    assert result.exit_code == 0, result.stderr
    assert [p.suffix for p in (tmp_path / "traces").iterdir()] == [".json"]
    assert list((tmp_path / "away").iterdir()) == []


@pytest.mark.parametrize("command", ["shapes", "masks"])
def test_a_real_ctrl_c_in_the_forward_pass_is_still_130(tmp_path, monkeypatch, command):
    """SIGINT while the model runs is the user's Ctrl-C, not the model's doing."""
    (tmp_path / "m.py").write_text(model_file("sigint", "forward"))
    result = run_here(tmp_path, monkeypatch, arguments(command))
    assert result.exit_code == 130 and result.stderr == "tfcli: interrupted (Ctrl-C)\n", (
        result.exit_code, result.stderr)


def test_tfcli_own_exit_ends_the_process_while_the_model_runs(monkeypatch):
    """A second SIGTERM arriving while the model runs ends tfcli with os._exit(143) from its
    signal handler: that call reaches the interpreter's os._exit, the model's do not."""
    from tfcli.cli import signals
    from tfcli.subjects import contain

    ended = []

    def real_exit(code):
        ended.append(code)
        raise Escaped(code)

    monkeypatch.setattr(contain, "REAL_EXIT", real_exit)
    monkeypatch.setattr(os, "write", lambda fd, data: len(data))  # the handler's own line
    with contain.contained("in its forward pass"):
        with pytest.raises(contain.OsExitCalled):
            os._exit(3)  # as the model would: raised for tfcli to report
        with pytest.raises(Escaped):
            signals._exit_now(signal.SIGTERM, "terminated (SIGTERM) while stopping")
    assert ended == [143]


def test_a_threading_profile_hook_still_runs_in_the_models_threads():
    """Threads started while the model runs get an alternate signal stack through threading's
    profile hook; one set before (a profiler's) still sees every thread, and is back after."""
    import threading

    from tfcli.subjects import contain

    seen = []

    def hook(frame, event, arg):
        seen.append((threading.current_thread().name, event))

    threading.setprofile(hook)
    try:
        with contain.contained("in its forward pass"):
            thread = threading.Thread(target=len, args=((),), name="model-thread")
            thread.start()
            thread.join()
        assert threading.getprofile() is hook
    finally:
        threading.setprofile(None)
    assert ("model-thread", "call") in seen


# --- module trees tfcli cannot walk: exit 2, one line ------------------------------------------

TREES = """import torch
from torch import nn


class Holds(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def itself():
    model = Holds()
    model.add_module("me", model)
    return model


def each_other():
    a, b = Holds(), Holds()
    a.add_module("b", b)
    b.add_module("a", a)
    return a


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def deep(levels=5000):
    model = Holds()
    for _ in range(levels):
        model = Wrap(model)
    return model


def shared():
    # the same layer under two parents, nested 60 deep: tied, not a cycle, and walkable
    layer = Holds()
    model = nn.Sequential(layer, layer)
    for _ in range(60):
        model = Wrap(model)
    return model
"""


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name,words", [
    ("itself", "module tree has a cycle through 'me', which is (model) (Holds) again"),
    ("each_other", "module tree has a cycle through 'b.a', which is (model) (Holds) again"),
    ("deep", "the model's modules are nested 5,002 levels deep, beyond the 100 levels"),
], ids=["holds-itself", "two-hold-each-other", "5000-levels"])
def test_a_module_tree_tfcli_cannot_walk_is_refused(tmp_path, monkeypatch, command, name,
                                                      words):
    """A cycle or 5,000 nested modules: RecursionError, exit 70 before; one line, exit 2."""
    (tmp_path / "trees.py").write_text(TREES)
    result = run_here(tmp_path, monkeypatch, arguments(command, f"trees.py:{name}"))
    assert result.exit_code == 2, (result.exit_code, result.stderr, result.exception)
    assert words in one_line(result.stderr, command)


def test_a_shared_module_is_not_a_cycle(tmp_path, monkeypatch):
    """One layer under two parents (tied weights), 63 levels deep: inspected as before."""
    (tmp_path / "trees.py").write_text(TREES)
    result = run_here(tmp_path, monkeypatch, arguments("shapes", "trees.py:shared"))
    assert result.exit_code == 0, (result.exit_code, result.stderr, result.exception)


# --- in a process of its own: a crash, a real os._exit, a thread left running ----------------

PROCESS_CASES = [  # (action, stage, command, exit code)
    ("segfault", "import", "bench", 1),
    ("segfault", "constructor", "masks", 1),
    ("segfault", "forward", "shapes", 1),
    ("segfault-profiled", "forward", "bench", 1),
    ("os-exit", "forward", "params", 1),
    ("thread", "import", "params", 0),  # the thread outlives the answer: the command's own code
    ("thread", "forward", "shapes", 0),
]
# Cases that start a fresh interpreter, not a process forked from one that has imported torch
# (tests/forked.py): torch probes for the packages it may use (triton, absent on a CPU build)
# as it imports, which a forked child has done before it starts; a planted triton.py beside
# the model must not be what those probes find either. The crashes fork: their probes made
# later (torch's flop counter as shapes starts) are still checked there.
FRESH = {"segfault-profiled", "thread"}


def _process(case, where: Path) -> tuple[int, str] | None:
    """(exit code, stderr) of one case as the console script; None if it did not end in
    60 s (then it is killed)."""
    action, stage, command, _ = case
    (where / "m.py").write_text(model_file(action, stage))
    # issue 25: torch probes for packages it may use (triton, on a CPU build absent); one lying
    # beside the model is not what tfcli's or torch's own imports find
    (where / "triton.py").write_text("open(__file__ + '.ran', 'w').close()\n"
                                     "raise ImportError('planted')\n")

    env = {**background.session_env(), "COLUMNS": "100", "NO_COLOR": "1"}
    for name in ("TFCLI_TRACEBACK", "PYTHONFAULTHANDLER"):
        env.pop(name, None)
    started = [sys.executable, "-m", "tfcli", *arguments(command)] if action in FRESH else \
        forked.command("-m", "tfcli", *arguments(command))
    proc = background.popen(started, cwd=where, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, address_space=LIMIT_AS)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return proc.returncode, err + ("planted triton.py imported\n"
                                   if (where / "triton.py.ran").exists() else "")


@pytest.fixture(scope="module")
def user_code_processes():
    return background.result("user_code_processes")


@background.job("user_code_processes", cost=8)
def _processes() -> dict:
    """Every process case, one after another, each in a directory of its own."""
    out = {}
    for case in PROCESS_CASES:
        with tempfile.TemporaryDirectory(prefix="tfcli-user-code-") as where:
            out[case] = _process(case, Path(where))
    return out


@pytest.mark.parametrize("case", PROCESS_CASES, ids=lambda c: "-".join(map(str, c[:3])))
def test_the_process_ends_with_one_line(user_code_processes, case):
    """A crash (exit -11, nothing printed before), os._exit (the model's code, nothing
    printed) and a non-daemon thread (tfcli waited for it for ever) each end the process
    promptly, with one line naming what the model did."""
    action, stage, command, code = case
    result = user_code_processes[case]
    assert result is not None, "tfcli did not end in 60 s"
    returncode, stderr = result
    assert returncode == code, (returncode, stderr[-2000:])
    stderr = one_line(stderr, command)
    assert ACTIONS[action][1] in stderr, stderr
    if action not in ("thread", "segfault-profiled"):  # those name where they happen
        assert STAGES[stage] in stderr, stderr


# --- what the process still does as it ends: tfcli ends without the interpreter's teardown ----

LEFT_OPEN = """import atexit
import torch

LOG = open("model.log", "w")  # kept open, never closed or flushed by the model


def _at_exit():
    with open("at_exit.txt", "w") as f:
        f.write("ran")


atexit.register(_at_exit)


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        LOG.write("forward ran\\n")
        return self.proj(x)
"""


@pytest.fixture(scope="module")
def left_open():
    return background.result("left_open")


@background.job("left_open", cost=0.4)
def _left_open() -> dict:
    with tempfile.TemporaryDirectory(prefix="tfcli-left-open-") as where:
        (Path(where) / "m.py").write_text(LEFT_OPEN)
        done = background.run(forked.command("-m", "tfcli", *arguments("shapes")), 60,
                              cwd=where, env={**background.session_env(), "NO_COLOR": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        files = {name: (Path(where) / name).read_text()
                 for name in ("model.log", "at_exit.txt") if (Path(where) / name).exists()}
    return {"code": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
            "files": files}


def test_the_process_ends_as_an_interpreter_would_where_anyone_can_see(left_open):
    """tfcli ends its process without the interpreter's teardown (every module taken apart:
    0.7 s of CPU with torch): the atexit handlers the model registered still run, a file it
    left open still gets what it wrote, and the answer is all on stdout."""
    assert left_open["code"] == 0, left_open["stderr"]
    assert "(model)" in left_open["stdout"] and left_open["stdout"].endswith("\n")
    assert left_open["files"].get("at_exit.txt") == "ran"
    assert left_open["files"].get("model.log", "").startswith("forward ran\n")


# --- crashes that leave nothing to run a handler in: the native handler (no torch) -------------

NO_INTERPRETER = {  # name -> (a script whose crash comes inside contained(), the stage named)
    # json's C parser nested 10**7 deep with the recursion limit out of the way: the C stack
    # overflows, and a handler on that stack would fault again (exit -11, no line)
    # (with a half-written temporary output, which the crash removes: bench's CSV was left)
    "c-stack-overflow": ("import json, sys\nsys.setrecursionlimit(10**8)\n"
                         "from pathlib import Path\nfrom tfcli.cli.outputs import AtomicFile\n"
                         "AtomicFile(Path('out.csv')).text().write('seq_len,')\n"
                         "with contained('in its forward pass'):\n"
                         "    json.loads('[' * 10**7)\n", "in its forward pass"),
    # the same in a thread the model starts: the kernel keeps an alternate stack per thread,
    # and one without can run no handler after a stack overflow (exit -11, no line)
    "c-stack-overflow-in-a-thread": ("import json, sys, threading\n"
                                     "sys.setrecursionlimit(10**8)\n"
                                     "with contained('in its forward pass'):\n"
                                     "    t = threading.Thread(target=json.loads, "
                                     "args=('[' * 10**7,))\n"
                                     "    t.start()\n"
                                     "    t.join()\n", "in its forward pass"),
    # deeper still than the thread tfcli frees a forward pass's output on (its stack made
    # small here): the crash is the model's, named as such
    "overflow-as-the-output-is-freed": ("import json, sys\nfrom tfcli.subjects import contain\n"
                                        "sys.setrecursionlimit(10**8)\n"
                                        "contain.RELEASE_STACK = 2**20\n"
                                        "class Output:\n"
                                        "    def __del__(self):\n"
                                        "        json.loads('[' * 10**7)\n"
                                        "contain.release([Output()], 'as its output was freed')\n",
                                        "as its output was freed"),
    # a thread that never held the GIL faults while the main thread holds it (PyDLL calls do):
    # a handler that needs the interpreter waits for the GIL for as long as it is held
    "thread-without-the-gil": ("import ctypes, sys\nsys.setswitchinterval(60)\n"
                               "libc = ctypes.PyDLL(None)\n"
                               "with contained('while it was built'):\n"
                               "    libc.pthread_create(ctypes.byref(ctypes.c_ulong()), None, "
                               "ctypes.c_void_p(8), None)\n"
                               "    libc.sleep(30)\n", "while it was built"),
    # the model has corrupted memory a handler in Python would use (here the type pointer of the dict
    # of lines that a Python handler reads) before it faults: a handler that runs Python
    # faults again, where the signal is blocked (exit -11, no line)
    "corrupt-memory": ("import ctypes\nfrom tfcli.subjects import contain\n"
                       "with contained('in its forward pass'):\n"
                       "    ctypes.memset(id(contain._crash_lines) + 8, 0, 8)\n"
                       "    ctypes.string_at(0)\n", "in its forward pass"),
}


@pytest.fixture(scope="module")
def interpreter_gone():
    return background.result("interpreter_gone")


@background.job("interpreter_gone", cost=0.4)
def _interpreter_gone() -> dict:
    out = {}
    env = {k: v for k, v in background.session_env().items() if k != "PYTHONFAULTHANDLER"}
    for name, (script, _) in NO_INTERPRETER.items():
        code = "from tfcli.subjects.contain import contained\n" + script
        with tempfile.TemporaryDirectory(prefix="tfcli-crash-") as where:
            proc = background.popen([sys.executable, "-c", code], env=env, cwd=where,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                err = proc.communicate(timeout=10)[1]
                out[name] = proc.returncode, err, os.listdir(where)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                out[name] = None
    return out


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="the native crash handler is Linux x86-64's; elsewhere a Python "
                           "callback does its best")
@pytest.mark.parametrize("name", NO_INTERPRETER)
def test_a_crash_with_no_stack_or_no_interpreter_left_is_one_line(interpreter_gone, name):
    """Issue 25: a C stack overflow ended the process with -11 and nothing printed, and a crash
    in a thread without the GIL waited for it. The handler is system calls alone, on a stack of
    its own: one line, temporary outputs removed, exit 1, at once."""
    result = interpreter_gone[name]
    assert result is not None, "the process did not end in 10 s"
    assert result == (1, f"tfcli: the model crashed the process with a segmentation fault "
                         f"(SIGSEGV) {NO_INTERPRETER[name][1]}; tfcli reports it as a failed "
                         f"run\n", [])
