"""Bench results: the table, the fitted exponents under it, and one line per record as it
arrives."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

from tfcli.bench.sweep import Fit, Record
from tfcli.render import human_bytes
from tfcli.render.columns import Col, fit_table, left_out_line

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


def _columns(shown: list[Record], model: bool, with_peak: bool) -> list[Col]:
    """The table's columns in display order, ranked by importance (0 first): L, kernel, pass,
    median, peak memory and GFLOP/s are what a sweep is for; B and device tell rows apart where
    they vary; a status other than "ok" outranks the rest; "ok" everywhere goes first."""
    failed = any(r.status != "ok" for r in shown)
    cols = [
        Col("L", 0, [str(r.seq_len) for r in shown], justify="right"),
        Col("B", 1, [str(r.batch_size) for r in shown], justify="right"),
        Col("kernel → ran", 0, [f"{r.kernel} → {r.kernel_ran or '?'}" for r in shown],
            short="kernel→ran"),
        Col("pass", 0, [r.pass_ for r in shown]),
        Col("device", 1, [f"{r.device} {r.dtype}" for r in shown]),
        Col("median ms", 2, [_ms(r.median_s) for r in shown], short="med ms", justify="right"),
        Col("IQR ms (n)", 6, [f"{_ms(r.iqr_s)} ({r.n})" for r in shown], short="IQR (n)",
            justify="right"),
        Col("peak mem", 3, [human_bytes(r.peak_bytes) if r.peak_bytes is not None else "—"
                            for r in shown], short="peak", justify="right"),
        Col("GFLOP/s", 4, [f"{r.flops_per_s / 1e9:.1f}" if r.flops_per_s else "—" for r in shown],
            short="GF/s", justify="right"),
        Col("% peak", 7, [f"{r.pct_peak:.0f}%" if r.pct_peak is not None else "—"
                          for r in shown], short="%pk", justify="right"),
        Col("attn", 8, [f"{100 * r.attention_share:.0f}%" if r.attention_share is not None
                        else "—" for r in shown], justify="right"),
        Col("tokens/s", 9, [f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "—" for r in shown],
            short="tok/s", justify="right"),
        Col("status", 5 if failed else 10, [r.status for r in shown],
            wrap=min(16, max(len(r.status) for r in shown)) if shown else None),
    ]
    keep = {"B": len({r.batch_size for r in shown}) > 1,
            "device": len({(r.device, r.dtype) for r in shown}) > 1,
            "% peak": with_peak, "attn": model}
    return [c for c in cols if keep.get(c.name, True)]


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
    table, left_out = fit_table(_columns(shown, model, with_peak), console, title=title,
                                title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    console.print(table)
    if left_out:
        console.print(left_out_line(left_out, console.width))
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
