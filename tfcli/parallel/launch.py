"""Start N torch.distributed ranks on this machine and collect what each returns.

Each rank is a fresh interpreter (``python -P -m tfcli.parallel.launch SPEC``; nothing inherited
from a fork, no torch threads or locks, nothing imported from the current directory). A caller
that is itself a clean process (one thread, no torch op run yet, nothing imported that the
ranks should not have) may ask for ranks forked from it instead (``start="fork"``): each then
skips its interpreter's start and the imports the caller already made (torch's alone is about
1.4 s of CPU a rank), and is watched, ended and named exactly as a fresh one. They meet
without the network: the rendezvous is a file store in the parent's private temporary directory
(torch's TCPStore would listen on every interface, and asks DNS for the name of 127.0.0.1 at
every connection and accept), and gloo's and NCCL's sockets are pinned to ``lo``. The parent
watches them: the first rank that fails, or the deadline, ends every rank, and the error names
the rank. Nothing outlives :func:`run_ranks`: a rank whose parent is gone (killed, so that its
``finally`` never ran) ends itself.

Nothing is pickled either way. The parent hands a rank its function by import name and its
arguments as JSON; the rank returns its result as JSON (records: numbers, strings, lists,
dicts), written into the parent's private temporary directory. A result JSON cannot hold is
that rank's error.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

from tfcli.errors import TfcliError


# Seconds a rank may take to start (a fresh interpreter importing torch) and join the process
# group: about 3 s on an idle 2-CPU machine; generous, since a loaded one can take ten times it.
STARTUP_S = 120.0


class RankError(TfcliError):
    """A rank failed or did not finish in time; ``rank`` names it. Exit code 1: a run that
    failed, not bad input."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message, exit_code=1)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(spec: dict) -> int:
    """One rank: join the process group, run the function, write its result as JSON."""
    import datetime
    import importlib

    rank, world, out = spec["rank"], spec["world"], Path(spec["out"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if sys.platform == "linux":  # the backends' own sockets on loopback, not a resolved host name
        os.environ.update(GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    _end_with_parent(spec["parent"])
    import faulthandler
    import signal

    # the parent asks a rank that is late where it is (SIGUSR1): asleep, computing, or
    # waiting in a collective for a peer
    faulthandler.register(signal.SIGUSR1, file=(out / f"rank{rank}.stack").open("w"))
    # The traceback is written the moment the rank fails, before the process group is torn
    # down: tearing it down makes the peers fail too, and the first file names the cause.
    err = out / f"rank{rank}.err"
    try:
        import torch
        import torch.distributed as dist

        module, name = spec["fn"].split(":")
        fn = getattr(importlib.import_module(module), name)
        torch.set_num_threads(1)  # N ranks share the machine's cores
        # The launcher's deadline ends a late run and names the late rank; the process group's
        # own timeout (which would blame the rank left waiting) is only a backstop behind it.
        wait = datetime.timedelta(seconds=max(spec["timeout"], spec["startup"]) + 60)
        # a file only the parent's user can reach: no socket, so no DNS and no listener
        store = dist.FileStore(str(out / "rendezvous"), world)
        store.set_timeout(wait)
        dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=spec["timeout"] + 60))
        (out / f"rank{rank}.ready").touch()  # the run's deadline starts once every rank is here
    except BaseException:
        err.write_text(traceback.format_exc())
        return 1
    try:
        from tfcli._stack import on_a_wide_stack

        result = on_a_wide_stack(fn, rank, world, *spec["args"])  # as the console script runs
        path = out / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(result))
        path.with_suffix(".tmp").replace(path)
        return 0
    except BaseException:
        err.write_text(traceback.format_exc())
        return 1
    finally:
        dist.destroy_process_group()


def _end_with_parent(parent: int) -> None:
    """Exit when the launching process is gone: a SIGKILL gives it no chance to end its ranks,
    and a rank asleep or blocked in a collective would otherwise live on (an orphan)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tfcli-parent-watch", daemon=True).start()


def run_ranks(fn: Callable, world: int, args: tuple = (), backend: str = "gloo",
              timeout: float = 120.0, startup: float = STARTUP_S,
              start: str = "exec") -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; their JSON results, by rank.
    ``fn`` must be a module-level function (it is imported by name) and ``args`` JSON.
    ``timeout`` counts from the moment every rank has joined the process group, so that a
    machine slow to start N interpreters (each imports torch) does not eat into it; joining
    has ``startup`` seconds of its own. ``start``: "exec", each rank a fresh interpreter;
    "fork", each forked from this process, which must be clean (see the module's docstring:
    a fork of a process whose OpenMP or gloo threads have run can hang)."""
    if start not in ("exec", "fork"):
        raise ValueError(f"start={start!r}: allowed: exec, fork")
    if start == "fork" and threading.active_count() > 1:  # a fork keeps only this thread
        raise ValueError(f"start='fork' from a process running {threading.active_count()} "
                         f"Python threads: a forked rank would inherit the locks they hold; "
                         f"start='exec'")
    with tempfile.TemporaryDirectory(prefix="tfcli-ranks-") as out:  # mode 0700
        specs = [{"fn": f"{fn.__module__}:{fn.__qualname__}", "args": list(args), "rank": rank,
                  "world": world, "backend": backend, "timeout": timeout, "startup": startup, "out": out,
                  "parent": os.getpid()} for rank in range(world)]
        texts = [json.dumps(s) for s in specs]  # a TypeError here: args JSON cannot hold
        procs: list[subprocess.Popen | _Forked] = []
        try:
            for rank, text in enumerate(texts):
                # a fresh interpreter's -P: the current directory is not put on the rank's
                # import path, so a json.py or torch.py lying there is never imported (and
                # run) by a rank (a forked rank has its caller's import path, as it is)
                procs.append(_Forked(json.loads(text)) if start == "fork" else subprocess.Popen(
                    [sys.executable, "-P", "-m", "tfcli.parallel.launch", text]))
            deadline, joined = time.monotonic() + startup, False
            while None in [p.poll() for p in procs]:  # a list: poll every rank, not the first
                if any(p.returncode not in (None, 0) for p in procs):
                    _raise_first_failure(procs, out)
                if not joined and all((Path(out) / f"rank{r}.ready").exists()
                                      for r in range(world)):
                    deadline, joined = time.monotonic() + timeout, True
                if time.monotonic() > deadline:
                    _raise_late(procs, out, timeout if joined else startup, joined)
                time.sleep(0.05)
            if any(p.returncode != 0 for p in procs):
                _raise_first_failure(procs, out)
            return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
        finally:
            _end(procs)


class _Forked:
    """A rank forked from this process, with what the launcher uses of ``subprocess.Popen``:
    ``pid``, ``returncode``, ``poll``, ``send_signal``, ``terminate``, ``kill``, ``wait``. The
    child runs the rank as a fresh interpreter would (:func:`_entry`) and ends with
    :func:`exit_rank`, never returning into the parent's code."""

    def __init__(self, spec: dict) -> None:
        for stream in (sys.stdout, sys.stderr):  # not written twice, by the parent and the rank
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            import signal

            code = 1
            try:  # the caller's handlers reset, as exec resets them (an ignored signal stays so)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                            signal.SIGUSR2, signal.SIGALRM, signal.SIGCHLD):
                    if callable(signal.getsignal(sig)):
                        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                                      else signal.SIG_DFL)
                code = _entry(spec)
            finally:
                exit_rank(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


def _raise_first_failure(procs: list[subprocess.Popen | _Forked], out: str) -> None:
    """Name the rank that failed first. A rank that died without a traceback (killed by a
    signal, or exited from native code) is the cause: a rank that fails because a peer
    vanished raises in the collective, and writes its traceback. Otherwise the earliest
    traceback is the cause: the others fail after it, in a collective that lost a peer."""
    time.sleep(0.2)  # let a rank that is failing finish writing its traceback
    errors = sorted(Path(out).glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    written = {int(f.stem[4:]) for f in errors}
    silent = [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in written]
    if silent:
        rank = silent[0]
        code = procs[rank].returncode
        detail = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    else:
        rank = int(errors[0].stem[4:])
        detail = errors[0].read_text().strip().splitlines()[-1]
    raise RankError(rank, f"rank {rank} of {len(procs)} failed: {detail}")


def _raise_late(procs: list[subprocess.Popen | _Forked], out: str, timeout: float,
                joined: bool = True) -> None:
    """Name the late rank that is not waiting in a collective (its Python stack, dumped on
    request, is outside torch.distributed): the others wait for it. If every late rank waits
    in one (a deadlock) or none answers, name them all."""
    import signal

    late = [r for r, p in enumerate(procs) if p.poll() is None]
    for r in late:
        procs[r].send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    stacks = {r: _read(Path(out) / f"rank{r}.stack") for r in late}
    stopped = [r for r in late if _stopped(procs[r].pid)]  # no stack: it cannot run to dump one
    waiting = [r for r in late if f"torch{os.sep}distributed{os.sep}" in stacks[r]]
    stuck = [r for r in late if r not in waiting and (stacks[r].strip() or r in stopped)]
    names = ", ".join(map(str, stuck or late))
    message = (f"rank(s) {names} of {len(procs)} did not finish within {timeout:g} s" if joined
               else f"rank(s) {names} of {len(procs)} did not join the process group within "
                    f"{timeout:g} s of starting")
    if stuck and waiting:
        import re

        threads = re.split(r"^(?:Current thread|Thread) .*$", stacks[stuck[0]], flags=re.M)
        frames = [line.strip() for block in threads if " in watch" not in block
                  for line in block.splitlines() if line.strip().startswith("File")]
        where = ("is stopped (SIGSTOP or SIGTSTP: it runs again only when continued)"
                 if stuck[0] in stopped else f"at {frames[0] if frames else '?'}")
        message += (f" (rank {stuck[0]} {where}); rank(s) "
                    f"{', '.join(map(str, waiting))} waited for it "
                    + ("in a collective" if joined else "at the rendezvous"))
    raise RankError((stuck or late)[0], message)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc; False where /proc is missing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][:1] in ("T", "t")
    except (OSError, IndexError):
        return False


def _read(path: Path) -> str:
    """A file's text, or "" where the rank has not written it (still starting up)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _end(procs: list[subprocess.Popen | _Forked]) -> None:
    """Terminate every rank still running (SIGTERM, then SIGKILL) and reap them all. A stopped
    rank is continued after SIGTERM, so that it can end at once."""
    import signal

    for p in procs:
        if p.poll() is None:
            p.terminate()
            if _stopped(p.pid):
                p.send_signal(signal.SIGCONT)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def exit_rank(code: int) -> NoReturn:
    """End a rank's process without the interpreter's teardown. After a gloo process group
    has run collectives (even once destroyed), torch's native threads and static destructors
    can abort the exiting process on a loaded machine ("terminate called without an active
    exception", SIGABRT, no Python frame left) after every result is written: about one run
    in ten of two torchrun ranks beside two busy processes. multiprocessing's children never
    met it because they end with os._exit; ranks end the same way, output flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed, or None
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_rank(_entry(json.loads(sys.argv[1])))
