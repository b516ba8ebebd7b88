"""Bench results: the table, the fitted exponents under it, and one line per record as it
arrives."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from tfcli.bench.sweep import Fit, Record
from tfcli.render import human_bytes

FLOP_CONVENTION = ("FLOPs: 2 × multiply-accumulates of matrix products; backward = 2 × forward; "
                   "causal attention counts half")


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.3f}"


def record_line(r: Record) -> str:
    if r.status != "ok":
        return f"L={r.seq_len} {r.kernel} {r.pass_} {r.device} {r.dtype}: {r.status}"
    return (f"L={r.seq_len} {r.kernel} {r.pass_} {r.device} {r.dtype}: {_ms(r.median_s)} ms "
            f"(IQR {_ms(r.iqr_s)}, n={r.n}), {human_bytes(r.peak_bytes or 0)}, "
            f"{(r.flops_per_s or 0) / 1e9:.1f} GFLOP/s")


def render(records: list[Record], fitted: list[Fit], env: dict, console: Console,
           interrupted: bool) -> None:
    shown = [r for r in records if not r.status.startswith(("skipped", "unsupported"))]
    shown.sort(key=lambda r: (r.device, r.dtype, r.pass_, r.kernel, r.seq_len))
    model = any(r.what == "model" for r in records)
    # Columns that hold one value for every row go into the title instead.
    batches = {r.batch_size for r in shown}
    devices = {f"{r.device} {r.dtype}" for r in shown}
    with_peak = any(r.pct_peak is not None for r in shown)
    title = f"tfcli bench: {records[0].what if records else ''}"
    title += f", B = {batches.pop()}" if len(batches) == 1 else ""
    title += f", {devices.pop()}" if len(devices) == 1 else ""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = (["L"] + (["B"] if len({r.batch_size for r in shown}) > 1 else [])
               + ["kernel → ran", "pass"]
               + (["device"] if len({(r.device, r.dtype) for r in shown}) > 1 else [])
               + ["median ms", "IQR ms (n)", "peak mem", "GFLOP/s"]
               + (["% peak"] if with_peak else []) + (["attn"] if model else [])
               + ["tokens/s", "status"])
    kernel_width = max((len(f"{r.kernel} → {r.kernel_ran or '?'}") for r in shown), default=12)
    for name in columns:
        left = name in ("kernel → ran", "pass", "device", "status")
        table.add_column(name, justify="left" if left else "right", no_wrap=name != "status",
                         min_width=kernel_width if name == "kernel → ran" else None)
    for r in shown:
        cells = {
            "L": str(r.seq_len), "B": str(r.batch_size),
            "kernel → ran": f"{r.kernel} → {r.kernel_ran or '?'}", "pass": r.pass_,
            "device": f"{r.device} {r.dtype}", "median ms": _ms(r.median_s),
            "IQR ms (n)": f"{_ms(r.iqr_s)} ({r.n})",
            "peak mem": human_bytes(r.peak_bytes) if r.peak_bytes is not None else "—",
            "GFLOP/s": f"{r.flops_per_s / 1e9:.1f}" if r.flops_per_s else "—",
            "% peak": f"{r.pct_peak:.0f}%" if r.pct_peak is not None else "—",
            "attn": f"{100 * r.attention_share:.0f}%" if r.attention_share is not None else "—",
            "tokens/s": f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "—", "status": r.status,
        }
        table.add_row(*(cells[c] for c in columns))
    console.print(table)
    not_run = {}
    for r in records:
        if r not in shown:
            where = f"{r.device} {r.dtype}"
            key = where if r.status.startswith("skipped") else f"{r.kernel} on {where}"
            not_run.setdefault(key, r.status)
    for what, status in not_run.items():
        console.print(f"not run: {what}: {status}")
    console.print("scaling (least-squares slope of log y on log L; all lengths / upper half):")
    for f in sorted(fitted, key=lambda f: f.series):
        if f.time_exponent is None:
            continue
        console.print(f"  {f.series}: time ∝ L^{f.time_exponent:.2f} / L^{_fmt(f.time_exponent_upper)}"
                      f", memory ∝ L^{_fmt(f.memory_exponent)} / L^{_fmt(f.memory_exponent_upper)}"
                      f"   (L = {', '.join(map(str, f.seq_lens))})")
    methods = sorted({r.memory_method for r in records if r.memory_method})
    console.print(f"{FLOP_CONVENTION}. Peak memory: {', '.join(methods) or '—'}. "
                  f"Threads: {env['threads']}. torch {env['torch']}.")
    if interrupted:
        console.print("interrupted: the table holds what was measured before Ctrl-C", style="bold")


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"
