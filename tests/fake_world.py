"""The checks that run torch.distributed in one process — its fake process group (a world of N
ranks in one process, whose collectives do nothing) and DDP's one-rank gloo group — in one
process of their own, as one background job (tests/background.py).

Each such check is a script that a test module registers with :func:`script`; it prints one
JSON line. The job runs every registered script in turn, each as a script of its own (its own
namespace, its stdout captured), under an address-space limit and a timeout, and the
``fake_world`` fixture (tests/conftest.py) hands the tests each script's JSON by name. One
process, not one per script, and forked from one that has imported torch (tests/forked.py):
an interpreter that has imported torch, its distributed package and Transformers has spent
about 3 s of CPU before it measures anything. A script leaves no process group behind (the
next one starts its own); the process ends with ``os._exit``, past gloo's native teardown,
which can abort a loaded machine's exit."""

from __future__ import annotations

import json
import subprocess
import textwrap
from typing import Callable

import background
import forked

GIB = 2**30
_SCRIPTS: dict[str, Callable[[], str]] = {}  # name -> what writes the script, in turn


def script(name: str) -> Callable:
    """Register the decorated function (no arguments), which returns a script's code, as the
    script ``name``; scripts run in the order they are registered."""
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        assert name not in _SCRIPTS, f"two scripts named {name!r}"
        _SCRIPTS[name] = fn
        return fn

    return register


@background.job("fake_world", cost=50)
def _fake_world() -> dict:
    scripts = {name: textwrap.dedent(write()) for name, write in _SCRIPTS.items()}
    runner = textwrap.dedent(f"""
        import contextlib, io, json, os, sys
        for name, code in {scripts!r}.items():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code, name, "exec"), {{"__name__": "__main__"}})
            line = printed.getvalue().strip().splitlines()[-1]
            sys.stdout.write(json.dumps(name) + " " + line + "\\n")
        sys.stdout.flush()
        os._exit(0)
        """)
    done = background.run(forked.command("-c", runner), 600, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, address_space=12 * GIB)
    assert done.returncode == 0, done.stderr[-3000:]
    out = {}
    for line in done.stdout.splitlines():
        if not line.startswith('"'):  # not a script's line (native code may write to 1)
            continue
        name, _, result = line.partition(" ")
        out[json.loads(name)] = json.loads(result)
    return out
