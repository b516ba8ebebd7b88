"""``tfcli params --parallel ...``: the per-rank plan as a record, "does it fit?" and the search
for the largest batch or length that fits, and its Rich rendering. The command module only
parses options and calls :func:`per_rank` and :func:`render`."""

from __future__ import annotations

from tfcli.inspection.fit import SEARCHED, device_budget, fit, fit_length
from tfcli.parallel.plan import Parallel, parse_parallel, plan
from tfcli.errors import TfcliError
from tfcli.model.config import Config

FIT = ("batch", "seq-len")


def per_rank(cfg: Config, parallel: str | None, batch: int, seq_len: int | None,
             micro_batches: int | None, checkpointing: str, dtype: str, mixed: str | None,
             optimizer_states: int, kernel: str = "auto", device_memory: str | None = None,
             fit_what: str | None = None, reserve: str | None = None,
             loop: str = "loss-only", precision: str = "autocast",
             device: str = "cpu", optimizer: str | None = None,
             optimizer_impl: str | None = None) -> dict:
    """The plan at (batch, seq_len) as a dict; with ``device_memory`` its headroom below the
    capacity less ``reserve`` (tfcli.inspection.fit.device_budget); with ``fit_what`` the
    largest batch or length that fits there and the plan there."""
    par = parse_parallel(parallel) if parallel is not None else Parallel()
    check_request(par, fit_what, device_memory, seq_len, micro_batches, dtype, mixed)
    budget = device_budget(device_memory, reserve) if device_memory else None
    capacity = budget.usable if budget else None
    limit = cfg.max_seq_len if cfg.positional != "none" else 1 << 20

    needs: dict[int, int] = {}  # what each batch or length the search tried needs

    def at(b: int, s: int | None):
        result = plan(cfg, par, b, s, micro_batches, checkpointing, dtype, mixed,
                      optimizer_states, precision, kernel=kernel, loop=loop, device=device,
                      optimizer=optimizer, optimizer_impl=optimizer_impl)
        needs[b if fit_what == "batch" else s] = result.need
        return result

    found = bound = None
    step = searched_in = 1
    if fit_what == "batch":
        bound = 1 << 16
        found = fit(lambda b: at(b, seq_len).need, capacity, 1, bound)
        batch = found or 1  # when nothing fits, the plan at the smallest batch tried
    elif fit_what == "seq-len":
        # lengths each context-parallel rank can split evenly, in steps of 64 where the range
        # allows (what people train at; a dozen replays instead of two dozen)
        step = par.cp * (64 if limit >= 256 * par.cp else 1)
        bound = limit // step * step
        found, searched_in = fit_length(lambda s: at(batch, s).need, capacity, step, par.cp,
                                        limit // step)
        seq_len = found or searched_in  # nothing fits: the plan at the shortest length tried
    if seq_len is not None and seq_len > limit:
        raise TfcliError(f"--seq-len {seq_len}: the per-rank plan goes up to {limit:,} for a "
                         f"model without positions" if cfg.positional == "none" else
                         f"--seq-len {seq_len} exceeds max_seq_len={cfg.max_seq_len}; "
                         f"raise it with --set max_seq_len={seq_len}")  # params: seq_len <= 2^31-1
    result = at(batch, seq_len)
    data = result.to_dict()
    data["world_size"] = par.world
    if budget is not None:
        data["device"] = budget.record(result.need, "peak" if result.peak else "total")
    if fit_what is not None:
        data["fit"] = {"what": fit_what, "largest": found, "step": step, "bound": bound,
                       "at_bound": found == bound,
                       "below_step": fit_what == "seq-len" and searched_in < step,
                       "smallest": 1 if fit_what == "batch" else searched_in,  # tried
                       "replays": fit_replays(needs),
                       "bound_is": ("the largest batch searched" if fit_what == "batch" else
                                    "the plan's limit for a model without positions"
                                    if cfg.positional == "none" else
                                    "the model's max_seq_len: a longer one needs --set "
                                    "max_seq_len"),
                       "searched": SEARCHED.format(what=fit_what)
                                   + (steps_words(step, par.cp) if fit_what == "seq-len"
                                      else "")}
    return data


def fit_replays(needs: dict[int, int]) -> list[dict]:
    """Every batch or length a --fit search planned, with what the plan needs there."""
    return [{"at": x, "need_bytes": need} for x, need in sorted(needs.items())]


def steps_words(step: int, unit: int) -> str:
    return f", lengths in steps of {step}" + (
        f" (then, where not even {step} fits, in steps of {unit} below it)"
        if step > unit else "")


def parse_param_count(text: str) -> int:
    """--param-count: a whole number of parameters, written out or as 7.5e9."""
    try:
        value = float(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = -1.0
    if not (1 <= value <= 1e15) or value != int(value):
        raise TfcliError(f"--param-count {text!r}: a whole number of parameters from 1 to 1e15, "
                         f"e.g. 7.5e9 or 7500000000")
    return int(value)


def stated_states(psi: int, parallel: str, precision: str, dtype: str, mixed: str | None,
                  optimizer_states: int, device_memory: str | None = None,
                  reserve: str | None = None) -> dict:
    """The model states of Ψ = ``psi`` parameters on one of the data-parallel ranks, without a
    model: weights, gradients, master weights and optimizer state as ``precision`` keeps them
    (what Rajbhandari et al.'s Figure 1 tabulates), in the per-rank plan's record."""
    from tfcli.parallel.plan import Plan, model_state_lines, policy, stage_states
    from tfcli.parallel.precision import check_stage

    par = parse_parallel(parallel)
    if par.ep > 1:
        raise TfcliError(f"--parallel ep={par.ep} with --param-count: a stated size has no "
                         f"experts to split; give the model (--model) instead")
    pol = policy(precision, dtype, mixed, optimizer_states)
    check_stage(pol, par.zero)
    n = par.shard
    lines = model_state_lines(psi, n, par.zero, pol)
    lines[0].how = f"Ψ = {psi:,} as stated (--param-count); " + lines[0].how
    conditions = {"micro_batch": None, "seq_len": None, "seq_len_per_rank": None,
                  "micro_batches": 1, "checkpointing": "none", "dtype": dtype,
                  "mixed_precision": mixed, "precision": pol.name, "state_bytes": pol.how,
                  "sharded_over": n, "attention_kernel": None, "activations": None,
                  "model_states_by_zero": stage_states(psi, n, pol),
                  "model_states_from": f"--param-count {psi:,}: model states only (no "
                                       f"layout: no buffers, units or activations)"}
    total = sum(line.bytes for line in lines)
    data = Plan(par, 0, lines, [], [total], conditions).to_dict()
    data["world_size"] = par.world
    if device_memory:
        data["device"] = device_budget(device_memory, reserve).record(total, "total")
    return data


def check_request(par: Parallel, fit_what: str | None, device_memory: str | None,
                  seq_len: int | None, micro_batches: int | None, dtype: str,
                  mixed: str | None) -> None:
    """The per-rank options that must go together, for any subject."""
    if fit_what is not None and fit_what not in FIT:
        raise TfcliError(f"--fit {fit_what!r}: allowed: {', '.join(FIT)}")
    if fit_what is not None and device_memory is None:
        raise TfcliError("--fit needs --device-memory (e.g. 80GiB or H100) to fit into")
    if fit_what == "batch" and seq_len is None:
        raise TfcliError("--fit batch needs --seq-len: the length whose batch is searched")
    if micro_batches is not None and par.pp == 1:
        raise TfcliError(f"--micro-batches {micro_batches}: micro-batches in flight matter to "
                         f"pipeline stages; add pp=P to --parallel (with pp=1 one is in flight)")
    if dtype == "int8" and not mixed:
        raise TfcliError("--parallel with --dtype int8: training needs a floating dtype")
    if par.zero in (1, 2) and par.shard == 1:  # the plan would be zero=0's, said to be ZeRO
        what = "optimizer state" if par.zero == 1 else "optimizer state and gradients"
        raise TfcliError(f"--parallel zero={par.zero}: ZeRO-{par.zero} shards the {what} over "
                         f"the data-parallel ranks, and there is one (dp=1); add dp=N, or "
                         f"drop zero")


def render(data: dict, console) -> None:
    from rich.table import Table

    from tfcli.render import human_bytes

    par, cond = data["parallel"], data["conditions"]
    shown = {k: v for k, v in par.items()
             if k != "world_size" and (k != "sp" or par["tp"] > 1)}  # sp means nothing at tp=1
    title = (f"per rank: {', '.join(f'{k}={v}' for k, v in shown.items())} "
             f"({par['world_size']} ranks)"
             + (f", pipeline stage {data['stage']}" if par["pp"] > 1 else ""))
    table = Table(title=title, title_justify="left")
    for name, justify in (("", "left"), ("bytes", "right"), ("how", "left")):
        table.add_column(name, justify=justify, overflow="fold")
    for line in data["memory"]:
        table.add_row(line["name"], human_bytes(line["bytes"]), line["how"])
    table.add_row("sum", human_bytes(data["total_bytes"]),
                  "the sum of the lines above: everything alive at once, an upper bound")
    if data["peak"]:
        peak = data["peak"]
        moments = ", ".join(f"{name} {human_bytes(b)}" for name, b in peak["moments"].items())
        table.add_row("peak", human_bytes(peak["bytes"]),
                      f"the largest moment of the step modelled (below): {moments}")
    console.print(table)
    if data["cross_check"]:
        check = Table(title="activations cross-check (Korthikanti et al. 2022, Table 2)",
                      title_justify="left")
        for name, justify in (("", "left"), ("bytes", "right"), ("how", "left")):
            check.add_column(name, justify=justify, overflow="fold")
        for line in data["cross_check"]:
            check.add_row(line["name"], human_bytes(line["bytes"]), line["how"])
        console.print(check)
    n = cond["sharded_over"]
    ranks = "data-parallel" if par["cp"] == 1 else "data- and context-parallel"
    notes = [f"precision: {cond['state_bytes']}; "
             + (f"replicated on each of the {n} {ranks} ranks (zero=0)"
                if par["zero"] == 0 and n > 1 else f"sharded over the {n} {ranks} ranks"
                if n > 1 else "one data-parallel rank: nothing sharded")]
    if cond.get("model_states_by_zero") and cond["sharded_over"] > 1:
        notes.append(f"model states per rank at each ZeRO stage ({cond['precision']}, N = "
                     f"{cond['sharded_over']}): " + ", ".join(
                         f"ZeRO-{row['zero']} {row['bytes'] / 1e9:.3g} GB"
                         f" ({human_bytes(row['bytes'])})" for row in cond["model_states_by_zero"]))
    if cond.get("expert_parallel"):
        moe = cond["expert_parallel"]
        notes.append(f"expert parallel: ep={moe['ep']} of the {par['dp']} data-parallel ranks; "
                     f"each holds {'/'.join(map(str, moe['experts_per_rank']))} of "
                     f"{'/'.join(map(str, moe['experts']))} experts in each of "
                     f"{moe['moe_layers']} MoE layers, sharded over the {par['dp'] // moe['ep']} "
                     f"rank(s) holding the same ones; routing {moe['routing']}")
    if cond.get("wrap_units") and par["zero"] == 3:  # a --model's FSDP units, traced
        notes.append(f"parameters: {cond['model_states_from']}; FSDP units: "
                     f"{cond['wrap_units']}")
    elif cond.get("model_states_from"):
        notes.append(f"parameters: {cond['model_states_from']}")
    if cond.get("pipeline"):  # a --model's stages, traced (tfcli.parallel.pipeline)
        pipe = cond["pipeline"]
        notes.append(f"pipeline: {pipe['schedule']}; M = {cond['micro_batches']}; split: "
                     f"{pipe['split']}")
        for st in pipe["stages"]:
            blocks = st["blocks"]
            need = st["peak_bytes"] if st["peak_bytes"] is not None else st["total_bytes"]
            notes.append(
                f"  stage {st['stage']}: {len(blocks)} block(s) {blocks[0]}"
                + (f" … {blocks[-1]}" if len(blocks) > 1 else "")
                + (f" + {', '.join(st['outside_blocks'])}" if st["outside_blocks"] else "")
                + f"; {st['parameters']:,} parameters; {st['in_flight']} micro-batch(es) in "
                f"flight; {'peak' if st['peak_bytes'] is not None else 'sum'} "
                f"{human_bytes(need)}" + (" (the most: the table above)"
                                          if st["stage"] == pipe["worst"] else ""))
    if cond.get("tensor_parallel"):
        tp = cond["tensor_parallel"]
        rules = (", ".join(f"{glob}={style}" for glob, style in tp["rules"].items())
                 if tp["plan_from"] == "--tp-plan" else f"{len(tp['rules'])} rules (--json "
                                                        f"lists them)")
        notes.append(f"tensor parallel: plan from {tp['plan_from']}: {rules}; "
                     f"{tp['modules_split']} module(s) split with "
                     + ", ".join(f"{style} = {torch}" for style, torch in tp["styles"].items())
                     + f"; {tp['how']}; sequence parallelism {tp['sequence_parallel']}")
    if data["peak"]:
        notes.append(f"peak: {data['peak']['how']}")
    if cond["activations"]:
        notes.append(f"activations: {cond['activations']}, checkpointing "
                     f"{cond['checkpointing']}, {cond['micro_batches']} micro-batch(es), "
                     f"attention kernel {cond['attention_kernel']}")
    elif "wrap_units" in cond or not cond.get("model_states_from"):
        notes.append("activations: not estimated (give --seq-len)")
    if "fit" in data:
        fit_ = data["fit"]
        what, step = fit_["what"], fit_["step"]
        if fit_["largest"]:
            largest = fit_["largest"]
            tried = {r["at"]: r["need_bytes"] for r in fit_.get("replays", ())}
            nxt = min((x for x in tried if x > largest), default=None)
            needs = ""
            if largest in tried:
                needs = f"; it needs {human_bytes(tried[largest])}"
                if nxt is not None and "device" in data and not fit_.get("model_refused"):
                    needs += (f", {what} {nxt:,} needs {human_bytes(tried[nxt])}, above the "
                              f"{human_bytes(data['device']['usable_bytes'])} usable")
            notes.append(f"largest {what} that fits: {largest:,}"
                         + (f" (below one step of {step}: lengths searched below it too)"
                            if fit_.get("below_step") else
                            f" (lengths in steps of {step})" if step > 1 else "")
                         + (f"; the model itself stops there: at {what} = "
                            f"{fit_['model_refused']['seq_len']:,} it fails "
                            f"({fit_['model_refused']['why']}), so memory did not decide it"
                            if fit_.get("model_refused") else
                            f"; that is {fit_['bound_is']}, so more may fit"
                            if fit_["at_bound"] else "") + needs)
        else:
            smallest = fit_.get("smallest", step)
            notes.append(f"nothing fits: even {what} = {smallest} exceeds the device; the "
                         f"table is at {what} = {smallest}")
    if "device" in data:
        dev = data["device"]
        room = dev["headroom_bytes"]
        kept = (f"{human_bytes(dev['usable_bytes'])} usable ({human_bytes(dev['bytes'])} less "
                f"{human_bytes(dev['reserve_bytes'])} kept back: {dev['reserve']})")
        notes.append(f"device {dev['name']}: {kept}; fits, {human_bytes(room)} to spare "
                     f"above the {dev['compared']}" if dev["fits"] else
                     f"device {dev['name']}: {kept}; does NOT fit, {human_bytes(-room)} short "
                     f"of the {dev['compared']}")
    for note in notes:
        console.print(note)


def params_parallel(cfg: Config | None, parallel: str | None, batch: int, seq_len: int | None,
                    micro_batches: int | None, checkpointing: str | None, dtype: str,
                    mixed: str | None, optimizer: str, kernel: str, device_memory: str | None,
                    fit_what: str | None, inference: bool, json_out: bool, subject=None,
                    sizes_at=None, wrap: str | None = None, reserve: str | None = None,
                    timeline=None, loop: str = "loss-only", precision: str = "autocast",
                    param_count: int | None = None, device: str = "cpu",
                    tp_plan: str | None = None, optimizer_impl: str | None = None,
                    unused_length: str | None = None) -> None:
    """``tfcli params --parallel ...`` after its options are parsed: validate, plan, print.
    Without ``cfg`` (a --model), the plan of ``subject`` traced from its built model, at the
    sizes ``sizes_at(batch, seq_len)`` gives, with FSDP units ``wrap`` chooses.
    ``timeline(plan) -> dict`` draws one rank's step and says what it wrote, which is printed
    after the plan (under "timeline" with --json). ``loop``: the training loop the activation
    replay assumes (tfcli.inspection.memory.LOOPS). ``param_count``: no model, the model
    states of that many parameters (:func:`stated_states`). ``tp_plan``: --tp-plan's text, a
    --model's tensor-parallel plan (tfcli.parallel.tensor). ``optimizer_impl``: the
    optimizer's implementation, whose step is a moment of the plan (data and context
    parallelism alone). ``unused_length``: what to say of a --seq-len the model's inputs have
    no use for (added to the activations' conditions)."""
    if inference:
        raise TfcliError("--parallel sizes training; --inference is for one device")
    from tfcli.inspection.memory import OPTIMIZER_STATES

    if param_count is not None:
        data = stated_states(param_count, parallel or "dp=1", precision, dtype, mixed,
                             OPTIMIZER_STATES[optimizer], device_memory, reserve)
    elif cfg is None:  # a user's module or a Transformers model: traced from the built model
        from tfcli.parallel import traced

        # the traced plan fits into what is usable, given to it as a plain size; what it says
        # about the device is then said as for tfcli's own model
        budget = device_budget(device_memory, reserve) if device_memory else None
        data = traced.per_rank(subject, parallel, batch, seq_len, micro_batches, sizes_at,
                               checkpointing or "none", dtype, mixed,
                               OPTIMIZER_STATES[optimizer], kernel,
                               str(budget.usable) if budget else None, fit_what, wrap, loop,
                               precision, device=device, tp_plan=tp_plan,
                               optimizer=optimizer, optimizer_impl=optimizer_impl)
        if budget is not None:
            dev = data["device"]
            data["device"] = budget.record(dev["bytes"] - dev["headroom_bytes"],
                                           dev["compared"])
        data["subject"] = subject.describe()
        if unused_length and data["conditions"].get("activations"):
            data["conditions"]["activations"] += f"; {unused_length}"
    else:
        data = per_rank(cfg, parallel, batch, seq_len, micro_batches, checkpointing or "none",
                        dtype, mixed, OPTIMIZER_STATES[optimizer], kernel, device_memory,
                        fit_what, reserve, loop, precision, device=device,
                        optimizer=optimizer, optimizer_impl=optimizer_impl)
        data["config"] = cfg.to_dict()
    if timeline is not None:
        data["timeline"] = timeline(data)
    if json_out:
        from tfcli.cli.process import print_json

        print_json(data)
        return
    from tfcli.cli.process import stdout

    console = stdout()
    render(data, console)
    if timeline is not None:
        written = data["timeline"]
        console.print(f"wrote timeline: {written['path']} (rank 0: peak "
                      f"{written['peak_bytes']:,} B at event {written['peak_event']:,} of "
                      f"{written['events']:,}, {written['phase_at_peak']}; "
                      f"{written['peak_line']})", highlight=False)
