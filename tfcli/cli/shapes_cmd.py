"""`tfcli shapes`: the shape of every tensor through every sublayer, with FLOPs."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from tfcli.cli.options import (SUBJECT_RULES, AttnImplementation, ConfigOpt, DimOpt, AttnImplOpt, HfClassOpt, InputOpt, JsonOpt, MaxMemoryOpt,
                               ModelArgOpt, ModelOpt, PresetOpt, SetOpt, given, int_list,
                               max_seq_len_hint, refuse_unused_sizes,
                               resolve_subject, sizes)
from tfcli.cli.process import print_json, stdout
from tfcli.cli.rules import Needs, Rule, Rules, own_model
from tfcli.errors import TfcliError
from tfcli.guard import guard_run, require, shortfall


class Device(str, Enum):
    meta = "meta"
    cpu = "cpu"
    cuda = "cuda"
    mps = "mps"


def _check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise TfcliError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if device == "mps" and not torch.backends.mps.is_available():
        raise TfcliError("--device mps: no MPS device here (torch.backends.mps.is_available() "
                         "is False)")


JSON_BYTES_PER_CALL = 8 * 1024  # a module call in --json, at the peak of making it


RULES = Rules(
    SUBJECT_RULES,
    Rule(("depth", "expand"), Needs(
        lambda v: not v.json_out, "not with --json",
        "{option}: shape the table; --json holds every module whole (drop {it}, or drop "
        "--json)")),
    Rule("causal_flops", own_model(
        "halves the attention tfcli's own configuration makes causal; for --model "
        "the FLOPs are counted as the model runs them")),
    Rule(("src_lens", "tgt_lens"), own_model(
        "{option} pad tfcli's own model; for --model, see `tfcli masks "
        "--lengths`")),
    Rule("max_memory", Needs(
        lambda v: v.device is not Device.meta, "only with --device cpu/cuda/mps",
        "bounds a real run; --device meta allocates nothing")),
)


def shapes(
    preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None,
    model_ref: ModelOpt = None, model_arg: ModelArgOpt = None, hf_class: HfClassOpt = None,
    attn_implementation: AttnImplOpt = AttnImplementation.auto,
    input_: InputOpt = None, dim: DimOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, help="B in the example batch.")] = 2,
    src_len: Annotated[int, typer.Option(min=1, help="S, the source length.")] = 9,
    tgt_len: Annotated[int, typer.Option(min=1, help="T, the target length.")] = 7,
    src_lens: Annotated[Optional[str], typer.Option(
        metavar="N,N,…", show_default=False,
        help="Pad the source: real length per sequence (one per batch element).")] = None,
    tgt_lens: Annotated[Optional[str], typer.Option(
        metavar="N,N,…", show_default=False,
        help="Pad the target: real length per sequence (one per batch element).")] = None,
    device: Annotated[Device, typer.Option(
        help="meta: shapes only, no weights, no arithmetic (instant for any size); cpu/cuda/"
             "mps: run for real.")] = Device.meta,
    depth: Annotated[int, typer.Option(min=0, help="Tree depth: 1 components, 2 layers, "
                                                   "3 sublayers, 4 inside attention.")] = 4,
    expand: Annotated[bool, typer.Option("--expand", help="Show every repeated layer.")] = False,
    backward: Annotated[bool, typer.Option(
        "--backward", help="Add backward FLOPs (2 × forward) and reconcile fwd+bwd.")] = False,
    causal_flops: Annotated[bool, typer.Option(
        "--causal-flops", help="Count only the useful half of causal attention.")] = False,
    max_memory: MaxMemoryOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Trace every tensor shape through every sublayer, with symbolic dimensions and FLOPs."""
    RULES.apply(locals())
    subject = resolve_subject(preset, config, set_, model_ref, model_arg, hf_class, input_,
                              attn_implementation)
    _check_device(device.value)
    refuse_unused_sizes(subject, {option: value for option, value, name in (
        ("--batch-size", batch_size, "batch_size"), ("--src-len", src_len, "src_len"),
        ("--tgt-len", tgt_len, "tgt_len")) if given(name)}, dim)
    dims = sizes(subject, batch_size, src_len, tgt_len, dim)
    cfg = getattr(subject, "cfg", None)
    if causal_flops and cfg is not None and not cfg.has_decoder:
        raise TfcliError(f"--causal-flops: this {cfg.kind} model has no causal attention to "
                         f"count half of")
    lengths = {"src": src_len, "tgt": tgt_len}
    if cfg is not None:
        for side, present in (("src", cfg.has_encoder), ("tgt", cfg.has_decoder)):
            if present and cfg.positional != "none" and lengths[side] > cfg.max_seq_len:
                raise TfcliError(f"--{side}-len {lengths[side]} exceeds max_seq_len="
                                 f"{cfg.max_seq_len}; {max_seq_len_hint(lengths[side])}")
    if device.value != "meta":  # estimated on fake tensors first: refused, not OOM-killed
        guard_run(subject, dims, f"shapes --device {device.value}", max_memory, device.value,
                  run="step" if backward else "forward")
    run_device, abstract = subject.abstract_run(device.value)
    args = (dims, src_lens, tgt_lens, lengths, batch_size, depth, expand, backward,
            causal_flops, json_out)
    try:
        with abstract:
            _trace_and_show(subject, run_device, device.value, *args,
                            may_fall_back=device.value == "meta" and not given("device"))
    except NotAbstract as failed:  # a CPU tensor made in forward, a value read: run it for real
        guard_run(subject, dims, "shapes (on cpu: the model does not run on meta)", max_memory,
                  run="step" if backward else "forward")
        _trace_and_show(subject, "cpu", "cpu", *args, fallback=(
            f"the forward pass cannot run without values ({failed}); traced on the CPU at "
            f"the same sizes instead"))


shapes.rules = RULES


class NotAbstract(Exception):
    """The forward pass failed on meta or fake tensors (a device mismatch, a data-dependent
    operation): a real run on the CPU gives the same shapes."""


def _trace_and_show(subject, run_device, device_name, dims, src_lens, tgt_lens, lengths,
                    batch_size, depth, expand, backward, causal_flops, json_out,
                    may_fall_back: bool = False, fallback: str | None = None) -> None:
    from tfcli.inspection import moe
    from tfcli.inspection.flops import CONVENTION, count_with_flop_counter, flop_counting
    from tfcli.inspection.shapes import (ForwardFailed, ambiguous, attention_length,
                                         infer_dims, reused_calls, symbolic, trace)
    from tfcli.model import masks
    from tfcli.render.shapes import build_tree, flops_text
    from tfcli.subjects.base import LEGEND, MODALITY_LETTERS, error_text, primary_output

    from tfcli.render.progress import working

    cfg = getattr(subject, "cfg", None)
    if device_name != "meta":
        subject.count_natively()  # torch's counter is the check: let it see every product
    with working(f"building the model on {device_name}"):  # on stderr, at a terminal only
        model = subject.build(run_device).eval()
        inputs = subject.make_inputs(model, dims, run_device)
    for side, text in (("src", src_lens), ("tgt", tgt_lens)):
        if text is None:
            continue
        if side not in inputs.kwargs:
            raise TfcliError(f"--{side}-lens: this {cfg.kind} model has no "
                             f"{'source' if side == 'src' else 'target'} side")
        lens = int_list(text, f"--{side}-lens", "5,3")
        if len(lens) != batch_size or not all(0 <= n <= lengths[side] for n in lens):
            raise TfcliError(f"--{side}-lens {text!r}: give {batch_size} lengths (--batch-size), "
                             f"each in 0..{lengths[side]} (--{side}-len)")
        inputs.kwargs[f"{side}_valid"] = masks.valid_from_lengths(lens, lengths[side]).to(
            run_device)

    used = {k: dims[k] for k in subject.dims_used() if k in dims}
    used.update(subject.derived_dims(dims))
    try:
        with working(f"running the forward pass on {device_name}"), \
                flop_counting() as counter:  # one forward pass: the trace, counted by torch too
            events = trace(model, inputs, causal_half=causal_flops,
                           is_causal_scope=subject.is_causal_scope)
    except ForwardFailed as failure:
        if may_fall_back:
            raise NotAbstract(error_text(failure.error, 160)) from None
        names = {**used, **subject.model_dims(model)}
        hint = ("; it may need real values: try --device cpu"
                if device_name == "meta" and "meta" in str(failure.error) else "")
        if json_out:
            # the partial trace as the whole one is guarded: every call, then the JSON text
            calls = len(failure.events)
            short = shortfall(JSON_BYTES_PER_CALL * calls, "cpu")
            print_json({"error": str(failure),
                        "events": None if short else [e.to_dict() for e in failure.events],
                        "events_left_out": f"{calls:,} module calls: the JSON {short}"
                        if short else None})
            if short:
                hint += (f"; the partial trace ({calls:,} module calls) is left out of the "
                         f"JSON: it {short}")
        else:
            stdout().print(build_tree(failure.events, names, depth, True, False,
                                      "partial trace (the forward pass failed)"))
        # the exit's one line, JSON or not
        raise TfcliError(f"{failure}{hint}", exit_code=1, kind="") from None
    names = {**used, **(subject.model_dims(model) or infer_dims(model, events))}
    experts = moe.find_experts(model, subject.experts_per_token())
    if experts:
        names.update(moe.dim_names(experts))
        if "L" in used:
            names["B·L"] = used["B"] * used["L"]
    moe_flops = moe.flops_summary(experts, events)
    meaning = {k: LEGEND[k] for k in names if k in LEGEND}
    length = None if {"S", "T", "L"} & set(names) else attention_length(events, names)
    if length:  # a ViT's patches and class token
        names["L"], meaning["L"] = length, "the length attention runs over"
    spelled = [f"{k} {meaning[k]}" for k in names if k in MODALITY_LETTERS or k == "L" and length]

    forward = events[0].flops
    windowed = subject.windowed_flops(events) if hasattr(subject, "windowed_flops") else None
    if backward:  # a second pass, forward and backward, for the counter
        from tfcli.subjects.base import running

        model.train()
        with running(model, "backward pass", "the second pass, counting FLOPs"):
            counter = count_with_flop_counter(
                lambda: primary_output(inputs(model)).float().sum().backward())
    ours = forward * (3 if backward else 1)
    as_torch = forward + events[0].backward_torch if backward else None
    reasons, reconciled = _reconcile(events[0], counter, backward, causal_flops)
    # ops whose work neither side counts: FlopCounterMode has no formula, tfcli none either
    unseen = list(dict.fromkeys(
        [op for op in counter.missing if op not in counter.registered]
        + [op for op in events[0].uncounted if op in counter.missing]))
    unclear = [f"{v} is {' or '.join(n)}" for v, n in ambiguous(names).items()]
    reused = reused_calls(events, model)

    if json_out:
        # Every call whole, then JSON text: 5.8-6.7 KB per call at the peak (tracemalloc, a
        # 100-layer Llama and 2,000 Linear modules), which 130,000 calls (10,000 Llama
        # layers) make a gigabyte.
        require(JSON_BYTES_PER_CALL * len(events), "shapes --json", None, "cpu",
                f"{len(events):,} module calls, about {JSON_BYTES_PER_CALL // 1024} KiB "
                f"apiece while the JSON is made", hint="; without --json the table folds "
                "repeated layers")
        print_json({
            "dims": names, "legend": meaning,
            "ambiguous": unclear, "device": device_name, "fallback": fallback,
            "reused": [r.to_dict() for r in reused],
            "subject": subject.describe(),
            "events": [{**e.to_dict(),
                        "inputs_symbolic": [None if s is None else symbolic(s, names)
                                            for s in e.inputs],
                        "outputs_symbolic": [None if s is None else symbolic(s, names)
                                             for s in e.outputs]} for e in events],
            "flops": {"forward": forward, "backward": 2 * forward if backward else None,
                      "forward_backward_as_torch_runs_it": as_torch,
                      "reconciled_exactly": reconciled and not unseen,
                      "uncounted_by_either": unseen,
                      "convention": CONVENTION, "causal_half": causal_flops,
                      "flop_counter": counter.flop_counter, "flop_counter_corrected":
                          counter.corrected, "uncounted_ops": counter.missing,
                      "by_op": events[0].flops_by_op,
                      "formulas_registered": counter.registered, "differences": reasons,
                      "forward_windowed": windowed},
            "moe": moe_flops,
        })
        return
    console = stdout()
    if fallback:
        console.print(f"note: {fallback}", style="yellow")
    legend = "  ".join(f"{k}={v}" for k, v in names.items())
    console.print(f"dimensions: {legend}")
    if spelled:
        console.print(f"  where {', '.join(spelled)}")
    for line in unclear:
        console.print(f"ambiguous: size {line}; choose other example sizes "
                      f"(--batch-size, --src-len, --tgt-len, --dim)", style="yellow")
    console.print(build_tree(events, names, depth, expand, backward,
                             f"{cfg.kind if cfg is not None else subject.label} on {device_name}"))
    for r in reused:
        if r.kind == "roles":
            console.print(f"one module in {len(r.roles)} roles: {r.path} ({r.type}) is "
                          f"{'; '.join(r.roles)} — its weights are shared across them; was "
                          f"that intended?", style="yellow")
    repeated = [f"{r.path} ×{r.calls}" for r in reused if r.kind == "repeated"]
    if repeated:
        console.print(f"applied more than once in one role (deliberate reuse, e.g. one block "
                      f"applied N times): {', '.join(repeated[:8])}"
                      f"{', …' if len(repeated) > 8 else ''}")
    what = "forward+backward" if backward else "forward"
    console.print(f"FLOPs ({what}): tfcli {flops_text(ours)}   [{CONVENTION}]")
    by_op = events[0].flops_by_op
    if set(by_op) - {"linear", "matmul", "attention"}:  # convolutions, torch's formulas
        console.print("  forward by op: " + ", ".join(
            f"{label} {flops_text(n)}" + (" (torch's formula)" if label.startswith("aten.")
                                          else "")
            for label, n in sorted(by_op.items(), key=lambda item: -item[1])))
    console.print(f"  torch FlopCounterMode as shipped: {flops_text(counter.flop_counter)} "
                  f"({100 * counter.flop_counter / ours:.1f}% of tfcli's)" if ours else "")
    for op in counter.missing:
        if op in unseen:
            console.print(f"  neither tfcli nor torch has a formula for {op}: both count it "
                          f"as 0, so both totals leave its work out", style="yellow")
        else:
            console.print(f"  it has no formula for {op} and counts it as 0")
    if counter.registered:
        console.print(f"  with tfcli's formulas for {', '.join(counter.registered)}: "
                      f"{flops_text(counter.corrected)}")
    for reason in reasons:
        console.print(f"  difference: {reason}")
    if as_torch is not None:
        console.print(f"  as torch runs it: {flops_text(as_torch)} ({as_torch:,})")
    if reconciled:
        said = (f"reconciled: the differences above account for torch's count exactly "
                f"({counter.corrected:,})" if reasons else
                f"equal to torch's count ({counter.corrected:,})")
        if unseen:  # equal, but both sides are blind to the same work
            console.print(f"  {said} only on the products both can see: neither counts "
                          f"{', '.join(unseen)}, so both figures leave its work out",
                          style="yellow")
        else:
            console.print(f"  {said}")
    elif not causal_flops:
        console.print(f"  not reconciled: {counter.corrected - (as_torch or forward):+,} FLOPs "
                      f"that tfcli cannot explain", style="yellow")
    if moe_flops is not None:
        _print_moe(console, moe_flops, names, subject.describe(), forward)
    if windowed is not None:
        console.print(f"  effective with the sliding window (attention_window="
                      f"{cfg.attention_window}): {flops_text(windowed)} forward — only the "
                      f"(query, key) pairs the window allows; the figures above are dense")



def _print_moe(console, summary: dict, names: dict, described: dict, forward: int) -> None:
    """Mixture of experts: the experts' share, FLOPs per token, and how tokens were routed."""
    from tfcli.inspection.moe import UNIFORM
    from tfcli.render.shapes import flops_text

    layers, routing = summary["layers"], summary["routing"]
    top_k = "/".join(str(k) for k in {x["top_k"] for x in layers})
    experts = "/".join(str(n) for n in {x["experts"] for x in layers})
    console.print(f"mixture of experts: {len(layers)} MoE layers, k={top_k} of E={experts} "
                  f"experts per token; the experts' products: "
                  f"{flops_text(summary['experts_forward_flops'])} of {flops_text(forward)} "
                  f"forward")
    if summary["tokens"]:
        console.print(f"  per token: {flops_text(round(summary['forward_flops_per_token']))} "
                      f"forward (B·L = {summary['tokens']} tokens), counting only the k experts "
                      f"each token is routed to")
    uniform = all(r["how"] == UNIFORM for r in routing)
    if routing:
        console.print("  routing: no values to route on, so assumed uniform (each expert gets "
                      "B·L·k/E token slots); the FLOPs and saved activations do not depend on "
                      "it, only the tokens per expert do" if uniform else
                      "  routing: recorded on this run (tokens per expert in each layer: see "
                      "the tree, or --json)")
    ran = described.get("experts_implementation")
    if ran and uniform:
        console.print(f"  experts ran as: {ran['meta_and_fake_tensors']}")
    elif ran:
        console.print(f"  experts ran as: {ran['real_tensors']}" + (
            f", not {ran['transformers_runs']} (what Transformers runs for this config), so that "
            f"FlopCounterMode counts each expert's products with its own formulas"
            if ran["transformers_runs"] != ran["real_tensors"] else ""))


def _reconcile(top, counter, backward: bool, causal_flops: bool) -> tuple[list[str], bool]:
    """Why torch's FlopCounterMode differs from tfcli's convention, and whether the reasons
    account for every FLOP of the difference."""
    reasons = []
    if causal_flops:
        reasons.append("--causal-flops counts half of each causal QKᵀ and AV; torch counts all")
    if not backward:
        return reasons, not causal_flops and counter.corrected == top.flops
    skipped = 2 * top.flops - top.backward_torch
    if skipped:
        reasons.append(f"torch's backward computes no gradient for a tensor that needs none (the "
                       f"model's inputs): the products that would give it are skipped, "
                       f"{skipped:,} FLOPs of tfcli's 2 × forward")
    fused = counter.corrected - (top.flops + top.backward_torch)
    grouped = top.counter_excess
    if fused and grouped and fused - grouped in (0, top.attention_flops // 2):
        reasons.append(f"torch counts the weight gradient of a grouped convolution as if it "
                       f"were not grouped (× groups): {grouped:+,} FLOPs more than the "
                       f"products done")
        fused -= grouped
    if fused and counter.registered and fused * 2 == top.attention_flops:
        reasons.append(f"torch counts the fused SDPA backward as 2.5 × forward (it recomputes "
                       f"QKᵀ): {fused:+,} FLOPs; tfcli's convention is 2 ×")
        fused = 0
    return reasons, not causal_flops and fused == 0
