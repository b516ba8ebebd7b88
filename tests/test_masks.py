"""Masks: truth tables against torch's own conventions, the mask set per model kind, and
`tfcli masks --check` passing on the model and failing on deliberately broken attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import background
import forked

from tfcli.model import masks
from tfcli.model.attention import Attend
from tfcli.inspection.maskcheck import mask_set
from tfcli.model.presets import get_preset


def test_causal_is_torchs_subsequent_mask_inverted():
    for t in (1, 2, 7):
        reference = nn.Transformer.generate_square_subsequent_mask(t) == 0  # 0 = may attend
        assert torch.equal(masks.causal(t), reference)
        assert bool(masks.causal(t).diagonal().all())  # a position sees itself


def test_padding_blocks_exactly_the_padded_columns():
    valid = masks.valid_from_lengths([3, 1], 4)
    grid = masks.encoder_self_mask(valid, 4).expand(2, 1, 4, 4)[:, 0]
    for b, length in enumerate([3, 1]):
        for q in range(4):
            assert grid[b, q].tolist() == [k < length for k in range(4)]


def test_combined_decoder_mask_is_the_and_of_its_parts():
    valid = masks.valid_from_lengths([5, 2])
    combined = masks.decoder_self_mask(valid, 5).expand(2, 1, 5, 5)
    for b in range(2):
        for q in range(5):
            for k in range(5):
                assert bool(combined[b, 0, q, k]) == (k <= q and bool(valid[b, k]))


def test_cross_mask_is_target_by_source():
    cfg = get_preset("tiny")
    src_valid, tgt_valid = masks.valid_from_lengths([7, 2]), masks.valid_from_lengths([3, 3])
    cross = {m.key: m for m in mask_set(cfg, src_valid, tgt_valid)}["cross"]
    grid = cross.expanded(2, 3, 7)
    assert grid.shape == (2, 3, 7)  # T x S with S != T
    assert grid[1].tolist() == [[k < 2 for k in range(7)]] * 3


@pytest.mark.parametrize("name,keys", [
    ("tiny", ["encoder_self", "decoder_causal", "decoder_padding", "decoder_self", "cross"]),
    ("gpt2-small", ["decoder_causal", "decoder_padding", "decoder_self"]),
    ("bert-base", ["encoder_self"]),
])
def test_mask_set_follows_the_model_kind(name, keys):
    cfg = get_preset(name)
    valid = masks.valid_from_lengths([4, 2])
    got = mask_set(cfg, valid if cfg.has_encoder else None, valid if cfg.has_decoder else None)
    assert [m.key for m in got] == keys


@pytest.mark.parametrize("convention", list(masks.CONVENTIONS))
def test_conventions_round_trip(convention):
    mask = masks.decoder_self_mask(masks.valid_from_lengths([4, 2]), 4)
    assert torch.equal(masks.from_convention(masks.to_convention(mask, convention), convention), mask)


def test_conventions_mean_what_their_consumers_expect():
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 8)  # one head
    allowed = masks.decoder_self_mask(masks.valid_from_lengths([4, 3]), 4)  # no empty rows
    expected = F.scaled_dot_product_attention(q, q, q, attn_mask=allowed)
    # additive: added to the scores
    additive = masks.to_convention(allowed, "additive")
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, attn_mask=additive), expected)
    # keep-01: the tutorials' scores.masked_fill(mask == 0, -inf)
    keep = masks.to_convention(allowed, "keep-01")
    scores = (q @ q.transpose(-2, -1) / 8 ** 0.5).masked_fill(keep == 0, float("-inf"))
    torch.testing.assert_close(scores.softmax(-1) @ q, expected)
    # bool-blocked: nn.MultiheadAttention's attn_mask (True = not allowed), per batch element
    mha = nn.MultiheadAttention(8, 1, batch_first=True, bias=False)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.eye(8).repeat(3, 1))
        mha.out_proj.weight.copy_(torch.eye(8))
    blocked = masks.to_convention(allowed, "bool-blocked")
    for b in range(2):
        out, _ = mha(q[b], q[b], q[b], attn_mask=blocked[b, 0])
        torch.testing.assert_close(out[0], expected[b, 0], rtol=1e-5, atol=1e-6)


def test_check_passes_on_the_model(cli):
    result = cli("masks", "--preset", "tiny", "--check", "--src-lens", "5,2,0", "--tgt-lens",
                 "3,4,2")
    assert result.exit_code == 0, result.stdout
    assert "PASSED" in result.stdout and "✗" not in result.stdout
    assert "with no allowed key, weights there:" in result.stdout
    assert "✓ no NaN" in result.stdout


def _ignore_mask(self, q, k, v, mask=None):
    return _ORIGINAL(self, q, k, v, None)


def _inverted_mask(self, q, k, v, mask=None):
    return _ORIGINAL(self, q, k, v, None if mask is None else ~mask)


_ORIGINAL = Attend.forward


@pytest.mark.parametrize("broken", [_ignore_mask, _inverted_mask], ids=["ignored", "inverted"])
@pytest.mark.parametrize("preset", ["tiny", "gpt2-small"])
def test_check_fails_on_broken_attention(cli, monkeypatch, broken, preset):
    monkeypatch.setattr(Attend, "forward", broken)
    args = ["masks", "--preset", preset, "--check", "--json"]
    if preset == "gpt2-small":
        args += ["--set", "n_decoder_layers=2"]
    result = cli(*args)
    assert result.exit_code == 1
    check = json.loads(result.stdout)["check"]
    status = {c["name"]: c["status"] for c in check["checks"]}
    assert check["verdict"] == "failed" and status["causality of tgt"] == "failed"
    layers = [name for name in status if name.startswith("attention ")]
    assert layers and all(status[name] == "failed" for name in layers)


def test_empty_rows_give_zeros_not_nan(cli):
    result = cli("masks", "--preset", "bert-base", "--set", "n_encoder_layers=1", "--src-lens",
                 "3,0", "--check", "--json")
    assert result.exit_code == 0, result.stdout
    check = json.loads(result.stdout)["check"]
    assert check["verdict"] == "passed"
    layer = next(c for c in check["checks"] if c["name"].startswith("attention "))
    # batch element 1 is empty: its 3 query rows may attend to no key; the output has no NaN
    assert "3 query row(s) with no allowed key" in layer["detail"]
    assert next(c for c in check["checks"] if c["name"] == "no NaN")["status"] == "passed"


def test_json_masks(cli):
    result = cli("masks", "--preset", "tiny", "--json", "--convention", "additive")
    data = json.loads(result.stdout)
    by_key = {m["key"]: m for m in data["masks"]}
    assert by_key["decoder_self"]["shape"] == [2, 1, 5, 5]
    assert by_key["cross"]["broadcast_shape"] == [2, 4, 5, 6]
    assert by_key["decoder_self"]["allowed"][0][0] == [True, False, False, False, False]
    assert by_key["decoder_self"]["values"][0][0] == [0.0, "-inf", "-inf", "-inf", "-inf"]
    assert data["valid"]["src"][0] == [True] * 4 + [False] * 2


def test_token_ids_with_pad_id(cli):
    result = cli("masks", "--preset", "gpt2-small", "--tgt-ids", "5,6,9;7,9,9", "--pad-id", "9",
                 "--json")
    assert json.loads(result.stdout)["valid"]["tgt"] == [[True, True, False], [True, False, False]]


@pytest.mark.parametrize("convention", list(masks.CONVENTIONS))
def test_golden_render(cli, golden, convention):
    result = cli("masks", "--preset", "tiny", "--convention", convention, "--batch-index", "0",
                 env={"NO_COLOR": "1"})
    assert result.exit_code == 0
    golden(f"masks_tiny_{convention}.txt", result.stdout)


def test_large_grids_are_elided(cli):
    result = cli("masks", "--preset", "bert-base", "--src-lens", "100,40", "--max-grid", "8")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert any("…" in line for line in lines) and any("⋮" in line for line in lines)
    assert max(len(line) for line in lines) < 120


def test_png(cli, tmp_path):
    path = tmp_path / "m.png"
    result = cli("masks", "--preset", "tiny", "--png", str(path))
    assert result.exit_code == 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,message", [
    (["--src-lens", "5,x"], "--src-lens '5,x': expected non-negative integers, e.g."),
    (["--src-lens", "5,-1"], "--src-lens '5,-1': expected non-negative integers, e.g."),
    (["--src-lens", "5,3", "--tgt-lens", "4"], "source and target batches differ in size"),
    (["--src-lens", "3", "--src-ids", "1,2"], "give one or the other"),
    (["--tgt-ids", "1,2;3"], "expected equal-length sequences"),
    (["--batch-index", "2"], "--batch-index 2: the batch has 2 sequences"),
    (["--src-lens", "65"], "padded length 65 must be in 1..max_seq_len=64"),
    (["--convention", "float"], "Invalid value for '--convention'"),
    (["--png", "out.jpg"], "the file name must end in .png"),
    (["--png", "/no/such/dir/m.png"], "no such directory"),
    (["--max-grid", "2"], "Invalid value for '--max-grid'"),
    (["--max-grid", "1000000"], "less than or equal to 512"),  # would allocate the whole grid
    (["--pad-id", "x"], "Invalid value for '--pad-id'"),
    (["--batch-index", "-1"], "Invalid value for '--batch-index'"),
])
def test_bad_options(cli, args, message):
    result = cli("masks", "--preset", "tiny", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == ""


TUTORIAL = ["--model", str(Path(__file__).parent.parent / "examples" / "tutorial_transformer.py")
            + ":build", "--input", "src=int64[B,S]", "--input", "tgt=int64[B,T]"]


@pytest.mark.parametrize("args,message", [
    (["--preset", "tiny", "--json", "--batch-index", "1"], "--json holds every sequence"),
    ([*TUTORIAL, "--causal", "tgt"], "--causal names what --check verifies; add --check"),
    ([*TUTORIAL, "--json", "--convention", "additive"], "--convention: shape the drawn grids"),
    ([*TUTORIAL, "--json", "--max-grid", "8", "--batch-index", "1"],
     "--batch-index 1 picks the sequence drawn"),
])
def test_options_that_would_do_nothing_are_refused(cli, args, message):
    result = cli("masks", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_batch_index_still_picks_the_png_sequence_with_json(cli, tmp_path):
    result = cli("masks", "--preset", "tiny", "--json", "--batch-index", "1", "--png",
                 str(tmp_path / "m.png"))
    assert result.exit_code == 0, result.stderr


def test_side_the_model_does_not_have(cli):
    result = cli("masks", "--preset", "gpt2-small", "--src-lens", "3")
    assert result.exit_code == 2 and "this decoder-only model has no source side" in result.stderr


def test_sliding_window_is_drawn_and_checked():
    """The decoder's mask under attention_window is the causal band i - W < j <= i, and the
    check fails on a model that ignores the window."""
    import torch

    from tfcli.inspection.maskcheck import mask_set
    from tfcli.inspection.verdict import check, make_plan
    from tfcli.model.masks import valid_from_lengths
    from tfcli.model.presets import get_preset
    from tfcli.model.transformer import build_model, example_inputs
    from tfcli.subjects.base import Inputs
    from tfcli.subjects.own import OwnSubject

    cfg = get_preset("llama-tiny").replace(attention_window=2, attention="naive")
    valid = valid_from_lengths([5, 5])
    used = {m.key: m for m in mask_set(cfg, None, valid)}["decoder_self"]
    i = torch.arange(5)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 2)
    assert torch.equal(used.expanded(2, 5, 5)[0], band)
    kwargs = {"tgt": example_inputs(cfg, 2, 1, 5)["tgt"], "tgt_valid": valid}

    def verdict(model):  # the check of the windowed configuration, on ``model``
        plan = make_plan(OwnSubject(cfg), model, Inputs((), kwargs), {"tgt": valid}, [], {}, 0,
                         cfg.tgt_vocab_size)
        return check(model, plan)

    torch.manual_seed(0)
    assert verdict(build_model(cfg)).status == "passed"
    ignores_window = verdict(build_model(cfg.replace(attention_window=None)))
    failed = [c.name for c in ignores_window.checks if c.status == "failed"]
    assert ignores_window.status == "failed" and failed
    assert all(name.startswith("attention decoder.") for name in failed)  # still causal


# --- grids of any length: only the shown cells are computed ----------------------------------


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 2, 3, 7, 12])
def test_key_span_is_each_row_of_the_whole_mask(is_causal, window):
    for size in range(1, 10):
        if window is None:
            whole = masks.causal(size) if is_causal else torch.ones(size, size, dtype=torch.bool)
        else:
            whole = masks.sliding_window(size, window, is_causal)
        first, last = masks.key_span(torch.arange(size), size, is_causal, window)
        k = torch.arange(size)
        assert torch.equal((first[:, None] <= k) & (k <= last[:, None]), whole)


@pytest.mark.parametrize("name,window", [("tiny", None), ("tiny", 3), ("gpt2-small", None),
                                         ("gpt2-small", 5), ("bert-base", 4)])
def test_shown_cells_are_the_model_masks_cells(name, window):
    """At a length the whole masks can be built, the cells computed at the shown positions
    (and whether each shown row has an allowed key anywhere) equal the model's masks'."""
    from tfcli.inspection.maskcheck import mask_rules
    from tfcli.inspection.maskgrid import Padding, shown_cells

    cfg = get_preset(name).replace(attention_window=window, max_seq_len=100)
    ids_valid = torch.tensor([[1, 0] * 50, [0] * 60 + [1] * 40]).bool()  # as from token ids
    sides = {"src": Padding(100, lengths=(70, 0)), "tgt": Padding(100, valid=ids_valid)}
    full = {"src": masks.valid_from_lengths([70, 0], 100), "tgt": ids_valid}
    whole = {m.key: m for m in mask_set(cfg, full["src"] if cfg.has_encoder else None,
                                        full["tgt"] if cfg.has_decoder else None)}
    for g in shown_cells(mask_rules(cfg), sides, {"src": 11, "tgt": 7}):
        assert g.elided and len(g.rows) <= 11
        m = whole[g.mask.key]
        assert g.mask.stored_shape(2, 100, 100) == list(m.mask.shape)
        grid = m.expanded(2, 100, 100)
        rows, cols = torch.tensor(g.rows), torch.tensor(g.cols)
        assert torch.equal(g.allowed, grid[:, rows][:, :, cols])
        assert torch.equal(g.row_has_key, grid[:, rows].any(-1))
        q, k = full[g.mask.query_side], full[g.mask.key_side]
        assert torch.equal(g.row_valid, q[:, rows]) and torch.equal(g.col_valid, k[:, cols])
        assert g.real_keys == k.sum(1).tolist()


def _rule(key: str, q: int, k: int, window: int | None, src_len: int, tgt_len: int) -> bool:
    """What each mask allows, written out independently of tfcli: causal k <= q; a causal
    window of W: q - W < k <= q; a two-sided one: |q - k| < W; padding: k below the length."""
    causal = k <= q if window is None else q - window < k <= q
    band = True if window is None else abs(q - k) < window
    return {"encoder_window": band, "encoder_self": band and k < src_len,
            "decoder_causal": causal, "decoder_window": causal, "decoder_padding": k < tgt_len,
            "decoder_self": causal and k < tgt_len, "cross": k < src_len}[key]


def _subprocess(args: list[str], columns: int = 100):
    """tfcli as the console script (a process of its own: tests/forked.py) under a 3 GiB
    address-space limit: the old code refused (it sized whole grids), and a regression that
    builds them fails here, not in the OOM killer."""
    import subprocess

    limit = 3 * 2**30
    return background.run(
        forked.command("-m", "tfcli", *args), 120, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={**background.session_env(), "COLUMNS": str(columns), "NO_COLOR": "1"},
        address_space=limit)


HUGE_N = 10**6
HUGE_GRIDS = [  # preset, window, source lengths, target lengths
    ("gpt2-small", None, None, [HUGE_N, HUGE_N - 3]),
    ("tiny", 5, [HUGE_N - 2, HUGE_N], [4, HUGE_N]),
]
HUGE_JSON = ["masks", "--preset", "gpt2-small", "--set", f"max_seq_len={HUGE_N}", "--set",
             "attention_window=3", "--tgt-lens", f"{HUGE_N},{HUGE_N - 1}", "--json",
             "--max-grid", "6", "--convention", "additive"]


def _huge_grid_args(preset, window, src, tgt) -> list[str]:
    args = ["masks", "--preset", preset, "--set", f"max_seq_len={HUGE_N}", "--batch-index", "0",
            "--tgt-lens", ",".join(map(str, tgt))]
    if window:
        args += ["--set", f"attention_window={window}"]
    if src:
        args += ["--src-lens", ",".join(map(str, src))]
    return args


@pytest.fixture(scope="module")
def huge():
    return background.result("huge")


@background.job("huge", cost=1.1)
def _huge() -> dict:
    """The huge-length runs, each a process of its own (tests/background.py: beside the
    in-process tests): the grids by preset, and the JSON."""
    out = {case[0]: _subprocess(_huge_grid_args(*case)) for case in HUGE_GRIDS}
    out["json"] = _subprocess(HUGE_JSON)
    return out


def _parse_grids(text: str) -> dict[str, tuple[list, list[tuple]]]:
    """Drawn grids by mask name: the column labels, and each row (label, cells, note)."""
    out, lines, i = {}, text.splitlines(), 0
    while i < len(lines):
        if not lines[i].startswith("batch element"):
            i += 1
            continue
        name = next(lines[j] for j in range(i, 0, -1) if ": " in lines[j] and
                    not lines[j].startswith(("stored", "batch", "nn.")))
        cols, rows = lines[i + 1].split(), []
        i += 2
        while i < len(lines) and lines[i].strip():
            cells = lines[i].split()
            rows.append((cells[0], cells[1:1 + len(cols)], "no allowed key" in lines[i]))
            i += 1
        out[name.split(":")[0]] = (cols, rows)
    return out


KEYS = {"encoder sliding window": "encoder_window", "encoder self-attention": "encoder_self",
        "decoder causal": "decoder_causal", "decoder causal sliding window": "decoder_window",
        "decoder target padding": "decoder_padding", "decoder self-attention": "decoder_self",
        "cross-attention (memory)": "cross"}


@pytest.mark.parametrize("preset,window,src,tgt", HUGE_GRIDS)
def test_huge_lengths_draw_elided_grids_with_the_right_cells(huge, preset, window, src, tgt):
    n = HUGE_N
    result = huge[preset]
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    grids = _parse_grids(result.stdout)
    assert len(grids) == (3 if preset == "gpt2-small" else 6)
    src_len, tgt_len = (src or [0])[0], tgt[0]
    for name, (cols, rows) in grids.items():
        key = KEYS[name]
        q_len = {"encoder": src_len, "decoder": tgt_len, "cross": tgt_len}[key.split("_")[0]]
        assert "…" in cols and any(label == "⋮" for label, _, _ in rows)
        assert cols[-1].rstrip("*") == str(n - 1) and rows[-1][0].rstrip("*") == str(n - 1)
        assert max(len(line) for line in result.stdout.splitlines()
                   if "no allowed key" not in line) <= 100  # fitted to COLUMNS
        for label, cells, note in rows:
            if label == "⋮":
                continue
            q = int(label.rstrip("*"))
            assert label.endswith("*") == (q >= q_len)
            drawn = [c for c, cell in zip(cols, cells, strict=True) if c != "…"]
            for col, cell in zip(drawn, [c for c in cells if c != "…"], strict=True):
                k = int(col.rstrip("*"))
                assert cell == ("T" if _rule(key, q, k, window, src_len, tgt_len) else "F"), \
                    (name, q, k)
            # a note where the whole row, not just its shown cells, allows no key: a window
            # allows keys within W of q; without one, every rule here allows key 0 if any
            windowed = window is not None and key not in ("decoder_padding", "cross")
            keys = range(max(0, q - window + 1), min(q + window, n)) if windowed else [0]
            assert note == (not any(_rule(key, q, k, window, src_len, tgt_len) for k in keys))


def test_huge_lengths_json_is_elided_with_its_positions(huge):
    n = HUGE_N
    result = huge["json"]
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) < 20_000
    data = json.loads(result.stdout)
    shown = [0, 1, 2, 3, n - 2, n - 1]
    assert data["elided"] is True and data["positions"] == {"tgt": shown}
    assert data["valid"]["tgt"] == [[True] * 6, [True] * 5 + [False]]
    for m in data["masks"]:
        assert m["query_positions"] == m["key_positions"] == shown
        assert m["broadcast_shape"] == [2, 12, n, n]
        for b, length in enumerate([n, n - 1]):
            for i, q in enumerate(shown):
                for j, k in enumerate(shown):
                    ok = _rule(m["key"], q, k, 3, 0, length)
                    assert m["allowed"][b][i][j] == ok
                    assert m["values"][b][i][j] == (0.0 if ok else "-inf")
    assert {m["key"]: m["shape"] for m in data["masks"]} == {
        "decoder_window": [1, 1, n, n], "decoder_padding": [2, 1, 1, n],
        "decoder_self": [2, 1, n, n]}


def test_small_json_holds_every_cell_and_says_it_is_not_elided(cli):
    data = json.loads(cli("masks", "--preset", "gpt2-small", "--tgt-lens", "40", "--json").stdout)
    assert data["elided"] is False and "positions" not in data
    assert len(data["masks"][0]["allowed"][0]) == 40 and "query_positions" not in data["masks"][0]


def test_grids_fit_the_terminal_width(cli):
    result = cli("masks", "--preset", "gpt2-small", "--tgt-lens", "30", env={"COLUMNS": "60",
                                                                          "NO_COLOR": "1"})
    assert result.exit_code == 0
    grid_lines = [line for line in result.stdout.splitlines() if line.lstrip()[:1].isdigit()]
    assert grid_lines and max(len(line) for line in grid_lines) <= 60
    assert any("…" in line for line in grid_lines)
    # wide enough, the same 30 positions are drawn whole
    wide = cli("masks", "--preset", "gpt2-small", "--tgt-lens", "30", env={"COLUMNS": "200"})
    assert "…" not in wide.stdout


def test_max_memory_without_check_is_refused(cli):
    result = cli("masks", "--preset", "tiny", "--max-memory", "1GB")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0 and "--max-memory bounds masks --check" \
        in result.stderr


def test_check_on_huge_lengths_keeps_its_memory_guard(cli):
    result = cli("masks", "--preset", "gpt2-small", "--set", "max_seq_len=1000000",
                 "--tgt-lens", "1000000", "--check")
    assert result.exit_code == 2 and "masks --check needs an estimated" in result.stderr


SDPA_MODEL = """
import torch
import torch.nn.functional as F


class M(torch.nn.Module):
    def forward(self, x, attention_mask):
        keep = attention_mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None],
                                              attn_mask=keep)[:, 0]
"""


def test_model_json_too_large_for_memory_is_refused_before_it_is_made(cli, tmp_path):
    """Issue 25: --json for --model holds every captured mask whole (it grew to 5.8 GB with
    no guard). 2 × 1000 × 1000 cells make about 220 MB of lists and text: refused in one line
    under a 100 MB limit that the run itself fits in, with nothing on stdout."""
    (tmp_path / "m.py").write_text(SDPA_MODEL)
    args = ["masks", "--model", f"{tmp_path}/m.py:M", "--input", "x=float32[B,L,4]",
            "--input", "attention_mask=int64[B,L]", "--json", "--max-memory", "100MB"]
    refused = cli(*args, "--lengths", "x=1000,600")
    assert refused.exit_code == 2 and refused.stdout == ""
    assert refused.stderr.startswith("tfcli: error: masks --json needs an estimated")
    assert "2,000,000 mask cells" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert cli(*args, "--lengths", "x=100,60").exit_code == 0  # 20,000 cells: 2.2 MB
