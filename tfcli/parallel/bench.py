"""``tfcli bench --what model --nproc N --strategy ddp|fsdp|tp``: training steps on N real
torch.distributed ranks on this machine.

Each length first checks parity (the ranks' loss and gradients against a single-process step on
the same weights and batch), then times steps. Every rank runs the same fixed number of steps
between barriers: an adaptive timer (``blocked_autorange``) would choose a different count per
rank, and ranks that disagree on how many collectives to run deadlock. Per rank: the step times
(median, IQR), the peak memory of one step (CUDA's allocator; on the CPU the profiler's
allocation events), and per collective the calls and the bytes handed to it, seen by a dispatch
mode on the c10d ops (DDP's bucket all-reduce also through a counting communication hook).
torch's ``CommDebugMode`` counts calls but not bytes, and on this model its module tracker raises
IndexError (torch 2.13): each layer calls its one ``dropout`` module after every sublayer, and
the tracker adds a forward hook per call, which then pops its module stack once too often. Where
it runs (the dropout calls taken out), its counts equal this mode's (tests/test_parallel_launch.py).
"""

from __future__ import annotations

import functools
import os
import re
import statistics
import sys
from typing import Any

from tfcli.errors import TfcliError

CPU_NOTE = ("CPU timings on gloo are not representative of GPUs (no NVLink or InfiniBand, "
            "ranks sharing cores)")


def check_backend(backend: str, nproc: int) -> str:
    """The device the ranks run on; nccl without enough GPUs is refused in one line."""
    import torch

    if backend not in ("gloo", "nccl"):
        raise TfcliError(f"--backend {backend!r}: choose gloo or nccl")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < nproc:
            raise TfcliError(f"--backend nccl needs {nproc} CUDA GPUs (one per rank); this "
                             f"machine has {gpus}: use --backend gloo")
        return "cuda"
    return "cpu"


_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_COLLECTIVES = ("reduce", "gather", "scatter", "broadcast", "all_to_all", "alltoall", "send",
                "recv")


class _CollectiveBytes:
    """Counts calls of c10d collectives and the bytes of their inputs (a rank's shard for an
    all-gather, the full tensor for a reduce-scatter or all-reduce) as they pass through the
    dispatcher."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict[str, int] = {}
        calls: dict[str, int] = {}
        self.bytes, self.calls = counts, calls

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                from torch.utils._pytree import tree_flatten

                name = func._overloadpacket.__name__
                if func.namespace in _NAMESPACES and any(w in name for w in _COLLECTIVES):
                    # the input: (output, input) for the *_base_ ops, the first argument else
                    sent = args[1] if name.endswith("_base_") else args[0]
                    size = sum(t.numel() * t.element_size() for t in tree_flatten(sent)[0]
                               if isinstance(t, torch.Tensor))
                    counts[name] = counts.get(name, 0) + size
                    calls[name] = calls.get(name, 0) + 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def bench_worker(rank: int, world: int, strategies: list[str], cfg_dict: dict, batch: int,
                 lengths: list[int], steps: int, seed: int, device: str) -> list[dict]:
    """Per (strategy, length): parity step, then timed steps; one process-group start-up."""
    return [cell for strategy in strategies
            for cell in _bench_strategy(rank, world, strategy, cfg_dict, batch, lengths, steps,
                                        seed, device)]


def _bench_strategy(rank: int, world: int, strategy: str, cfg_dict: dict, batch: int,
                    lengths: list[int], steps: int, seed: int, device: str) -> list[dict]:
    import time

    import torch
    import torch.distributed as dist

    from tfcli.parallel.workers import parity, prepare

    if device == "cuda":
        torch.cuda.set_device(rank)
    out = []
    for length in lengths:
        model, runner, subject, inputs = prepare(rank, world, strategy, cfg_dict, batch, length,
                                                 seed, device)
        loss = subject.loss(inputs(runner))
        loss.backward()
        held = parity(rank, model, loss, cfg_dict, batch, length, seed, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ddp_bytes: dict[str, int] = {}
        ddp_calls: dict[str, int] = {}
        if strategy == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counting_hook(state, bucket):
                buffer = bucket.buffer()
                ddp_bytes["allreduce_"] = ddp_bytes.get("allreduce_", 0) + \
                    buffer.numel() * buffer.element_size()
                ddp_calls["allreduce_"] = ddp_calls.get("allreduce_", 0) + 1
                return allreduce_hook(state, bucket)

            runner.register_comm_hook(None, counting_hook)

        def step() -> None:
            loss = subject.loss(inputs(runner))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()

        step()  # warm-up: lazy initialisation, optimizer state
        counter = _CollectiveBytes()
        ddp_bytes.clear()
        ddp_calls.clear()
        with counter.mode:
            step()
        counts = {**counter.calls, **ddp_calls}  # DDP's buckets, from C++: counted by the hook
        volume = {**counter.bytes, **ddp_bytes}
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            peak = torch.cuda.max_memory_allocated()
        else:
            from tfcli.inspection.memory import profile_peak_bytes

            peak = profile_peak_bytes(step)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        out.append({"strategy": strategy, "seq_len": length, **held, "times": times,
                    "peak_bytes": peak, "comm_counts": counts, "comm_bytes": volume})
    return out


def run(cfg_dict: dict, nproc: int, strategies: list[str], backend: str, batch: int,
        lengths: list[int], steps: int = 5, seed: int = 0, timeout: float = 300.0,
        tolerance: float = 1e-4, start: str = "exec") -> list[dict[str, Any]]:
    """Records, one per (strategy, length, rank), from one launch of ``nproc`` ranks
    (``start``: how they start, :func:`tfcli.parallel.launch.run_ranks`)."""
    from tfcli.parallel.launch import run_ranks

    for strategy in strategies:
        _check(cfg_dict, nproc, strategy, batch)
    device = check_backend(backend, nproc)
    ranks = run_ranks(bench_worker, nproc,
                      (strategies, cfg_dict, batch, lengths, steps, seed, device),
                      backend=backend, timeout=timeout, start=start)
    return records_of(ranks, backend, device, batch, tolerance)


def records_of(ranks: list[list[dict]], backend: str, device: str, batch: int,
               tolerance: float = 1e-4) -> list[dict[str, Any]]:
    """Each rank's cells, held to the single-process step (each rank compared its own
    gradients with it, :func:`tfcli.parallel.workers.parity`): one record per cell and rank."""
    nproc = len(ranks)
    records = []
    for i, first in enumerate(ranks[0]):
        strategy, length = first["strategy"], first["seq_len"]
        cells = [r[i] for r in ranks]
        losses = [c["loss"] for c in cells]
        # data parallelism: each rank's loss is its rows' mean; tensor parallelism: the batch's
        loss = sum(losses) / nproc if strategy != "tp" else losses[0]
        ref_loss = first["reference_loss"]
        grad_err = max(c["grad_max_abs_err"] for c in cells)
        loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
        same = all(c["same_parameters_have_grads"] for c in cells)
        parity = same and loss_err <= tolerance and grad_err <= tolerance
        for rank, cell in enumerate(cells):
            times = sorted(cell["times"])
            q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
            records.append({
                "world_size": nproc, "strategy": strategy, "backend": backend, "rank": rank,
                "device": device, "seq_len": length, "batch_size": batch, "steps": len(times),
                "median_s": statistics.median(times), "iqr_s": q[2] - q[0],
                "peak_bytes": cell["peak_bytes"], "comm_counts": cell["comm_counts"],
                "comm_bytes": cell["comm_bytes"], "parity": parity,
                "parity_loss_rel_err": loss_err, "parity_grad_max_abs_err": grad_err,
                "note": CPU_NOTE if device == "cpu" else None})
    return records


def _check(cfg_dict: dict, nproc: int, strategy: str, batch: int) -> None:
    from tfcli.parallel.workers import STRATEGIES

    if strategy == "cp":  # torch 2.13: ring attention replaces only flash/efficient/cuDNN SDPA
        raise TfcliError("--strategy cp: not benchmarked; torch's context_parallel shards only "
                         "the CUDA SDPA kernels, so no CPU rank can run it (per-rank memory: "
                         "tfcli params --parallel cp=C)")
    if strategy not in STRATEGIES:
        raise TfcliError(f"--strategy {strategy!r}: choose {', '.join(STRATEGIES)}")
    if nproc < 1:
        raise TfcliError(f"--nproc {nproc}: must be a positive integer")
    if strategy in ("ddp", "fsdp") and batch % nproc:
        raise TfcliError(f"--batch-size {batch} is not divisible by --nproc {nproc}: data "
                         f"parallelism gives each rank batch / nproc rows")
    if strategy == "tp":
        heads, d_ff = cfg_dict["n_heads"], cfg_dict["d_ff"]
        kv = cfg_dict["n_kv_heads"] or heads
        if heads % nproc or kv % nproc or d_ff % nproc:
            raise TfcliError(f"--strategy tp with --nproc {nproc}: n_heads={heads}, "
                             f"n_kv_heads={kv} and d_ff={d_ff} must be divisible by {nproc}")


# A rank's own memory before its share of the model: an interpreter with torch,
# torch.distributed and gloo loaded. Measured as the largest process of
# `tfcli bench --what model -p tiny --nproc 2 --seq-lens 16 --batch-size 2` (its tiny model
# adds little): 327 MiB peak RSS, torch 2.13 CPU, Linux x86-64.
RANK_BYTES = 330 * 2**20


def _guard_ranks(cfg, nproc: int, batch: int, length: int) -> None:
    """Refuse, before any rank starts, ranks that together would not fit in this machine's
    memory: each holds an interpreter with torch (RANK_BYTES) and at most a whole training
    step of the model at the longest length and its share of the batch (sharding only
    lowers it)."""
    from tfcli.guard import gib, model_run_bytes, shortfall
    from tfcli.subjects.own import OwnSubject

    share = max(batch // nproc, 1)
    sizes = {"B": share, "S": length, "T": length, "L": length}
    step, _ = model_run_bytes(OwnSubject(cfg.replace(dropout=0.0)), sizes)
    short = shortfall(nproc * (RANK_BYTES + step), "cpu")
    if short is not None:
        raise TfcliError(f"--nproc {nproc} {short}; each rank holds {gib(RANK_BYTES)} for an "
                         f"interpreter with torch (measured) + {gib(step)} for a training step "
                         f"at B={share}, L={length}; use fewer ranks or shorter --seq-lens")


def render(records: list[dict], console) -> None:
    from rich.table import Table

    from tfcli.render import human_bytes

    if not records:
        return
    first = records[0]
    strategies = ", ".join(dict.fromkeys(r["strategy"] for r in records))
    table = Table(title=f"{strategies} on {first['world_size']} ranks ({first['backend']}, "
                        f"{first['device']}), batch {first['batch_size']}", title_justify="left")
    for name in ("strategy", "L", "rank", "median step", "IQR", "peak memory", "collectives", "parity"):
        table.add_column(name, justify="left" if name in ("collectives", "parity") else "right",
                         overflow="fold")
    for r in records:
        comm = ", ".join(f"{op} ×{r['comm_counts'].get(op, '?')} {human_bytes(b)}"
                         for op, b in sorted(r["comm_bytes"].items())) or "none"
        parity = (f"ok (grads ≤ {r['parity_grad_max_abs_err']:.1e})" if r["parity"]
                  else f"FAILED (loss {r['parity_loss_rel_err']:.1e}, "
                       f"grads {r['parity_grad_max_abs_err']:.1e})")
        table.add_row(r["strategy"], str(r["seq_len"]), str(r["rank"]), f"{r['median_s'] * 1e3:.1f} ms",
                      f"{r['iqr_s'] * 1e3:.1f} ms", human_bytes(r["peak_bytes"]), comm, parity)
    console.print(table)
    if first["note"]:
        console.print(first["note"])


# What a rank reads from torchrun's environment (env:// rendezvous); torchrun also sets
# LOCAL_RANK, which is checked when it is there.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Seconds a rank waits at the rendezvous for the others: torchrun starts them together, so a
# peer that has not come by then never will (variables left in the environment, say).
RENDEZVOUS_S = 120.0
# Seconds a rank other than 0 that refuses its input waits before it exits: torchrun ends
# every rank once one exits non-zero, and rank 0 is the one that says why.
REFUSAL_WAIT_S = 2.0


def torchrun_world() -> int | None:
    """The world size when torchrun (or any launcher that sets its environment variables)
    started this process as one rank; None when tfcli is to start its own ranks. RANK or
    WORLD_SIZE makes this process a rank; then every variable the rendezvous reads must be
    there and valid, else one line names it (torch would fail with a traceback, or wait)."""
    env = os.environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    missing = [name for name in TORCHRUN_VARS if not env.get(name, "").strip()]
    if missing:
        raise TfcliError(f"{', '.join(missing)}: not set or empty, but RANK or WORLD_SIZE is "
                         f"set, as if torchrun started this process; a rank needs all of "
                         f"{', '.join(TORCHRUN_VARS)}: set them, or unset them all to run in "
                         f"this process")
    world = _env_int("WORLD_SIZE", 1, 1024, "the number of ranks")
    _env_int("RANK", 0, world - 1, f"this rank's number, below WORLD_SIZE={world}")
    if env.get("LOCAL_RANK") is not None:
        _env_int("LOCAL_RANK", 0, world - 1, "this rank's number on its machine")
    _env_int("MASTER_PORT", 1, 65535, "the rendezvous port")
    _resolves(env["MASTER_ADDR"].strip())
    return world


def _resolves(host: str) -> None:
    """One line when MASTER_ADDR names a host that does not resolve: torch's store would retry
    the lookup until its rendezvous timeout, in native code."""
    import socket

    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:  # gaierror, or a lookup refused another way
        why = getattr(error, "strerror", None) or str(error)
        raise TfcliError(f"MASTER_ADDR={host[:60]!r} in the environment (torchrun's): the host "
                         f"name does not resolve ({why}); give the address of rank 0's "
                         f"machine (127.0.0.1 on this one)") from None


def _env_int(name: str, low: int, high: int, what: str) -> int:
    """The integer in environment variable ``name``, from ``low`` to ``high``, or one line
    naming the variable, its value and what is allowed."""
    text = os.environ[name].strip()
    if not re.fullmatch(r"[0-9]{1,10}", text) or not low <= int(text) <= high:
        raise TfcliError(f"{name}={os.environ[name][:40]!r} in the environment (torchrun's): "
                         f"expected {what}, an integer from {low} to {high}")
    return int(text)


@functools.lru_cache(maxsize=None)  # asked by the rendezvous and then by the backends
def _loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (an address, or a name such as
    localhost that resolves there)."""
    import ipaddress
    import socket

    try:
        return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                   for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError, ValueError):
        return False


def _listen(host: str, port: int, rank: int, world: int):
    """A socket listening at MASTER_ADDR:MASTER_PORT alone, for rank 0's store (given to
    TCPStore as ``master_listen_fd``), so that a loopback MASTER_ADDR keeps the store off every
    other interface."""
    import socket

    from tfcli.parallel.launch import RankError

    listening = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
        listening = socket.socket(family, kind, proto)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(max(128, world))
    except OSError as error:
        if listening is not None:
            listening.close()
        raise RankError(rank, f"rank {rank} of {world}: cannot listen at {host}:{port} "
                              f"(MASTER_ADDR:MASTER_PORT): {error.strerror or error}; give an "
                              f"address of this machine and a free port") from None
    return listening


def _rendezvous(rank: int, world: int, wait: float):
    """The store the ranks meet at, at MASTER_ADDR:MASTER_PORT as env:// would make it (rank 0
    hosts it, unless torchrun's agent does). torch waits for the peers in native code, where
    neither Ctrl-C nor SIGTERM reaches Python: it waits in a thread of its own here, so that a
    signal ends the run as usual. No peer within ``wait`` seconds is one line (exit 1)."""
    import datetime
    import threading

    import torch.distributed as dist

    from tfcli.inspection.memory import quiet_native_stderr
    from tfcli.parallel.launch import RankError
    from tfcli.subjects.base import error_text

    host, port = os.environ["MASTER_ADDR"].strip(), int(os.environ["MASTER_PORT"])
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    # torch's store listens on every interface; with every rank on this machine (a loopback
    # MASTER_ADDR) rank 0 listens there alone. Another address is left to torch: a host name
    # that resolves to 127.0.1.1 here (Debian's /etc/hosts) and to the LAN address on the other
    # nodes must still be reached. (The store takes the socket over and closes it.)
    listening = _listen(host, port, rank, world).detach() if hosts and _loopback(host) \
        else None
    met: dict = {}

    def meet() -> None:
        try:
            met["store"] = dist.TCPStore(
                host, port, world, hosts, timeout=datetime.timedelta(seconds=wait),
                master_listen_fd=listening)
        except Exception as error:  # noqa: BLE001 - told below, in one line
            met["error"] = error

    thread = threading.Thread(target=meet, name="tfcli-rendezvous", daemon=True)
    with quiet_native_stderr():  # c10d logs each failed connect with its C++ stack
        thread.start()
        while thread.is_alive():
            thread.join(0.1)  # a signal's handler runs here, between joins
    if "store" in met:
        return met["store"]
    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    if "timed out" not in str(met["error"]).lower():
        raise RankError(rank, f"rank {rank} of {world}: the rendezvous at {where} failed: "
                              f"{error_text(met['error'])}")
    if hosts:
        raise RankError(rank, f"no peer came: rank 0 of {world} waited {wait:g} s at {where} "
                              f"for the other {world - 1} rank(s); start them all (torchrun "
                              f"--nproc-per-node {world} ...), or unset RANK and WORLD_SIZE to "
                              f"run in this process")
    host_of = "rank 0" if rank else "torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True)"
    raise RankError(rank, f"no rendezvous: rank {rank} of {world} found no store at {where} "
                          f"within {wait:g} s; {host_of} hosts it: start it, or unset RANK "
                          f"and WORLD_SIZE to run in this process")


def _under_torchrun(cfg_dict: dict, strategy: str, backend: str, batch: int,
                    lengths: list[int], seed: int, steps: int = 5,
                    timeout: float = 300.0) -> list[dict] | None:
    """This process is one of torchrun's ranks: run its cells, gather them on rank 0, which
    returns the records (the others return None)."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    device = check_backend(backend, world)
    store = _rendezvous(int(os.environ["RANK"]), world, RENDEZVOUS_S)
    if _loopback(os.environ["MASTER_ADDR"].strip()) and sys.platform == "linux":
        # every rank is on this machine: the backends' sockets on lo, as --nproc's, where gloo
        # would look its host name up (DNS) to pick an interface
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(name, "lo")
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=world, timeout=datetime.timedelta(seconds=timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cells = bench_worker(rank, world, [strategy], cfg_dict, batch, lengths, steps, seed,
                             device)
        ranks = _gather_json(cells, device)
    finally:
        dist.destroy_process_group()
    return records_of(ranks, backend, device, batch) if rank == 0 else None


def _gather_json(obj, device: str) -> list:
    """Every rank's ``obj``, by rank, sent as JSON bytes in a tensor (``gather_object`` would
    pickle)."""
    import json

    import torch
    import torch.distributed as dist

    on = torch.device(device, torch.cuda.current_device()) if device == "cuda" else "cpu"
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=on)
    sizes = [torch.zeros(1, dtype=torch.int64, device=on) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=on))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=on)
    padded[:data.numel()] = data
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return [json.loads(bytes(t[:int(n)].tolist())) for t, n in zip(out, sizes)]


def bench_cli(cfg, what: str, nproc: int | None, strategy: str | None, backend: str | None,
              lengths: list[int], batch: int, seed: int, json_out: bool,
              csv_path=None) -> None:
    """``tfcli bench --nproc N --strategy S [--backend B]``, or one of torchrun's ranks:
    validate, run, and (rank 0 only, under torchrun) print and write."""
    world = torchrun_world()
    if world is None:
        return _bench_cli(cfg, what, nproc, strategy, backend, lengths, batch, seed, json_out,
                          csv_path, world)
    if int(os.environ["RANK"]) != 0:
        from tfcli.parallel.launch import RankError

        try:  # every rank checks; rank 0 alone says why (torchrun's report follows anyway)
            _bench_cli(cfg, what, nproc, strategy, backend, lengths, batch, seed, json_out,
                       csv_path, world)
        except RankError:  # this rank's own failure (its rendezvous): it says so itself
            raise
        except TfcliError as error:
            import signal
            import time

            # give rank 0 time to say why, and end quietly when torchrun ends this one
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(REFUSAL_WAIT_S)
            raise SystemExit(error.exit_code) from None
    else:
        _bench_cli(cfg, what, nproc, strategy, backend, lengths, batch, seed, json_out,
                   csv_path, world)
    from tfcli.parallel.launch import exit_rank

    exit_rank(0)  # the work is done and written: skip the teardown that can abort (see there)


def _bench_cli(cfg, what: str, nproc: int | None, strategy: str | None, backend: str | None,
               lengths: list[int], batch: int, seed: int, json_out: bool, csv_path,
               world: int | None) -> None:
    if world is not None:  # torchrun started this process as one rank: run it here, not spawn
        if nproc is not None and nproc != world:
            raise TfcliError(f"--nproc {nproc} under torchrun with WORLD_SIZE={world}: leave "
                             f"--nproc out, or make them equal")
        nproc = world
    if nproc is None:
        raise TfcliError("--strategy and --backend apply to --nproc N (ranks on this machine)")
    if what != "model":
        raise TfcliError("--nproc runs training steps of the model: add --what model"
                         if world is None else f"under torchrun (WORLD_SIZE={world}), bench "
                         f"runs training steps of the model on each rank: add --what model")
    if cfg is None:
        raise TfcliError("--nproc needs tfcli's own configuration (--preset/--config/--set): "
                         "its layers are what DDP, FSDP and tensor parallelism are applied to")
    strategy = strategy or "ddp"
    # ranks draw different dropout masks than one process: parity needs dropout off
    cfg_dict = {**cfg.to_dict(), "dropout": 0.0}
    check_backend(backend or "gloo", nproc)
    _check(cfg_dict, nproc, strategy, batch)
    longest = max(lengths)  # checked here, not by each rank once they have all started
    if cfg_dict["positional"] != "none" and longest > cfg_dict["max_seq_len"]:
        raise TfcliError(f"--seq-lens: {longest} exceeds max_seq_len={cfg_dict['max_seq_len']}; "
                         f"add --set max_seq_len={longest}")
    if world is None:  # tfcli starts the ranks, all on this machine
        _guard_ranks(cfg, nproc, batch, longest)
    if world is not None:
        records = _under_torchrun(cfg_dict, strategy, backend or "gloo", batch, lengths, seed)
        if records is None:
            return  # not rank 0: rank 0 prints and writes for everyone
    else:
        records = run(cfg_dict, nproc, [strategy], backend or "gloo", batch, lengths, seed=seed)
    if csv_path is not None:
        _write_csv(records, csv_path)
    if json_out:
        from tfcli.cli.process import print_json

        print_json({"records": records, "conditions": {
            "dropout": "set to 0 so that the ranks and the single-process step agree",
            "timing": "fixed number of steps between barriers on every rank",
            "launch": "torchrun" if world is not None else "spawned by tfcli"}})
    else:
        from tfcli.cli.process import stdout

        render(records, stdout())
    if not all(r["parity"] for r in records):
        raise TfcliError("parity failed: the ranks' loss or gradients differ from a "
                         "single-process step (see the table)", exit_code=1)


def _write_csv(records: list[dict], path) -> None:
    """One row per record; the per-collective counts and bytes as JSON in their cells."""
    import csv
    import json

    from tfcli.cli.outputs import AtomicFile

    out = AtomicFile(path, newline="")
    try:
        writer = csv.DictWriter(out.text(), fieldnames=list(records[0]))
        writer.writeheader()
        for r in records:
            writer.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
                             for k, v in r.items()})
        out.commit()
    except OSError as error:
        out.discard()
        raise TfcliError(f"--csv {str(path)!r}: {error.strerror or error}") from None
