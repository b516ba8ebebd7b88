"""``tfcli bench --what model --nproc N --strategy ddp|fsdp|tp``: training steps on N real
torch.distributed ranks on this machine.

Each length first checks parity (the ranks' loss and gradients against a single-process step on
the same weights and batch), then times steps. Every rank runs the same fixed number of steps
between barriers: an adaptive timer (``blocked_autorange``) would choose a different count per
rank, and ranks that disagree on how many collectives to run deadlock. Per rank: the step times
(median, IQR), the peak memory of one step (CUDA's allocator; on the CPU the profiler's
allocation events), and per collective the calls and the bytes handed to it, seen by a dispatch
mode on the c10d ops (DDP's all-reduce, issued from its C++ reducer where no mode sees it,
through a counting communication hook). torch's ``CommDebugMode`` would count the calls, but its
module tracker raises IndexError on this model's keyword-only forward (torch 2.13).
"""

from __future__ import annotations

import os
import statistics
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

    from tfcli.dist.workers import _full, prepare

    if device == "cuda":
        torch.cuda.set_device(rank)
    out = []
    for length in lengths:
        model, runner, subject, inputs = prepare(rank, world, strategy, cfg_dict, batch, length,
                                                 seed, device)
        loss = subject.loss(inputs(runner))
        loss.backward()
        grads = {n: _full(p.grad).detach().cpu().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        parity_loss = loss.detach().cpu()
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
        out.append({"strategy": strategy, "seq_len": length, "loss": parity_loss, "grads": grads, "times": times,
                    "peak_bytes": peak, "comm_counts": counts, "comm_bytes": volume})
    return out


def run(cfg_dict: dict, nproc: int, strategies: list[str], backend: str, batch: int,
        lengths: list[int], steps: int = 5, seed: int = 0, timeout: float = 300.0,
        tolerance: float = 1e-4) -> list[dict[str, Any]]:
    """Records, one per (strategy, length, rank), from one launch of ``nproc`` ranks."""
    from tfcli.dist.launch import run_ranks

    for strategy in strategies:
        _check(cfg_dict, nproc, strategy, batch)
    device = check_backend(backend, nproc)
    ranks = run_ranks(bench_worker, nproc,
                      (strategies, cfg_dict, batch, lengths, steps, seed, device),
                      backend=backend, timeout=timeout)
    return records_of(ranks, cfg_dict, backend, device, batch, lengths, seed, tolerance)


def records_of(ranks: list[list[dict]], cfg_dict: dict, backend: str, device: str, batch: int,
               lengths: list[int], seed: int, tolerance: float = 1e-4) -> list[dict[str, Any]]:
    """Each rank's cells against the single-process step: one record per cell and rank."""
    from tfcli.dist.workers import reference_step

    nproc = len(ranks)
    records = []
    references = {length: reference_step(cfg_dict, batch, length, seed) for length in lengths}
    for i, first in enumerate(ranks[0]):
        strategy, length = first["strategy"], first["seq_len"]
        ref = references[length]
        cells = [r[i] for r in ranks]
        losses = [c["loss"].item() for c in cells]
        loss = sum(losses) / nproc if strategy != "tp" else losses[0]
        grad_err = max((c["grads"][n] - g).abs().max().item()
                       for c in cells for n, g in ref["grads"].items())
        loss_err = abs(loss - ref["loss"].item()) / max(abs(ref["loss"].item()), 1e-12)
        same = all(sorted(c["grads"]) == sorted(ref["grads"]) for c in cells)
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
    from tfcli.dist.workers import STRATEGIES

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


def _under_torchrun(cfg_dict: dict, strategy: str, backend: str, batch: int,
                    lengths: list[int], seed: int, steps: int = 5) -> list[dict] | None:
    """This process is one of torchrun's ranks: run its cells, gather them on rank 0, which
    compares them with a single-process step and returns the records (others return None)."""
    import torch.distributed as dist

    device = check_backend(backend, int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        cells = bench_worker(rank, world, [strategy], cfg_dict, batch, lengths, steps, seed,
                             device)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(cells, gathered, dst=0)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return records_of(gathered, cfg_dict, backend, device, batch, lengths, seed)


def bench_cli(cfg, what: str, nproc: int | None, strategy: str | None, backend: str | None,
              lengths: list[int], batch: int, seed: int, json_out: bool) -> None:
    """``tfcli bench --nproc N --strategy S [--backend B]``: validate, run, print."""
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:  # torchrun started this process as one rank: run it here, not spawn
        world = int(os.environ["WORLD_SIZE"])
        if nproc is not None and nproc != world:
            raise TfcliError(f"--nproc {nproc} under torchrun with {world} processes: leave "
                             f"--nproc out, or make them equal")
        nproc = world
    if nproc is None:
        raise TfcliError("--strategy and --backend apply to --nproc N (ranks on this machine)")
    if what != "model":
        raise TfcliError("--nproc runs training steps of the model: add --what model")
    if cfg is None:
        raise TfcliError("--nproc needs tfcli's own configuration (--preset/--config/--set): "
                         "its layers are what DDP, FSDP and tensor parallelism are applied to")
    strategy = strategy or "ddp"
    # ranks draw different dropout masks than one process: parity needs dropout off
    cfg_dict = {**cfg.to_dict(), "dropout": 0.0}
    check_backend(backend or "gloo", nproc)
    _check(cfg_dict, nproc, strategy, batch)
    if torchrun:
        records = _under_torchrun(cfg_dict, strategy, backend or "gloo", batch, lengths, seed)
        if records is None:
            return  # not rank 0: rank 0 prints for everyone
    else:
        records = run(cfg_dict, nproc, [strategy], backend or "gloo", batch, lengths, seed=seed)
    if json_out:
        from tfcli.cli._common import print_json

        print_json({"records": records, "conditions": {
            "dropout": "set to 0 so that the ranks and the single-process step agree",
            "timing": "fixed number of steps between barriers on every rank"}})
    else:
        from tfcli.cli._common import stdout

        render(records, stdout())
    if not all(r["parity"] for r in records):
        raise TfcliError("parity failed: the ranks' loss or gradients differ from a "
                         "single-process step (see the table)", exit_code=1)
