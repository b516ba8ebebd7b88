"""Start N torch.distributed ranks on this machine and collect what each returns.

Processes are started with ``spawn`` (a forked child would inherit the parent's torch threads
and locks), rendezvous on 127.0.0.1 at a free port, and are watched by the parent: the first rank
that fails or the deadline ends every rank, and the error names the rank. Nothing outlives
:func:`run_ranks`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tfcli.errors import TfcliError


class RankError(TfcliError):
    """A rank failed or did not finish in time; ``rank`` names it."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, backend: str, timeout: float,
           args: tuple, out: str) -> None:
    """One rank: join the process group, run ``fn(rank, world, *args)``, save its result."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # The traceback is written the moment the rank fails, before the process group is torn
    # down: tearing it down makes the peers fail too, and the first file names the cause.
    err = Path(out) / f"rank{rank}.err"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share the machine's cores
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
    except BaseException:
        err.write_text(traceback.format_exc())
        raise SystemExit(1)
    try:
        result = fn(rank, world, *args)
        path = Path(out) / f"rank{rank}.pt"
        torch.save(result, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    except BaseException:
        err.write_text(traceback.format_exc())
        raise SystemExit(1)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, args: tuple = (), backend: str = "gloo",
              timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; their results, by rank.
    ``fn`` must be importable by name (a module-level function)."""
    import multiprocessing

    import torch

    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tfcli-ranks-") as out:
        procs = [ctx.Process(target=_entry, name=f"tfcli-rank{rank}",
                             args=(fn, rank, world, port, backend, timeout, args, out))
                 for rank in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs):
                    _raise_first_failure(procs, out)
                if time.monotonic() > deadline:
                    late = [r for r, p in enumerate(procs) if p.is_alive()]
                    raise RankError(late[0], f"rank(s) {', '.join(map(str, late))} of {world} "
                                             f"did not finish within {timeout:g} s")
                time.sleep(0.05)
            if any(p.exitcode != 0 for p in procs):
                _raise_first_failure(procs, out)
            return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False)
                    for r in range(world)]
        finally:
            _end(procs)


def _raise_first_failure(procs, out: str) -> None:
    """Name the rank that failed first: the others usually fail after it, in a collective that
    lost a peer. Ranks write their traceback as they fail; the earliest file is the cause."""
    time.sleep(0.2)  # let a rank that is failing finish writing its traceback
    errors = sorted(Path(out).glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    if errors:
        rank = int(errors[0].stem[4:])
        detail = errors[0].read_text().strip().splitlines()[-1]
    else:
        rank = next(r for r, p in enumerate(procs) if p.exitcode not in (None, 0))
        detail = f"exit code {procs[rank].exitcode}"
    raise RankError(rank, f"rank {rank} of {len(procs)} failed: {detail}")


def _end(procs) -> None:
    """Terminate every rank still running (SIGTERM, then SIGKILL) and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
