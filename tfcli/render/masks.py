"""Mask grids (rows = queries, columns = keys) in a chosen convention, and the check report."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from tfcli.inspection.maskcheck import NamedMask
from tfcli.inspection.maskgrid import Grid

CELLS = {  # convention -> (text where attending is allowed, text where it is blocked)
    "bool-allowed": ("T", "F"),
    "bool-blocked": ("F", "T"),
    "keep-01": ("1", "0"),
    "additive": ("0", "-∞"),
}
ALLOWED, BLOCKED = "blue", "bright_black"  # not green/red: legible to colour-blind readers
HEADERS = {  # convention -> who uses it, said above every grid drawn in it
    "bool-allowed": "SDPA's attn_mask, tfcli's own",
    "bool-blocked": "nn.MultiheadAttention's attn_mask and key_padding_mask",
    "keep-01": "tutorials' scores.masked_fill(mask == 0, -1e9)",
    "additive": "a float mask added to the scores",
}
EMPTY_ROW = {  # convention -> what a query row with no allowed key becomes (tests/test_render.py)
    "bool-allowed": "no allowed key: SDPA (torch 2.13) and tfcli give zeros",
    "bool-blocked": "no allowed key: nn.MultiheadAttention gives NaN, tfcli zeros",
    "keep-01": "no allowed key: -1e9 → equal weights on all keys; -inf → NaN; tfcli → zeros",
    "additive": "no allowed key: softmax of all -inf is NaN; tfcli gives zeros",
}


def _indices(n: int, limit: int) -> list[int | None]:
    """Positions to show; None marks an elided run."""
    if n <= limit:
        return list(range(n))
    head = limit - limit // 3
    return [*range(head), None, *range(n - (limit - head), n)]


def _draw(q_len: int, k_len: int, rows: list[int | None], cols: list[int | None], cell,
          q_pad, k_pad, empty, convention: str) -> Text:
    """The grid at ``rows`` x ``cols`` (None: an elided run); ``cell(q, k)``, ``q_pad(q)``,
    ``k_pad(k)`` and ``empty(q)`` (no allowed key in the whole row) answer for shown positions."""
    yes, no = CELLS[convention]
    width = _cell_width(convention, k_len)
    label = _label_width(q_len)
    text = Text()
    text.append(" " * (label + 1))
    for k in cols:
        if k is None:
            text.append("…".rjust(width + 1))
        else:
            pad = k_pad(k)
            text.append(f"{k}{'*' if pad else ''}".rjust(width + 1), style="dim" if pad else "")
    text.append("\n")
    for q in rows:
        if q is None:
            text.append("⋮".rjust(label) + "\n")
            continue
        pad = q_pad(q)
        text.append(f"{q}{'*' if pad else ''}".rjust(label) + " ", style="dim" if pad else "")
        for k in cols:
            if k is None:
                text.append("…".rjust(width + 1))
                continue
            ok = cell(q, k)
            text.append((yes if ok else no).rjust(width + 1), style=ALLOWED if ok else BLOCKED)
        if empty(q):
            text.append(f"   {EMPTY_ROW[convention]}", style="bold")
        text.append("\n")
    return text


def _cell_width(convention: str, k_len: int) -> int:
    yes, no = CELLS[convention]
    return max(len(yes), len(no), len(str(k_len - 1)) + 1)


def _label_width(q_len: int) -> int:
    return max(len(str(q_len - 1)) + 1, 4)


def fitting_limit(q_len: int, k_len: int, convention: str, limit: int, width: int) -> int:
    """Positions per side to show: at most ``limit``, and no more columns than ``width``
    holds (head, "…" and tail), but never fewer than 4; rows follow the columns, so a
    self-attention grid shows the same positions down as across."""
    per = _cell_width(convention, k_len) + 1
    room = (width - _label_width(q_len) - 1) // per
    if k_len <= min(limit, room):
        return limit
    return max(4, min(limit, room - 1))  # one column goes to the "…"


def grid(named: NamedMask, allowed, q_valid, k_valid, batch: int, convention: str,
         limit: int) -> Text:
    """``allowed`` [B, Q, K] bool; ``q_valid`` / ``k_valid`` [B, Q] / [B, K] bool."""
    q_len, k_len = allowed.shape[1:]
    return _draw(q_len, k_len, _indices(q_len, limit), _indices(k_len, limit),
                 lambda q, k: bool(allowed[batch, q, k]), lambda q: not q_valid[batch, q],
                 lambda k: not k_valid[batch, k], lambda q: not allowed[batch, q].any(),
                 convention)


def shown_grid(g: Grid, batch: int, convention: str, limit: int, width: int) -> Text:
    """A :class:`Grid` (cells computed at its shown positions only), narrowed to ``width``."""
    limit = fitting_limit(g.q_len, g.k_len, convention, limit, width)
    row_at = {q: i for i, q in enumerate(g.rows)}
    col_at = {k: j for j, k in enumerate(g.cols)}
    # Narrowing keeps a head and a tail no longer than the computed ones (limit <= theirs).
    rows, cols = _indices(g.q_len, limit), _indices(g.k_len, limit)
    assert all(q in row_at for q in rows if q is not None), "rows outside the computed grid"
    assert all(k in col_at for k in cols if k is not None), "columns outside the computed grid"
    return _draw(g.q_len, g.k_len, rows, cols,
                 lambda q, k: bool(g.allowed[batch, row_at[q], col_at[k]]),
                 lambda q: not g.row_valid[batch, row_at[q]],
                 lambda k: not g.col_valid[batch, col_at[k]],
                 lambda q: not g.row_has_key[batch, row_at[q]], convention)


def _stored(shape: list[int], convention: str) -> str:
    how = ("bool, True = may attend" if convention == "bool-allowed"
           else "tfcli's bool-allowed, converted below")
    return f"stored {shape} ({how})"


def mha_shape(shape: list[int], q: str, k: str, q_len: int, k_len: int, batch_size: int,
              n_heads: int) -> str:
    """How nn.MultiheadAttention takes this mask: 2-D or 3-D [B·h, T, S], never 4-D."""
    per_batch = f"attn_mask [B·h, {q}, {k}] = [{batch_size * n_heads}, {q_len}, {k_len}]"
    if shape[0] == 1:  # the same for every sequence: one 2-D mask serves
        return f"nn.MultiheadAttention: attn_mask [{q}, {k}] = [{q_len}, {k_len}] (2-D)"
    if shape[2] == 1:  # padding only: one row per sequence
        return (f"nn.MultiheadAttention: key_padding_mask [B, {k}] = [{batch_size}, {k_len}] "
                f"(True = padding)\n                    or {per_batch}")
    return f"nn.MultiheadAttention: {per_batch} (3-D, a copy per head)"


def render_masks(grids: list[Grid], batch: int, batch_size: int, n_heads: int,
                 convention: str, limit: int, console: Console) -> None:
    console.soft_wrap = True  # a re-wrapped grid row is unreadable: leave long lines to the pager
    yes, no = CELLS[convention]
    console.print(Text(f"convention {convention}: {yes} = may attend, {no} = blocked "
                       f"({HEADERS[convention]})\nrows are queries, columns keys; * marks padding",
                       style="bold"), soft_wrap=False)
    for g in grids:
        named, q_len, k_len = g.mask, g.q_len, g.k_len
        shape = named.stored_shape(batch_size, q_len, k_len)
        console.print()
        role = "" if named.used_by_model else "  [a component of the next mask]"
        console.print(Text(f"{named.name}: {named.description}{role}", style="bold"),
                      soft_wrap=False)
        q = "T" if named.query_side == "tgt" else "S"
        k = "T" if named.key_side == "tgt" else "S"
        console.print(f"{_stored(shape, convention)} → scores [B, h, {q}, {k}] = "
                      f"[{batch_size}, {n_heads}, {q_len}, {k_len}]", soft_wrap=False)
        if convention == "bool-blocked":
            console.print(mha_shape(shape, q, k, q_len, k_len, batch_size, n_heads),
                          soft_wrap=False)
        console.print(f"batch element {batch}: {g.real_queries[batch]} real queries, "
                      f"{g.real_keys[batch]} real keys; cells in {convention}")
        console.print(shown_grid(g, batch, convention, limit, console.width), end="")


def render_seen(seen, batch: int, convention: str, limit: int, console: Console) -> None:
    """The masks a model applied, as captured at its softmax or SDPA calls (head 0)."""
    import torch

    console.soft_wrap = True
    yes, no = CELLS[convention]
    console.print(Text(f"convention {convention}: {yes} = may attend, {no} = blocked "
                       f"({HEADERS[convention]})\nrows are queries, columns keys; as each "
                       f"attention call applied it (head 0)", style="bold"), soft_wrap=False)
    shown: set = set()
    for a in seen:
        if a.allowed is None:
            continue
        grid_key = (tuple(a.scores), tuple(a.allowed[batch].flatten().tolist()))
        if grid_key in shown:  # the same mask in every layer: draw it once
            continue
        shown.add(grid_key)
        console.print()
        console.print(Text(f"{a.path or '(model)'}: {a.how}, scores {a.scores}", style="bold"))
        q_valid = torch.ones(a.allowed.shape[:2], dtype=torch.bool)
        k_valid = torch.ones(a.allowed.shape[0], a.allowed.shape[2], dtype=torch.bool)
        console.print(grid(None, a.allowed, q_valid, k_valid, batch, convention, limit), end="")
    if not shown:
        console.print("no attention call with a mask was seen (unmasked attention, or attention "
                      "inside a single torch function such as nn.MultiheadAttention)")


def render_verdict(verdict, console: Console) -> None:
    """The checks of tfcli.inspection.verdict, one line each, and the verdict last."""
    console.soft_wrap = True
    mark = {"passed": "✓", "failed": "✗", "not checked": "–"}
    console.print()
    console.print(Text("check: the model on this batch — causality at every position, padding, "
                       "and every attention call's weights against the asserted pattern",
                       style="bold"))
    if verdict.masks:
        console.print("mask arguments, built from the lengths and causality asked for:")
        for m in verdict.masks:
            console.print(f"  {m.name} {m.layout()} {str(m.dtype)[6:]}: {m.convention} — {m.how}")
    for c in verdict.checks:
        console.print(f"  {mark[c.status]} {c.name}: "
                      + (f"not checked: {c.detail}" if c.status == "not checked" else c.detail))
    for note in verdict.notes:
        console.print(f"note: {note}")
    style = {"passed": "bold green", "failed": "bold red"}.get(verdict.status, "bold yellow")
    console.print(Text(verdict.headline(), style=style))
