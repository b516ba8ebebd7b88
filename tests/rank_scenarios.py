"""Ranks that fail, hang, stop or lose their launcher, run one after another in this process
(``python tests/rank_scenarios.py``), which prints what happened as one JSON document.

Each scenario starts real ranks (fresh interpreters on gloo) and then mostly waits: for a
deadline, a signal, a rank's exit. tests/test_parallel_launch.py runs this file as one
background job (tests/background.py), so that the waiting happens beside the in-process tests
instead of in front of them, and asserts on the record. The launcher is tfcli's own
``run_ranks``, called here exactly as the tests called it in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


def ranks_of(pid: int) -> list[int]:
    """Live ``python -m tfcli.parallel.launch`` children of ``pid`` (zombies are ended). The
    module is matched as ``-m``'s argument: a background job's ``python -c`` that imports it
    is a child of the test session too, and its source text names the module."""
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid=,stat=,args="],
                         capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if " -m tfcli.parallel.launch " in line and line.split()[1][0] != "Z"]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("Threads:")))


PLANTED = "open(__file__ + '.ran', 'w').close()\nraise SystemExit('planted module imported')\n"


def _failure(function, *args, **kwargs) -> dict:
    """Run ``run_ranks(function, *args, **kwargs)``; what it raised (or returned), how long it
    took, and the ranks of this process left alive afterwards."""
    from tfcli.parallel.launch import RankError, run_ranks

    start = time.monotonic()
    out: dict = {}
    try:
        out["returned"] = run_ranks(function, *args, **kwargs)
    except RankError as error:
        out.update(error=str(error), rank=error.rank, exit_code=error.exit_code)
    out.update(seconds=time.monotonic() - start, left=ranks_of(os.getpid()))
    return out


def killed() -> dict:
    """Rank 1 dies by SIGKILL while rank 0 waits in an all-reduce, from a directory holding
    modules under the names the ranks import."""
    from tfcli.parallel.workers import fail_rank

    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="tfcli-planted-") as where:
        for name in ("json", "torch", "tfcli", "faulthandler"):
            Path(where, f"{name}.py").write_text(PLANTED)
        os.chdir(where)
        try:
            out = _failure(fail_rank, 2, (1, False, True), timeout=120)
        finally:
            os.chdir(here)
        out["planted_ran"] = sorted(p.name for p in Path(where).iterdir() if p.suffix == ".ran")
    return out


def loopback() -> dict:
    from tfcli.parallel.workers import listening_sockets

    return _failure(listening_sockets, 2, timeout=60)


def hung() -> dict:
    from tfcli.parallel.workers import fail_rank

    return _failure(fail_rank, 2, (1, True), timeout=4)


def stopped() -> dict:
    from tfcli.parallel.workers import fail_rank

    return _failure(fail_rank, 2, (1, False, False, True), timeout=3)


def launcher_killed() -> dict:
    """SIGKILL to a launcher whose ranks are in the process group (one asleep, one in a
    collective): do they end themselves?"""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        from tfcli.parallel.launch import run_ranks
        from tfcli.parallel.workers import fail_rank
        run_ranks(fail_rank, 2, (1, True), timeout=120)
        """)])
    try:
        deadline = time.monotonic() + 60
        # both in the process group (gloo's threads started): one in all_reduce, one asleep
        while not (len(ranks := ranks_of(launcher.pid)) == 2 and
                   all(threads(pid) >= 5 for pid in ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        joined = len(ranks) == 2 and all(threads(pid) >= 5 for pid in ranks)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {"ranks": len(ranks), "joined": joined,
            "alive_after": [pid for pid in ranks if alive(pid)]}


SCENARIOS = {"killed": killed, "loopback": loopback, "hung": hung, "stopped": stopped,
             "launcher_killed": launcher_killed}

if __name__ == "__main__":
    record = {}
    for name, scenario in SCENARIOS.items():
        try:
            record[name] = scenario()
        except Exception as error:  # one scenario's failure is its test's, not the others'
            record[name] = {"scenario_failed": f"{type(error).__name__}: {error}"}
    print(json.dumps(record))
