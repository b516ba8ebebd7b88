"""Renderers at the widths people use: tables fit 80 and 120 columns without cutting a cell,
bench tables from fixed records (golden), plots and mask pictures."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from tfcli.bench.sweep import Record, fits
from tfcli.render.bench import render as render_bench


def console(width: int) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=width, no_color=True, markup=False, highlight=False,
                   force_terminal=False), out


def fixed_records(kernels=("naive", "sdpa"), status: dict | None = None) -> list[Record]:
    """A sweep's records with round numbers: time ∝ L² (naive and sdpa), memory ∝ L² / L."""
    records = []
    for pass_ in ("fwd", "fwdbwd"):
        for kernel in kernels:
            for i, length in enumerate((256, 512, 1024, 2048)):
                r = Record("attention", length, 1, kernel, pass_, "cpu", "fp32", 1)
                r.kernel_ran = {"naive": "matmul+softmax", "sdpa": "flash (cpu)"}[kernel]
                scale = (3 if pass_ == "fwdbwd" else 1) * (1 if kernel == "sdpa" else 3)
                r.median_s = scale * 1e-3 * 4 ** i
                r.iqr_s = r.median_s * 0.02
                r.n = r.runs = 12
                r.samples_s = [r.median_s * (1 + 0.01 * ((k % 5) - 2)) for k in range(12)]
                r.peak_bytes = int(2**20 * (4 ** i if kernel == "naive" else 2 ** i))
                r.memory_method = "profiler allocation events"
                r.flops = scale * 4 * 8 * length * length * 64
                r.flops_per_s = r.flops / r.median_s
                r.tokens_per_s = length / r.median_s
                r.pct_peak = 100 * r.flops_per_s / 200e9
                r.dispersion, r.reliable = 0.02, True
                r.status = (status or {}).get((kernel, pass_, length), "ok")
                records.append(r)
    return records


ENV = {"threads": 1, "torch": "2.13.0+cpu", "reliable_dispersion": 0.1,
       "machine": {"start": {"cpus": 2, "load_avg": [0.1, 0.2, 0.3], "busy_cpus": 0.05},
                   "end": {"cpus": 2, "load_avg": [0.9, 0.3, 0.3], "busy_cpus": 0.0}}}


def bench_text(width: int, records: list[Record]) -> str:
    con, out = console(width)
    render_bench(records, fits(records), ENV, con, interrupted=False)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 120])
def test_bench_table_golden(golden, width):
    records = fixed_records(status={("sdpa", "fwdbwd", 2048): "OOM"})
    noisy = next(r for r in records if (r.kernel, r.pass_, r.seq_len) == ("naive", "fwd", 512))
    noisy.dispersion, noisy.reliable, noisy.pct_peak = 0.6, False, 114.0
    noisy.samples_s = [noisy.median_s * f for f in (0.5, 0.8, 1.0, 1.0, 1.3, 2.0)]
    golden(f"bench_{width}.txt", bench_text(width, records))


@pytest.mark.parametrize("width", [80, 100, 120])
def test_bench_table_fits_and_keeps_the_important_columns(width):
    text = bench_text(width, fixed_records())
    header = next(line for line in text.splitlines() if " kernel" in line)
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines())
    for name in ("L", "pass", "GF"):
        assert name in header.split() or any(w.startswith(name) for w in header.split()), header
    assert "med" in header and "peak" in header
    if width >= 100:  # a status column that says "ok" everywhere may go, but says so
        assert "status" in header or "left out to fit 100 columns: status" in text


def test_a_failed_cell_keeps_its_status_at_80_columns():
    text = bench_text(80, fixed_records(status={("naive", "fwd", 512): "OOM"}))
    assert "OOM" in text and "status" in text.splitlines()[2]


def test_left_out_columns_are_named():
    text = bench_text(80, fixed_records())
    assert "left out to fit 80 columns: " in text and "tokens/s" in text


@pytest.mark.parametrize("width", [80, 120])
def test_params_table_fits_with_its_train_column(cli, golden, width):
    result = cli("params", "--preset", "tiny", "--set", "tie_embeddings=tgt_output",
                 "--freeze", "encoder.layers.1", env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    table = result.stdout.split("\n\n")[0]
    assert "…" not in result.stdout and "train" in table.splitlines()[2] and "frozen" in table
    assert all(len(line) <= width for line in table.splitlines())
    golden(f"params_tiny_{width}.txt", result.stdout)


def test_noise_is_said_in_words():
    records = fixed_records(kernels=("sdpa",))
    noisy = records[1]
    noisy.dispersion, noisy.reliable, noisy.pct_peak = 0.6, False, 114.0
    noisy.samples_s = [noisy.median_s * f for f in (0.3, 0.6, 1.0, 1.0, 1.6, 3.0)]
    text = bench_text(120, records)
    assert "unreliable: 1 of 8 cells" in text and "114%!" in text
    assert "% peak above 100 (marked !) in 1 cell(s): a measurement problem" in text
    assert "sdpa fwd cpu fp32, L = 256, 512, 1024, 2048:\n    time ∝ L^2.00 [" in text
    assert "not reliable: built on 1 unreliable cell (L = 512)" in text
    assert "machine: start 0.1 of 2 CPUs busy, load 0.10, 0.20, 0.30" in text
    # the steady series has a narrow interval and no warning
    fwdbwd = text[text.index("sdpa fwdbwd cpu fp32, L ="):].splitlines()
    assert not fwdbwd[2].strip().startswith("not reliable")


# --- pictures -----------------------------------------------------------------------------------

def test_mask_ticks_stay_legible_at_40_and_400_positions():
    from tfcli.render.masks_png import tick_positions

    assert tick_positions(12) == list(range(12))
    for n in (40, 41, 400, 4096):
        ticks = tick_positions(n)
        assert len(ticks) <= 21 and ticks[0] == 0 and ticks[-1] <= n - 1
        assert min(b - a for a, b in zip(ticks, ticks[1:])) >= ticks[1] - ticks[0]


def test_mask_png_uses_no_red_or_green():
    from matplotlib.colors import to_rgb

    from tfcli.render.masks_png import ALLOWED_COLOUR, BLOCKED_COLOUR

    for colour in (ALLOWED_COLOUR, BLOCKED_COLOUR):
        r, g, b = to_rgb(colour)
        assert not (r > g + 0.2 and r > b + 0.2) and not (g > r + 0.2 and g > b + 0.2)
    # and they differ in lightness, not only in hue
    assert abs(sum(to_rgb(ALLOWED_COLOUR)) - sum(to_rgb(BLOCKED_COLOUR))) > 1.0


def test_bench_plot_title_says_what_was_measured():
    from tfcli.bench.sweep import Spec
    from tfcli.render.bench_plot import title_for

    spec = Spec("attention", [256], ["sdpa"], ["fwd"], ["cpu"], ["fp32"], heads=8, head_dim=64,
                causal=True, threads=1)
    title = title_for(fixed_records(), spec, {"devices": {"cpu": "Some CPU"}})
    for part in ("B = 1", "h = 8", "d_k = 64", "causal", "fp32", "1 thread", "cpu (Some CPU)"):
        assert part in title, title


def test_bench_plot_is_the_same_whatever_the_order_of_records(tmp_path):
    """Colours, styles and legend order are fixed per kernel and pass, not by arrival order."""
    import random

    from tfcli.render.bench_plot import save_plot

    records = fixed_records(kernels=("naive", "sdpa"))
    records[1].reliable = False
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    save_plot(records, tmp_path / "a.png", None, fits(records))
    save_plot(shuffled, tmp_path / "b.png", None, fits(shuffled))
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


# --- mask conventions: what the grids say about rows with no allowed key is what torch does ------

def test_rows_with_no_allowed_key_behave_as_the_grids_say():
    import torch
    import torch.nn.functional as F

    from tfcli.render.masks import EMPTY_ROW

    torch.manual_seed(0)
    x = torch.randn(1, 3, 4)
    allowed = torch.tensor([[True, False, False], [False, False, False], [True, True, True]])
    scores = x @ x.transpose(-1, -2)
    minus_1e9 = torch.softmax(scores.masked_fill(~allowed, -1e9), -1)[0, 1]
    minus_inf = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)[0, 1]
    assert torch.allclose(minus_1e9, torch.full((3,), 1 / 3))
    assert "equal weights" in EMPTY_ROW["keep-01"]
    assert minus_inf.isnan().all() and "-inf → NaN" in EMPTY_ROW["keep-01"]
    sdpa = F.scaled_dot_product_attention(x[None], x[None], x[None], attn_mask=allowed)[0, 0, 1]
    assert (sdpa == 0).all()
    assert "SDPA (torch 2.13) and tfcli give zeros" in EMPTY_ROW["bool-allowed"]
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    with torch.no_grad():
        out = mha(x, x, x, attn_mask=~allowed)[0][0, 1]
    assert out.isnan().all() and "nn.MultiheadAttention gives NaN" in EMPTY_ROW["bool-blocked"]


@pytest.mark.parametrize("convention", ["bool-blocked", "keep-01", "additive"])
def test_a_converted_grid_never_sits_under_true_means_may_attend(cli, convention):
    result = cli("masks", "--preset", "tiny", "--convention", convention, env={"NO_COLOR": "1"})
    assert result.exit_code == 0, result.stderr
    assert "True = may attend" not in result.stdout


def test_multihead_attention_shapes_are_2d_or_3d(cli):
    result = cli("masks", "--preset", "tiny", "--convention", "bool-blocked",
                 env={"NO_COLOR": "1", "COLUMNS": "200"})
    lines = [line for line in result.stdout.splitlines() if "nn.MultiheadAttention:" in line]
    assert lines and all("[B, h" not in line for line in lines)
    assert "attn_mask [T, T] = [5, 5] (2-D)" in result.stdout  # causal: one for every sequence
    assert "key_padding_mask [B, S] = [2, 6]" in result.stdout  # tiny's default --src-lens 4,6
    assert "attn_mask [B·h, T, T] = [8, 5, 5]" in result.stdout  # the combined decoder mask


@pytest.mark.parametrize("command", [[], ["params"], ["shapes"], ["masks"], ["bench"],
                                     ["config"], ["presets"]])
def test_flags_show_no_bool_metavar(cli, command):
    """A "<bool>" beside --expand reads as if --expand true were wanted; it is refused."""
    result = cli(*command, "--help", env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--help" in result.stdout
    assert "<bool>" not in result.stdout


def test_progress_only_at_a_terminal(monkeypatch, capsys):
    from tfcli.render.progress import working

    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    with working("building") as say:
        say("running")
    assert capsys.readouterr().err == ""  # a pipe or a file: nothing
    monkeypatch.setenv("FORCE_COLOR", "1")  # Rich takes this for a terminal
    with working("building") as say:
        say("running the forward pass")
    captured = capsys.readouterr()
    assert "running the forward pass" in captured.err and captured.out == ""
