"""tfcli runs whose tests read only what it printed, run ahead of those tests in a background job.

A test module names each such run as it is imported, ``ahead("params", ...)`` (the arguments
as the ``cli`` fixture takes them), and its test reads the run from the ``ran`` fixture
(tests/conftest.py): ``ran("params", ...)`` is what ``run_cli`` (tests/conftest.py) returned
for those arguments, its exit code, stdout and stderr. Every run named runs in one process
forked from one that has imported torch (tests/forked.py), one after another, as a job beside
the in-process tests (tests/background.py).

This is for runs of models that tfcli replays anew each time (a Transformers model, a user's
module: nothing of them is remembered between runs in one process), which would otherwise be
work for the in-process tests' thread, the longer of the session's two lanes, while the
background lane has room for it. A run of tfcli's own model here does not share the replays
the test process remembers (tfcli.inspection.memory), so it belongs here only where no
in-process test replays the same sizes."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import background
import forked

_RUNS: dict[tuple[str, ...], None] = {}  # the runs named, in the order they were named
_TESTS = str(Path(__file__).resolve().parent)


def ahead(*args: str) -> tuple[str, ...]:
    """Name the run of tfcli with ``args`` (once however often it is named)."""
    _RUNS.setdefault(tuple(args))
    return tuple(args)


@background.job("ran", cost=17)
def _ran() -> dict[tuple[str, ...], list]:
    runs = list(_RUNS)
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {_TESTS!r})
        from conftest import run_cli
        out = []
        for args in {runs!r}:
            result = run_cli(*args)
            out.append([result.exit_code, result.stdout, result.stderr])
        sys.stdout.write("\\n" + json.dumps(out) + "\\n")
        """)
    done = background.run(forked.command("-c", code), 300, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(runs, json.loads(done.stdout.strip().splitlines()[-1])))
