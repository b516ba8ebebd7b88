"""`tfcli bench`: attention alone and the configured model across sequence lengths."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from tfcli.cli.options import (SUBJECT_RULES, AttnImplementation, ConfigOpt, DimOpt, AttnImplOpt, HfClassOpt, InputOpt, JsonOpt, MaxMemoryOpt,
                               ModelArgOpt, ModelOpt, PresetOpt, SetOpt, int_list,
                               resolve_subject)
from tfcli.cli.outputs import AtomicFile, Output, check_outputs
from tfcli.cli.process import print_json, stdout
from tfcli.cli.rules import Needs, Rule, Rules, own_model
from tfcli.cli.signals import INTERRUPTED
from tfcli.errors import TfcliError

ALL_KERNELS = ["naive", "sdpa", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]


def _choices(text: str, option: str, allowed: list[str]) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if not items or bad:
        raise TfcliError(f"{option} {text!r}: choose from {', '.join(allowed)} (comma-separated)")
    return list(dict.fromkeys(items))


BIG = 2**31 - 1  # sizes beyond this overflow index arithmetic long before they fit anywhere


class _WriteFailed(Exception):
    """An output could not be written mid-sweep: the sweep ends, the table is still printed."""


def _torchrun_world(v) -> int | None:
    """WORLD_SIZE when torchrun started this process as one of its ranks."""
    from tfcli.parallel.bench import torchrun_world

    return torchrun_world()


def _ranks(v) -> bool:
    """Whether this run is on torch.distributed ranks (--nproc, or started by torchrun)."""
    return (v.nproc is not None or v.strategy is not None or v.backend is not None
            or v.torchrun is not None)


RULES = Rules(
    SUBJECT_RULES,
    Rule("tokens", Needs(lambda v: not v.typed("batch_size"), "not with --batch-size",
                         "{option} and --batch-size: give one (with --tokens, batch = tokens / "
                         "L)")),
    Rule(("strategy", "backend"), Needs(
        lambda v: v.nproc is not None or v.torchrun is not None, "only with --nproc",
        "{option}: for the ranks of --nproc N (on this machine) only; add --nproc N")),
    # what the ranks do not read: they run a fixed number of training steps of the model
    Rule(("pass_", "kernels", "device", "dtype", "tokens", "tgt_len", "heads", "head_dim",
          "kv_heads", "causal", "threads", "min_time", "max_time", "calibrate", "plot", "profile",
          "max_memory"), Needs(
        lambda v: not v.ranks, "not with --nproc",
        "{option}: not read by ranks, which run a fixed number of training steps of the model; "
        "with --nproc give --seq-lens, --batch-size, --seed, --strategy, --backend, --json, "
        "--csv")),
    Rule(("heads", "head_dim", "kv_heads", "causal"), Needs(
        lambda v: v.what == "attention", "only with --what attention",
        "{option}: only for --what attention; the model's own come from its "
        "configuration")),
    Rule("tgt_len", Needs(lambda v: v.what == "model", "only with --what model",
                          "applies to --what model")),
    Rule("input_", Needs(lambda v: v.what == "model", "only with --what model",
                         "describes the forward of the model --what model runs; --what "
                         "attention times the attention core alone")),
    Rule("dim", Needs(lambda v: False, "not in bench: --batch-size and --seq-lens set the sizes",
                      "{option}: bench sets B from --batch-size and every length letter from "
                      "--seq-lens")),
    Rule("nproc", Needs(lambda v: v.what == "model", "only with --what model",
                        "runs training steps of the model: add --what model"),
         own_model("needs tfcli's own configuration (--preset/--config/--set): its layers are "
                   "what DDP, FSDP and tensor parallelism are applied to")),
    Rule(("attn_implementation", "hf_class"), Needs(
        lambda v: v.what == "model", "only with --what model",
        "{option}: --what attention times the attention core alone, sized from the config's "
        "heads; add --what model to run the model")),
    Rule("model_ref", Needs(
        lambda v: v.what == "model" or v.model_ref.startswith("hf:"),
        "with --what attention: only hf:PATH",
        "{option} {value}: --what attention times the attention core alone, sized by "
        "--heads/--head-dim, and uses nothing of the module; add --what model")),
    derived={"torchrun": _torchrun_world, "ranks": _ranks},
)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def bench(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    model_ref: ModelOpt = None, model_arg: ModelArgOpt = None, hf_class: HfClassOpt = None,
    attn_implementation: AttnImplOpt = AttnImplementation.auto,
    input_: InputOpt = None, dim: DimOpt = None,
    what: Annotated[str, typer.Option(
        metavar="attention|model",
        help="attention: the attention core alone; model: the configured model.")] = "attention",
    seq_lens: Annotated[str, typer.Option(
        metavar="L,L,…", help="Sequence lengths (source and target = L).")] = "256,512,1024,2048",
    pass_: Annotated[str, typer.Option(
        "--pass", metavar="fwd,bwd,fwdbwd",
        help="fwd: inference forward (no grad); bwd: backward alone, forward excluded; fwdbwd: "
             "a training step.")] = "fwd,fwdbwd",
    kernels: Annotated[Optional[str], typer.Option(
        metavar="K,K,…", show_default=False,
        help=f"Attention: {', '.join(ALL_KERNELS)} (default all; those that fail a probe on "
             f"the device are reported, not run). Model: naive, sdpa for tfcli's own; a "
             f"--model runs as written ('model').")] = None,
    device: Annotated[str, typer.Option(
        metavar="cpu,cuda,mps", help="Devices; an absent one is reported as skipped.")] = "cpu",
    dtype: Annotated[str, typer.Option(metavar="fp32,bf16,fp16", help="Dtypes.")] = "fp32",
    batch_size: Annotated[Optional[int], typer.Option(
        min=1, max=BIG, show_default=False, help="Batch size (default 1).")] = None,
    tokens: Annotated[Optional[int], typer.Option(
        min=1, max=BIG, show_default=False,
        help="Constant tokens per step: batch = tokens / L (instead of --batch-size).")] = None,
    tgt_len: Annotated[Optional[int], typer.Option(
        min=1, max=BIG, show_default=False,
        help="Model: fix the target length of an encoder-decoder (default T = L).")] = None,
    heads: Annotated[Optional[int], typer.Option(
        min=1, max=2**20, show_default=False, help="Attention: heads (default: the config's).")
    ] = None,
    head_dim: Annotated[Optional[int], typer.Option(
        min=1, max=2**20, show_default=False, help="Attention: d_k (default: the config's).")
    ] = None,
    kv_heads: Annotated[Optional[int], typer.Option(
        min=1, max=2**20, show_default=False,
        help="Attention: K/V heads, grouped-query attention (default: the config's; a divisor "
             "of --heads).")] = None,
    causal: Annotated[bool, typer.Option(
        "--causal", help="Attention: causal mask (FLOPs count half).")] = False,
    threads: Annotated[Optional[int], typer.Option(
        min=1, show_default=False,
        help="CPU threads for every timing, at most the CPUs this process may use (default: "
             "torch's, i.e. all cores).")] = None,
    min_time: Annotated[float, typer.Option(
        min=0.0, max=3600.0,
        help="Seconds of measurement per cell, at least (and 3 samples).")] = 0.5,
    max_time: Annotated[float, typer.Option(min=0.0, max=3600.0,
                                            help="Seconds per cell, at most: a cell not yet "
                                                 "reliable gets rounds until its timed blocks "
                                                 "have taken this long on the clock.")] = 5.0,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="Measure this machine's matmul peak per device and dtype, for % "
                            "of peak.")] = False,
    csv_path: Annotated[Optional[Path], typer.Option(
        "--csv", metavar="FILE", show_default=False,
        help="Write records as CSV, a row as each cell finishes.")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        metavar="FILE.png", show_default=False,
        help="Log-log plot of time and memory against L (needs the 'plot' extra).")] = None,
    profile: Annotated[Optional[Path], typer.Option(
        metavar="DIR", show_default=False,
        help="Write torch.profiler traces per cell (TensorBoard's PyTorch profiler plugin, "
             "Perfetto).")] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**63 - 1,
                                      help="Seed for inputs and weights.")] = 0,
    max_memory: MaxMemoryOpt = None,
    nproc: Annotated[Optional[int], typer.Option(
        min=1, max=1024, show_default=False,
        help="Model: run training steps on N torch.distributed ranks on this machine (parity "
             "with one process first, then timing).")] = None,
    strategy: Annotated[Optional[str], typer.Option(
        metavar="ddp|fsdp|tp", show_default=False,
        help="With --nproc: DDP, FSDP2 (fully_shard per layer) or tensor parallelism.")] = None,
    backend: Annotated[Optional[str], typer.Option(
        metavar="gloo|nccl", show_default=False,
        help="With --nproc: torch.distributed backend (default gloo).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Time, peak memory, FLOP/s and scaling exponents across sequence lengths."""
    if what not in ("attention", "model"):
        raise TfcliError(f"--what {what!r}: choose attention or model")
    v = RULES.apply(locals())
    check_outputs(Output(csv_path, "--csv", ".csv"), Output(plot, "--plot", ".png"),
                  Output(profile, "--profile", directory=True))
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise TfcliError("--plot needs matplotlib: pip install 'matplotlib>=3.7' (the "
                             "'plot' extra; from tfcli's clone: pip install '.[plot]')") from None
    if threads is not None and threads > _cpus():
        raise TfcliError(f"--threads {threads}: this process may use {_cpus()} CPUs; choose "
                         f"1..{_cpus()}")
    batch_size = 1 if batch_size is None else batch_size
    from tfcli.guard import parse_size

    memory_limit = parse_size(max_memory) if max_memory is not None else None
    subject = resolve_subject(preset, config, set_, model_ref, model_arg, hf_class, input_,
                              attn_implementation)
    cfg = getattr(subject, "cfg", None)
    lengths = sorted(set(int_list(seq_lens, "--seq-lens", "256,512,1024", minimum=1)))
    if max(lengths) > BIG:
        raise TfcliError(f"--seq-lens: {max(lengths)} is beyond {BIG:,}")
    if v.ranks:  # issue 14: torch.distributed ranks
        from tfcli.parallel.bench import bench_cli

        return bench_cli(cfg, what, nproc, strategy, backend, lengths, batch_size, seed, json_out,
                         csv_path)
    passes = _choices(pass_, "--pass", ["fwd", "bwd", "fwdbwd"])
    allowed = ALL_KERNELS if what == "attention" else list(subject.kernels)
    chosen = _choices(kernels, "--kernels", allowed) if kernels is not None else allowed
    devices = _choices(device, "--device", ["cpu", "cuda", "mps"])
    dtypes = _choices(dtype, "--dtype", ["fp32", "bf16", "fp16"])
    if max_time < min_time:
        raise TfcliError(f"--max-time {max_time} is below --min-time {min_time}")
    if tokens is not None and tokens < max(lengths):
        raise TfcliError(f"--tokens {tokens} is below the longest length {max(lengths)}: "
                         f"batch = tokens / L must be at least 1")
    if what == "model":
        longest = max(max(lengths), tgt_len or 0)
        if cfg is not None and cfg.positional != "none" and longest > cfg.max_seq_len:
            raise TfcliError(f"--seq-lens: {longest} exceeds max_seq_len={cfg.max_seq_len}; "
                             f"add --set max_seq_len={longest}")
    if tgt_len is not None and not {"S", "T"} <= set(subject.length_dims()):
        raise TfcliError("--tgt-len fixes the target length of an encoder-decoder model; this "
                         "model has one length, swept by --seq-lens")
    if what == "model" and cfg is None:
        probe_device, abstract = subject.abstract_run("meta")
        with abstract:  # are the inputs known? (one line now, not a failed cell per length)
            subject.make_inputs(subject.build(probe_device), {**subject.default_sizes, "B": 1},
                                probe_device)
        if not subject.length_dims():
            raise TfcliError("--what model sweeps the length letters S, T or L of the inputs; "
                             "describe them with --input NAME=DTYPE[B,L] (for example)")
    import torch

    from tfcli.bench.sweep import Spec

    known = subject.model_dims(None) if cfg is not None or subject.kind == "hf" else {}
    n_heads = heads or known.get("h", 8)
    n_kv = kv_heads or (known.get("h_kv") if not heads else None) or n_heads
    if n_heads % n_kv:
        raise TfcliError(f"--kv-heads {n_kv}: must divide the {n_heads} query heads (each K/V "
                         f"head serves a group of query heads)")
    spec = Spec(what, lengths, chosen, passes, devices, dtypes, batch_size, tokens,
                n_heads, head_dim or known.get("d_k", 64), causal, tgt_len,
                threads or torch.get_num_threads(), min_time, max_time, calibrate, seed,
                max_memory=memory_limit, kv_heads=n_kv if n_kv != n_heads else None)
    _run(spec, subject, csv_path, plot, profile, json_out)


bench.rules = RULES


def _run(spec, subject, csv_path: Path | None, plot: Path | None, profile: Path | None,
         json_out: bool) -> None:
    """Run the sweep with progress on stderr, CSV rows as cells finish (into a temporary file
    renamed into place at the end), then the outputs. An interrupted run leaves an existing
    output as it was; a failed write ends the sweep, prints the table and exits 1."""
    from tfcli.bench.sweep import Sweep, environment, fits
    from tfcli.render.bench import record_line, render
    from tfcli.render.progress import cells_bar

    progress = cells_bar()
    csv_out = AtomicFile(csv_path, newline="") if csv_path is not None else None
    writer = None
    after_cell = _profiler(profile) if profile is not None else None

    def on_record(record) -> None:
        nonlocal writer
        progress.console.print(record_line(record), highlight=False)
        if csv_out is None:
            return
        try:
            row = record.to_dict()
            if writer is None:
                writer = csv.DictWriter(csv_out.text(), fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            csv_out.text().flush()
        except OSError as error:
            raise _WriteFailed(f"--csv {str(csv_path)!r}: {error.strerror or error}") from None

    failed = None
    try:
        with progress:
            task = progress.add_task("starting", total=None)
            sweep = Sweep(spec, subject, on_record,
                          lambda desc, done: progress.update(task, description=desc,
                                                             completed=done,
                                                             total=sweep.total_cells),
                          after_cell=after_cell)
            try:
                records = sweep.run()
            except _WriteFailed as error:
                records, failed = sweep.records, str(error)
        fitted = fits(records)
        env = environment(spec, sweep.kernels_ok, sweep)
        written = _finish_outputs(csv_out, plot, records, sweep.interrupted or failed is not None,
                                  (spec, fitted, env))
    except BaseException:
        if csv_out is not None:
            csv_out.discard()
        raise
    model_run = subject is not None and spec.what == "model"
    if json_out:
        print_json({"environment": env, "spec": vars(spec),
                    "subject": subject.describe() if model_run else None,
                    "interrupted": sweep.interrupted,
                    "notes": sweep.notes, "records": [r.to_dict() for r in records],
                    "fits": [vars(f) for f in fitted],
                    "flop_convention": "2 × multiply-accumulates of matrix products and "
                                       "convolutions; backward = 2 × forward; causal "
                                       "attention counts half"})
    else:
        console = stdout()
        if model_run:  # (an attention sweep is sized by its options, not by a model)
            console.print(f"model: {subject.label}", highlight=False)
        render(records, fitted, env, console, sweep.interrupted)
        for line in [*sweep.notes, *written]:
            console.print(line)
        if profile is not None and failed is None and after_cell.traces:
            console.print(f"wrote profiler traces to {profile}/ — view them with TensorBoard's "
                          f"PyTorch profiler plugin (pip install torch-tb-profiler tensorboard; "
                          f"tensorboard --logdir {profile} --host 127.0.0.1), or open a "
                          f"*.pt.trace.json in "
                          f"Perfetto or chrome://tracing")
    if failed is not None:
        raise TfcliError(f"{failed}; the sweep stopped there (the table holds what was measured)"
                         f"{'; existing outputs are left as they were' if csv_path else ''}",
                         exit_code=1)
    if sweep.interrupted:  # the sweep stopped at Ctrl-C and printed what it measured
        raise typer.Exit(INTERRUPTED)
    failed_cells = [r for r in records if r.status.startswith(("error", "mismatch"))]
    if failed_cells and not any(r.status.startswith("ok") for r in records):
        raise TfcliError(f"no cell was measured: {len(failed_cells)} of {len(records)} failed "
                         f"(each record says why)", exit_code=1)


def _finish_outputs(csv_out: AtomicFile | None, plot: Path | None, records,
                    partial: bool, plot_context: tuple = ()) -> list[str]:
    """Rename the CSV into place and draw the plot, atomically; after an interruption or a
    failure an existing file is left as it was. Returns the lines saying what was written."""
    lines = []
    if csv_out is not None:
        if partial and csv_out.path.exists():
            csv_out.discard()
            lines.append(f"not written: records (the run did not finish; {csv_out.path} is "
                         f"left as it was)")
        else:
            try:
                if len(plot_context) > 1:  # a finished sweep: each row gets its series' fit
                    _add_fit_columns(csv_out, plot_context[1])
                csv_out.commit()
            except OSError as error:
                raise TfcliError(f"--csv {str(csv_out.path)!r}: {error.strerror or error}",
                                 exit_code=1) from None
            lines.append(f"wrote records: {csv_out.path}")
    if plot is not None and records and not (partial and plot.exists()):
        from tfcli.render.bench_plot import save_plot

        out = AtomicFile(plot)
        try:
            save_plot(records, out.temp, *plot_context)  # spec, fits, environment
            out.commit()
        except (OSError, ValueError, RuntimeError) as error:
            out.discard()
            raise TfcliError(f"--plot {str(plot)!r}: {error}", exit_code=1) from None
        lines.append(f"wrote plot: {plot}")
    return lines


def _add_fit_columns(csv_out: AtomicFile, fitted) -> None:
    """Rewrite the finished CSV (still under its temporary name) with the fit of each row's
    series: exponent, 95 % interval, reliable."""
    from tfcli.bench.sweep import fit_columns

    if csv_out._file is None:
        return
    csv_out._file.close()
    with csv_out.temp.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    by_series = fit_columns(fitted)
    extra = list(next(iter(by_series.values()), {}))
    if not rows or not extra:
        return
    with csv_out.temp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], *extra])
        writer.writeheader()
        for row in rows:
            series = f"{row['kernel']} {row['pass']} {row['device']} {row['dtype']}"
            writer.writerow({**row, **by_series.get(series, {})})


def _profiler(directory: Path):
    """A callback writing a short torch.profiler trace of each measured cell, whole or not at
    all (:func:`_write_trace`). A trace that could not be written ends the sweep (exit 1).
    ``after_cell.traces`` counts the traces written. The directory is made absolute here,
    before any cell runs: a model that changes directory while it runs (tfcli changes it back
    after each call it makes, not inside the profiler's steps) would move the traces."""
    shown, directory = directory, Path(os.path.abspath(directory))
    from tfcli.cli.outputs import made_directory

    made = not directory.exists()  # made by this run: removed again if it stays empty
    if made:
        made_directory(directory)  # and by a second signal, which ends the run at once

    def after_cell(record, prepared) -> None:
        try:
            _profile_cell(record, prepared)
        except BaseException:
            if made and not after_cell.traces:
                try:
                    directory.rmdir()  # only if empty: nothing written is left behind
                except OSError:
                    pass
            raise
        if after_cell.traces:
            made_directory(directory, False)

    def _profile_cell(record, prepared) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        from tfcli.inspection.memory import quiet_native_stderr

        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise _WriteFailed(f"--profile {str(shown)!r}: {error.strerror}") from None
        activities = [ProfilerActivity.CPU]
        if record.device.startswith("cuda"):
            activities.append(ProfilerActivity.CUDA)
        name = f"{record.kernel}_{record.pass_}_L{record.seq_len}_{record.device}_{record.dtype}"
        failed: list[BaseException] = []

        def on_trace_ready(prof) -> None:
            # raised from here, an error unwinds through the profiler mid-step, which crashes
            # the process (SIGSEGV, torch 2.13): kept, and raised once the profiler is done.
            # That includes the KeyboardInterrupt of a Ctrl-C or SIGTERM during the export.
            try:
                _write_trace(prof, directory, name)
                after_cell.traces += 1
            except BaseException as error:
                failed.append(error)

        try:
            with quiet_native_stderr(), profile(activities=activities, profile_memory=True,
                                                record_shapes=True, acc_events=True,
                                                schedule=schedule(wait=0, warmup=1, active=2),
                                                on_trace_ready=on_trace_ready) as prof:
                for _ in range(3):
                    prepared.run()
                    prof.step()
        except (OSError, RuntimeError) as error:  # the profiler itself failed
            raise _WriteFailed(f"--profile {str(shown)!r}: {error}") from None
        if failed and not isinstance(failed[0], OSError):
            raise failed[0]
        if failed:
            raise _WriteFailed(f"--profile {str(shown)!r}: "
                               f"{failed[0].strerror or failed[0]}") from None

    after_cell.traces = 0
    return after_cell


def _write_trace(prof, directory: Path, name: str) -> None:
    """``prof``'s Chrome trace as ``directory/name.<ns>.pt.trace.json`` (as TensorBoard's
    ``tensorboard_trace_handler`` names it), whole or not at all. torch's export (Kineto)
    reports no failed write: on a full disk it left an empty or truncated file, and the run
    said it had written it. So it writes to a temporary name, what it wrote is read back, and
    only whole JSON is renamed into place; otherwise OSError, and nothing is left (Kineto's own
    temporary file, the name plus ".tmp", included)."""
    import json
    import time

    out = AtomicFile(directory / f"{name}.{time.time_ns()}.pt.trace.json")
    out.also(Path(f"{out.temp}.tmp"))  # Kineto's; a second signal ends the run without it too
    try:
        prof.export_chrome_trace(str(out.temp))
        try:
            json.loads(out.temp.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise OSError("the trace was not written whole (is the disk full?)") from None
        out.commit()
    except BaseException:
        out.discard()
        raise
