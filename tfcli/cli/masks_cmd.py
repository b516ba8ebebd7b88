"""`tfcli masks`: what each position may attend to, in every convention, checked on the model."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tfcli.cli._common import (ConfigOpt, JsonOpt, PresetOpt, SetOpt, int_list, print_json,
                               resolve_config, stdout)
from tfcli.errors import TfcliError

DEFAULT_LENS = {"src": [4, 6], "tgt": [3, 5]}  # element 0 padded on both sides


class Convention(str, Enum):
    bool_allowed = "bool-allowed"
    bool_blocked = "bool-blocked"
    keep_01 = "keep-01"
    additive = "additive"


def _parse_ids(text: str, option: str) -> list[list[int]]:
    try:
        rows = [[int(tok) for tok in row.replace(",", " ").split()] for row in text.split(";")]
    except ValueError:
        rows = []
    if not rows or not rows[0] or len({len(r) for r in rows}) != 1:
        raise TfcliError(f"{option} {text!r}: expected equal-length sequences of token ids "
                         f"separated by ';', e.g. {option} '5,6,0;7,0,0'")
    return rows


def masks(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    src_lens: Annotated[Optional[str], typer.Option(
        metavar="N,N,…", show_default=False,
        help="Source lengths per sequence, padded to the longest (default 4,6).")] = None,
    tgt_lens: Annotated[Optional[str], typer.Option(
        metavar="N,N,…", show_default=False,
        help="Target lengths per sequence, padded to the longest (default 3,5).")] = None,
    src_ids: Annotated[Optional[str], typer.Option(
        metavar="IDS;IDS", show_default=False,
        help="Source token ids instead of lengths, e.g. '5,6,0;7,0,0' (padding = --pad-id).")
    ] = None,
    tgt_ids: Annotated[Optional[str], typer.Option(
        metavar="IDS;IDS", show_default=False, help="Target token ids instead of lengths.")
    ] = None,
    pad_id: Annotated[int, typer.Option(help="Padding token id for --src-ids/--tgt-ids.")] = 0,
    batch_index: Annotated[int, typer.Option(min=0, help="Which sequence to draw.")] = 0,
    convention: Annotated[Convention, typer.Option(
        help="bool-allowed (SDPA), bool-blocked (nn.MultiheadAttention), keep-01 (tutorials' "
             "masked_fill(mask == 0, -inf)) or additive (0 / -inf).")] = Convention.bool_allowed,
    check: Annotated[bool, typer.Option(
        "--check", help="Run the model's attention on the batch and verify it obeys the masks "
                        "(exit code 1 if not).")] = False,
    max_grid: Annotated[int, typer.Option(min=4, help="Elide grids larger than this.")] = 32,
    png: Annotated[Optional[Path], typer.Option(
        metavar="FILE", show_default=False,
        help="Also draw the grids into a PNG (needs the 'plot' extra: matplotlib).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Padding, causal, combined and cross-attention masks for an example batch."""
    import torch

    from tfcli.model import masks as mask_fns
    from tfcli.inspection.maskcheck import check_model, mask_set
    from tfcli.model.transformer import build_model
    from tfcli.render.masks import render_check, render_masks

    cfg = resolve_config(preset, config, set_)
    sides = [s for s, present in (("src", cfg.has_encoder), ("tgt", cfg.has_decoder)) if present]
    given = {"src": (src_lens, src_ids), "tgt": (tgt_lens, tgt_ids)}
    for side in ("src", "tgt"):
        lens, ids = given[side]
        if lens is not None and ids is not None:
            raise TfcliError(f"--{side}-lens and --{side}-ids: give one or the other")
        if side not in sides and (lens is not None or ids is not None):
            raise TfcliError(f"--{side}-lens/--{side}-ids: this {cfg.kind} model has no "
                             f"{'source' if side == 'src' else 'target'} side")

    valid: dict[str, torch.Tensor] = {}
    ids_given: dict[str, torch.Tensor] = {}
    for side in sides:
        lens, ids = given[side]
        if ids is not None:
            ids_given[side] = torch.tensor(_parse_ids(ids, f"--{side}-ids"))
            valid[side] = mask_fns.valid_from_ids(ids_given[side], pad_id)
        elif lens is not None:
            valid[side] = mask_fns.valid_from_lengths(int_list(lens, f"--{side}-lens", "5,3"))
    batch = {v.size(0) for v in valid.values()}
    if len(batch) > 1:
        raise TfcliError(f"source and target batches differ in size ({' vs '.join(map(str, batch))}"
                         "): give one length (or id row) per sequence on both sides")
    batch_size = batch.pop() if batch else len(DEFAULT_LENS["src"])
    any_given = any(v is not None for pair in given.values() for v in pair)
    for side in sides:
        if side not in valid:
            # Nothing given: the defaults. One side given: no padding on the other.
            default = DEFAULT_LENS[side] if not any_given else [max(DEFAULT_LENS[side])] * batch_size
            valid[side] = mask_fns.valid_from_lengths(default)
        length = valid[side].size(1)
        if length == 0 or length > cfg.max_seq_len:
            raise TfcliError(f"--{side}-lens: padded length {length} must be in "
                             f"1..max_seq_len={cfg.max_seq_len}")
    if batch_index >= batch_size:
        raise TfcliError(f"--batch-index {batch_index}: the batch has {batch_size} sequences "
                         f"(0..{batch_size - 1})")

    src_valid, tgt_valid = valid.get("src"), valid.get("tgt")
    named = mask_set(cfg, src_valid, tgt_valid)
    items = []
    for m in named:
        q_valid, k_valid = valid[m.query_side], valid[m.key_side]
        allowed = m.expanded(batch_size, q_valid.size(1), k_valid.size(1))
        items.append((m, allowed, q_valid, k_valid))

    report = None
    if check:
        from tfcli.model.transformer import example_inputs

        torch.manual_seed(0)
        model = build_model(cfg.replace(attention="naive"))
        inputs = example_inputs(cfg, batch_size, valid["src"].size(1) if "src" in valid else 1,
                                valid["tgt"].size(1) if "tgt" in valid else 1)
        inputs = {k: ids_given.get(k, v) for k, v in inputs.items() if v is not None}
        report = check_model(model, cfg, inputs, src_valid, tgt_valid)

    if png is not None:
        from tfcli.render.masks_png import save_png

        save_png(items, batch_index, png)
    if json_out:
        print_json(_to_json(cfg, items, valid, convention.value, report))
    else:
        console = stdout()
        render_masks(items, batch_index, batch_size, cfg.n_heads, convention.value, max_grid,
                     console)
        if report is not None:
            render_check(report, console)
        if png is not None:
            console.print(f"\nwrote {png}")
    if report is not None and not report.passed:
        raise typer.Exit(1)


def _to_json(cfg, items, valid, convention, report) -> dict:
    from dataclasses import asdict

    from tfcli.model.masks import to_convention

    def values(allowed):
        converted = to_convention(allowed, convention).tolist()
        if convention != "additive":
            return converted
        return [[[("-inf" if v == float("-inf") else v) for v in row] for row in grid]
                for grid in converted]

    out = {
        "kind": cfg.kind,
        "valid": {side: v.tolist() for side, v in valid.items()},
        "masks": [{
            "key": m.key, "name": m.name, "description": m.description,
            "shape": list(m.mask.shape), "broadcast_shape": [allowed.size(0), cfg.n_heads,
                                                             *allowed.shape[1:]],
            "used_by_model": m.used_by_model, "allowed": allowed.tolist(),
            "convention": convention, "values": values(allowed),
        } for m, allowed, _, _ in items],
    }
    if report is not None:
        out["check"] = {**asdict(report), "passed": report.passed}
    return out
