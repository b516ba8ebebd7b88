"""`tfcli masks`: what each position may attend to, in every convention, checked on the model."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from tfcli.cli.options import (SUBJECT_RULES, AttnImplementation, ConfigOpt, DimOpt, AttnImplOpt, HfClassOpt, InputOpt, JsonOpt, MaxMemoryOpt,
                               ModelArgOpt, ModelOpt, PresetOpt, SetOpt, int_list, resolve_subject,
                               sizes)
from tfcli.cli.outputs import AtomicFile, Output, check_outputs
from tfcli.cli.process import print_json, stdout
from tfcli.cli.rules import Needs, Rule, Rules, any_model, own_model
from tfcli.errors import TfcliError
from tfcli.guard import guard_run, parse_size, require

DEFAULT_LENS = {"src": [4, 6], "tgt": [3, 5]}  # element 0 padded on both sides
WHOLE = 512  # --json and --png hold every cell up to this many positions a side
JSON_BYTES_PER_CELL = 110  # a mask cell in --json for --model: a list item, then text


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


def _names(texts: list[str] | None) -> set[str]:
    """The input names of NAME=... options (--mask, --lengths)."""
    return {text.partition("=")[0].strip() for text in texts or []}


RULES = Rules(
    SUBJECT_RULES,
    Rule("batch_index", Needs(
        lambda v: not v.json_out or v.png is not None, "not with --json alone",
        "{option} {value} picks the sequence drawn; --json holds every sequence (use it with "
        "the table, or --png for tfcli's own model)")),
    Rule(("src_lens", "tgt_lens", "src_ids", "tgt_ids"), own_model(
        "{option} describe tfcli's own model's batch; for --model use --lengths "
        "NAME=N,N and --pad-id")),
    Rule("src_ids", Needs(lambda v: not v.typed("src_lens"), "not with --src-lens",
                          "--src-lens and {option}: give one or the other")),
    Rule("tgt_ids", Needs(lambda v: not v.typed("tgt_lens"), "not with --tgt-lens",
                          "--tgt-lens and {option}: give one or the other")),
    Rule("causal", Needs(
        lambda v: v.check or v.model_ref is None, "only with --check",
        "names what --check verifies; add --check (without it the masks the model applied are "
        "drawn as they are)")),
    Rule(("causal", "lengths", "mask", "window", "dim"), any_model(
        "{option}: only for --model; tfcli's own model takes --src-lens/--tgt-lens or "
        "--src-ids/--tgt-ids (and --set attention_window=W)")),
    Rule(("convention", "max_grid"), Needs(
        lambda v: not (v.json_out and v.model_ref is not None), "not with --json for --model",
        "{option}: shape the drawn grids; --json for --model holds each captured mask whole, "
        "as booleans")),
    Rule("png", own_model(
        "draws the grids of tfcli's own model; for --model the masks each "
        "attention call applied are shown in the table and --json, not drawn into a "
        "PNG yet")),
    Rule("pad_id", Needs(
        lambda v: v.model_ref is not None or v.src_ids is not None or v.tgt_ids is not None,
        "only with --src-ids/--tgt-ids or --model",
        "marks padding in --src-ids/--tgt-ids; give ids, or use --src-lens/--tgt-lens"),
         Needs(lambda v: v.model_ref is None or v.lengths or v.causal,
               "with --model: only with --lengths or --causal",
               "pads the sequences --lengths describes (and keeps the tokens --causal's check "
               "changes off it); add --lengths NAME=N,N or --causal NAME")),
    Rule("mask", Needs(lambda v: not v.mask_and_lengths,
                       "not for an input --lengths names",
                       "{option} {value}: --lengths names {v.mask_and_lengths} as a sequence, not "
                       "a mask argument; give it to one of them")),
    Rule("max_memory", Needs(
        lambda v: v.check or v.model_ref is not None, "only with --check or --model",
        "bounds masks --check; drawing the grids costs the same at any length")),
    derived={"mask_and_lengths": lambda v: ", ".join(sorted(_names(v.mask)
                                                             & _names(v.lengths)))},
)


def masks(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    model_ref: ModelOpt = None, model_arg: ModelArgOpt = None, hf_class: HfClassOpt = None,
    attn_implementation: AttnImplOpt = AttnImplementation.auto,
    input_: InputOpt = None, dim: DimOpt = None,
    causal: Annotated[Optional[list[str]], typer.Option(
        "--causal", metavar="NAME", show_default=False,
        help="--model: input NAME must be causal (changing its later tokens leaves earlier "
             "outputs unchanged). Repeatable.")] = None,
    lengths: Annotated[Optional[list[str]], typer.Option(
        "--lengths", metavar="NAME=N,N,…", show_default=False,
        help="--model: real length per sequence of input NAME; later positions become "
             "--pad-id, and every mask argument is built from these lengths. Repeatable.")
    ] = None,
    window: Annotated[Optional[list[str]], typer.Option(
        "--window", metavar="NAME=W", show_default=False,
        help="--model: attention over sequence NAME keeps to a sliding window of W positions "
             "(causal: the W - 1 before and itself; else W - 1 either side); mask arguments "
             "are built with it and each attention call is checked against it. "
             "Repeatable.")] = None,
    mask: Annotated[Optional[list[str]], typer.Option(
        "--mask", metavar="NAME=CONVENTION", show_default=False,
        help="--model: the convention of mask argument NAME: bool-allowed, bool-blocked, "
             "keep-01 or additive. Without it tfcli uses the documented convention of a known "
             "name (*_key_padding_mask, attention_mask) or probes, and says which. "
             "Repeatable.")] = None,
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
    pad_id: Annotated[Optional[int], typer.Option(
        show_default=False,
        help="Padding token id for --src-ids/--tgt-ids (default 0) and --lengths.")] = None,
    batch_index: Annotated[int, typer.Option(min=0, help="Which sequence to draw.")] = 0,
    convention: Annotated[Convention, typer.Option(
        help="bool-allowed (SDPA), bool-blocked (nn.MultiheadAttention), keep-01 (tutorials' "
             "masked_fill(mask == 0, -1e9)) or additive (0 / -inf).")] = Convention.bool_allowed,
    check: Annotated[bool, typer.Option(
        "--check", help="Run the model's attention on the batch and verify it obeys the masks "
                        "(exit code 1 if not).")] = False,
    max_grid: Annotated[int, typer.Option(
        min=4, max=512, help="Positions drawn a side at most (fewer if the terminal is narrower): the "
                    "first and last, with … between. --json and --png hold every cell up to "
                    "512 a side, beyond that this many.")] = 32,
    png: Annotated[Optional[Path], typer.Option(
        metavar="FILE", show_default=False,
        help="Also draw the grids into a PNG (needs the 'plot' extra: matplotlib).")] = None,
    max_memory: MaxMemoryOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Padding, causal, combined and cross-attention masks for an example batch."""
    RULES.apply(locals())
    check_outputs(Output(png, "--png", ".png"))
    subject = resolve_subject(preset, config, set_, model_ref, model_arg, hf_class, input_,
                              attn_implementation)  # first: it may speak before torch loads
    import torch

    from tfcli.inspection.maskcheck import mask_rules
    from tfcli.inspection.maskgrid import Padding, shown_cells
    from tfcli.model import masks as mask_fns
    from tfcli.render.masks import render_masks, render_verdict

    if getattr(subject, "cfg", None) is None:
        _masks_any(subject, causal or [], lengths or [], pad_id, dim, batch_index, convention,
                   check, max_grid, json_out, max_memory, mask, window)
        return
    pad_id = 0 if pad_id is None else pad_id
    cfg = subject.cfg
    sides_present = [s for s, present in (("src", cfg.has_encoder), ("tgt", cfg.has_decoder))
                     if present]
    by_side = {"src": (src_lens, src_ids), "tgt": (tgt_lens, tgt_ids)}
    for side in ("src", "tgt"):
        lens, ids = by_side[side]
        if side not in sides_present and (lens is not None or ids is not None):
            raise TfcliError(f"--{side}-{'lens' if lens is not None else 'ids'}: this "
                             f"{cfg.kind} model has no "
                             f"{'source' if side == 'src' else 'target'} side")

    sides: dict[str, Padding] = {}
    ids_given: dict[str, torch.Tensor] = {}
    for side in sides_present:
        lens, ids = by_side[side]
        if ids is not None:
            vocab = cfg.src_vocab_size if side == "src" else cfg.tgt_vocab_size
            rows = _parse_ids(ids, f"--{side}-ids")
            bad = next((i for row in rows for i in row if not 0 <= i < vocab), None)
            if bad is not None or not 0 <= pad_id < max(vocab, 1):
                raise TfcliError(
                    f"--{side}-ids: this model takes embeddings, not token ids" if not vocab
                    else f"--{side}-ids/--pad-id: token id {pad_id if bad is None else bad} is "
                         f"outside the vocabulary; ids must be in 0..{vocab - 1}")
            ids_given[side] = torch.tensor(rows)
            valid = mask_fns.valid_from_ids(ids_given[side], pad_id)
            sides[side] = Padding(valid.size(1), valid=valid)
        elif lens is not None:
            real = int_list(lens, f"--{side}-lens", "5,3")
            sides[side] = Padding(max(real), lengths=tuple(real))  # no [B, L] vector
    batch = {p.batch for p in sides.values()}
    if len(batch) > 1:
        raise TfcliError(f"source and target batches differ in size ({' vs '.join(map(str, batch))}"
                         "): give one length (or id row) per sequence on both sides")
    batch_size = batch.pop() if batch else len(DEFAULT_LENS["src"])
    any_given = any(v is not None for pair in by_side.values() for v in pair)
    for side in sides_present:
        if side not in sides:
            # Nothing given: the defaults. One side given: no padding on the other.
            default = DEFAULT_LENS[side] if not any_given else [max(DEFAULT_LENS[side])] * batch_size
            sides[side] = Padding(max(default), lengths=tuple(default))
        length = sides[side].length
        if length == 0 or length > cfg.max_seq_len:
            raise TfcliError(f"--{side}-lens: padded length {length} must be in "
                             f"1..max_seq_len={cfg.max_seq_len}")
    if batch_index >= batch_size:
        raise TfcliError(f"--batch-index {batch_index}: the batch has {batch_size} sequences "
                         f"(0..{batch_size - 1})")

    # Drawing computes only the cells shown (see tfcli.inspection.maskgrid); --check runs the
    # model and builds every mask whole (B x queries x keys, an expanded and a converted copy).
    lens = {side: p.length for side, p in sides.items()}
    report = None
    if check:
        from tfcli.inspection.verdict import GROW, check as run_check, make_plan
        from tfcli.model.transformer import build_model, example_inputs
        from tfcli.render.progress import working
        from tfcli.subjects.base import Inputs
        from tfcli.subjects.own import OwnSubject

        longest = max(lens.values())
        naive = cfg.replace(attention="naive")  # its weights are the model's own, no recompute
        # Its largest run: lengths kept apart (a few more padded positions) and GROW more.
        room = 4 + GROW
        guard_run(OwnSubject(naive), {"B": batch_size, "S": lens.get("src", 1) + room,
                                      "T": lens.get("tgt", 1) + room},
                  "masks --check", max_memory,
                  extra=(6 * batch_size * (longest + room)**2 * 6, "mask grids"),
                  run="observed")
        with working("building the model on cpu") as say:  # on stderr, at a terminal only
            torch.manual_seed(0)
            model = build_model(naive)
            example = example_inputs(cfg, batch_size, lens.get("src", 1), lens.get("tgt", 1))
            kwargs = {k: ids_given.get(k, v) for k, v in example.items() if v is not None}
            valid = {side: sides[side].whole() for side in sides}
            taken = {batch_size, cfg.n_heads, cfg.kv_heads}
            for side in valid:
                # More padded positions until the lengths differ from each other, from the
                # batch and from the head counts: the check tells attention calls, their
                # query axes and the output's axes apart by size.
                while valid[side].size(1) in taken or any(
                        valid[side].size(1) == valid[other].size(1)
                        for other in valid if other < side):
                    kwargs[side] = torch.cat([kwargs[side], kwargs[side][:, -1:]], 1)
                    valid[side] = torch.cat([valid[side], torch.zeros(batch_size, 1,
                                                                      dtype=torch.bool)], 1)
            kwargs.update({f"{side}_valid": v for side, v in valid.items()})
            vocabs = [v for v in (cfg.src_vocab_size, cfg.tgt_vocab_size) if v]
            plan = make_plan(OwnSubject(naive), model, Inputs((), kwargs), valid, [], {},
                             pad_id, min(vocabs) if vocabs else 2)
            report = run_check(model, plan, say)

    named = mask_rules(cfg)
    # JSON and the PNG hold every cell up to WHOLE positions a side; the terminal shows
    # --max-grid at most (fewer where its width is less).
    whole = {side: n if n <= WHOLE else max_grid for side, n in lens.items()}
    if png is not None:
        from tfcli.render.masks_png import save_png

        out = AtomicFile(png)  # an existing PNG survives a failed drawing
        try:
            save_png(shown_cells(named, sides, whole), batch_index, out.temp)
            out.commit()
        except BaseException:
            out.discard()
            raise
    if json_out:
        print_json(_to_json(cfg, shown_cells(named, sides, whole), sides, whole, batch_size,
                            convention.value, report))
    else:
        console = stdout()
        grids = shown_cells(named, sides, {side: max_grid for side in sides})
        render_masks(grids, batch_index, batch_size, cfg.n_heads, convention.value, max_grid,
                     console)
        if report is not None:
            render_verdict(report, console)
        if png is not None:
            console.print(f"\nwrote {png}")
    if report is not None and report.exit_code:
        raise typer.Exit(report.exit_code)


masks.rules = RULES


def _to_json(cfg, grids, sides, limits, batch_size, convention, report) -> dict:
    """As the grids' cells: every cell up to WHOLE positions a side; beyond, the shown ones,
    with the positions they stand for."""
    import torch

    from tfcli.inspection.maskgrid import shown_positions
    from tfcli.model.masks import to_convention

    def values(allowed):
        converted = to_convention(allowed, convention).tolist()
        if convention != "additive":
            return converted
        return [[[("-inf" if v == float("-inf") else v) for v in row] for row in grid]
                for grid in converted]

    elided = any(g.elided for g in grids)
    positions = {side: shown_positions(p.length, limits[side]) for side, p in sides.items()}
    masks = []
    for g in grids:
        m = g.mask
        entry = {
            "key": m.key, "name": m.name, "description": m.description,
            "shape": m.stored_shape(batch_size, g.q_len, g.k_len),
            "broadcast_shape": [batch_size, cfg.n_heads, g.q_len, g.k_len],
            "used_by_model": m.used_by_model, "allowed": g.allowed.tolist(),
            "convention": convention, "values": values(g.allowed),
        }
        if elided:
            entry.update(query_positions=g.rows, key_positions=g.cols)
        masks.append(entry)
    out = {
        "kind": cfg.kind,
        "valid": {side: p.at(torch.tensor(positions[side], dtype=torch.int64)).tolist()
                  for side, p in sides.items()},
        "masks": masks,
        "elided": elided,
    }
    if elided:  # which positions "valid" and each grid's rows and columns stand for
        out["positions"] = positions
    if report is not None:
        out["check"] = report.to_dict()
    return out


def _masks_any(subject, causal: list[str], lengths_text: list[str], pad_id: int | None,
               dim: list[str] | None, batch_index: int, convention: Convention, check: bool,
               max_grid: int, json_out: bool, max_memory: str | None = None,
               mask_text: list[str] | None = None, window_text: list[str] | None = None) -> None:
    """Any model: the masks its attention calls applied, and with --check the verdict of
    tfcli.inspection.verdict (the same checks for every subject)."""
    import torch

    from tfcli.inspection.maskargs import parse_mask_option
    from tfcli.inspection.verdict import GROW, check as run_check, drawn, make_plan, observe_plan
    from tfcli.render.masks import render_seen, render_verdict
    from tfcli.render.progress import working
    from tfcli.subjects.base import embedding_limit

    lengths: dict[str, list[int]] = {}
    for text in lengths_text:
        name, sep, values = text.partition("=")
        if not sep or not name.strip().isidentifier():
            raise TfcliError(f"--lengths {text!r}: expected NAME=N,N,… e.g. --lengths src=5,3")
        if name.strip() in lengths:
            raise TfcliError(f"--lengths {name.strip()} is given twice; give it once")
        lengths[name.strip()] = int_list(values, f"--lengths {name.strip()}=", "5,3")
    mask_options: dict[str, str] = {}
    for text in mask_text or []:
        name, value = parse_mask_option(text)
        if name in mask_options:
            raise TfcliError(f"--mask {name} is given twice; give it once")
        mask_options[name] = value
    windows: dict[str, int] = {}
    for text in window_text or []:
        name, sep, value = text.partition("=")
        # ASCII digits (isdigit() passes "²", which int() refuses), no more than 2**31 - 1 has
        if not sep or not name.strip().isidentifier() \
                or not re.fullmatch(r"[0-9]{1,10}", value.strip()) \
                or not 0 < int(value) <= 2**31 - 1:
            raise TfcliError(f"--window {text[:100]!r}: expected NAME=W with W a positive number "
                             f"of positions, e.g. --window ids=4")
        if name.strip() in windows:
            raise TfcliError(f"--window {name.strip()} is given twice; give it once")
        windows[name.strip()] = int(value)
    batches = {len(v) for v in lengths.values()}
    if len(batches) > 1:
        raise TfcliError("--lengths: give the same number of sequences for every input")
    if pad_id is not None and not 0 <= pad_id <= 2**63 - 1:  # ids are int64 tensors
        raise TfcliError(f"--pad-id {pad_id}: a token id is from 0 to {2**63 - 1:,} (int64)")
    dims = sizes(subject, batches.pop() if batches else 2, 9, 7, dim)
    bound = {text.partition("=")[0].strip() for text in dim or []}
    padded = set()
    for name, lens in lengths.items():
        for letter in _letters_of(subject, name):
            if letter not in bound:  # padded to the longest, unless --dim says how far
                dims[letter] = max(max(lens), 1)
                padded.add(letter)
    # Lengths no mask reaches (an image's patches) are told apart from padded ones too.
    unmasked = subject.unmasked_lengths(dims)
    _apart(dims, padded, set(subject.length_dims()), {n for n, _, _ in unmasked.values()})
    # The largest run the check makes: the padding-length check adds GROW positions.
    longest = {k: n + (GROW if k in padded else 0) for k, n in dims.items()}
    guard_run(subject, longest, "masks --model (built on cpu)", max_memory, run="observed")

    torch.manual_seed(0)
    with working("building the model on cpu") as say:  # on stderr, at a terminal only
        model = subject.build("cpu").eval()
        inputs = subject.make_inputs(model, dims, "cpu")
        plan = make_plan(subject, model, inputs, lengths, causal, mask_options, pad_id,
                         embedding_limit(model), windows, unmasked)
        if batch_index >= plan.batch:
            raise TfcliError(f"--batch-index {batch_index}: the batch has {plan.batch} "
                             f"sequences (0..{plan.batch - 1})")
        if check:
            verdict = run_check(model, plan, say)
            seen = verdict.seen
        else:
            verdict, seen = None, observe_plan(model, plan, say)
    shown = drawn(seen)
    if json_out:
        # Every captured mask whole, as nested lists and then JSON text: about 100 bytes per
        # cell at the peak (measured with tracemalloc on a [2, 300, 300] mask), which lengths
        # in the tens of thousands turn into gigabytes.
        cells = sum(d.allowed.numel() for d in shown if d.allowed is not None)
        require(JSON_BYTES_PER_CELL * cells, "masks --json", parse_size(max_memory)
                if max_memory is not None else None, "cpu",
                f"{cells:,} mask cells, each written whole, about {JSON_BYTES_PER_CELL} B "
                f"apiece while the JSON is made; without --json the table elides them")
        out = {"subject": subject.describe(), "seen": [d.to_dict() for d in shown]}
        if verdict is not None:
            out["check"] = verdict.to_dict()
        else:
            out["masks"] = [m.to_dict() for m in plan.masks]
        print_json(out)
    else:
        console = stdout()
        render_seen(shown, batch_index, convention.value, max_grid, console)
        if verdict is not None:
            render_verdict(verdict, console)
    if verdict is not None and verdict.exit_code:
        raise typer.Exit(verdict.exit_code)


def _apart(dims: dict[str, int], padded: set[str], used: set[str],
           others: set[int] = frozenset()) -> None:
    """Give each padded length letter a size no other length letter in use has, nor the
    batch, nor ``others`` (lengths no input has): the check tells attention calls apart by
    their query and key lengths, and an output's axes by their sizes (more padding changes
    nothing)."""
    for letter in sorted(padded):
        while dims[letter] in others or any(n == dims[letter] for k, n in dims.items()
                                            if k != letter and (k in used or k == "B")):
            dims[letter] += 1


def _letters_of(subject, name: str) -> list[str]:
    """The length letter(s) of input ``name`` (dimension 1 of its --input spec)."""
    dims = subject.input_dims(name) or ()
    return [d for d in dims if isinstance(d, str) and d != "B"][:1]
