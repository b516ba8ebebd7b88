"""Pipeline parallelism (``--parallel pp=P``) for any subject — a user's ``nn.Module``, a
Transformers model — from its built module tree and the fake-tensor replay, not from tfcli's
configuration fields (those are :mod:`tfcli.parallel.plan`'s).

- Stages: the blocks (the wrap units of :mod:`tfcli.parallel.units`, the largest ModuleList's)
  are split over P stages in order, as evenly as possible: the first L mod P stages hold one
  block more. A module outside the blocks goes where the forward calls it: before the first
  block, the first stage (embeddings); after the last, the last stage (final norm, head); inside
  a block's forward, that block's stage. This is the layout of torch.distributed.pipelining's
  manual split and of Megatron-LM. A parameter is on every stage holding a module that owns it:
  tied input and output embeddings are a copy on the first and on the last stage (as Megatron-LM
  keeps them, and as a manual split that deletes what a stage does not run leaves them). Modules
  outside the blocks that hold buffers only (rotary tables) are on every stage: each stage makes
  what its blocks are called with besides the hidden state.
- In flight: under 1F1B (torch's Schedule1F1B, Megatron-LM's schedule without interleaving)
  stage s runs min(P - s, M) forwards before its first backward, then one forward per backward:
  it keeps min(P - s, M) micro-batches' activations, the first stage the most.
- Activations: one replay of the whole model at the micro-batch, each saved tensor attributed to
  its block, to before the first block or to after it; a stage keeps its blocks' for each
  micro-batch in flight, the first stage also what ran before the blocks, the last stage what ran
  after them (head, loss) and backward's working set. A stage but the last keeps its output for
  each micro-batch in flight until that micro-batch's backward, as torch.distributed.pipelining's
  PipelineStage does (Megatron-LM frees the output's data once sent). What passes between
  stages is what the stage's first block is called with that needs a gradient (the hidden
  state; an encoder-decoder's memory too); a stage keeps, as PipelineStage allocates them at
  its first step, a receive buffer per micro-batch for its input and for its output's
  gradient, and its input's gradient until it is sent.
- Model states, buffers and the ZeRO/FSDP lines: :mod:`tfcli.parallel.traced`'s over the
  stage's parameters, sharded over the data-parallel ranks (FSDP units: the stage's blocks and
  its other parameters as the root).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from tfcli.errors import TfcliError
from tfcli.parallel.layout import Line, Parallel, stage_sizes
from tfcli.parallel.plan import Peak, Plan, step_peak
from tfcli.parallel.precision import Policy, check_stage, policy
from tfcli.parallel.traced import WORKING, kept_per_unit
from tfcli.parallel.units import Group, Units, find_units, group, shard_numel

SCHEDULE = ("1F1B (torch.distributed.pipelining's Schedule1F1B, Megatron-LM's schedule without "
            "interleaving): stage s keeps min(P - s, M) micro-batches in flight")


@dataclass(frozen=True)
class Stage:
    """What one pipeline stage holds: its blocks (indices into the units and paths), the
    modules outside the blocks it runs, its parameters as FSDP units, its buffers and the most
    parameters one of its modules holds itself (DeepSpeed ZeRO-3's unit)."""
    index: int
    blocks: tuple[int, ...]
    block_paths: tuple[str, ...]
    holds: tuple[str, ...]
    units: Units
    buffer_numel: int
    largest_module: int
    whole: int = 0  # its parameters' elements before a tensor-parallel split (its own numel)
    parameter_names: frozenset[str] = frozenset()  # every name its parameters go by

    @property
    def groups(self) -> list[Group]:
        return [*self.units.groups, self.units.root]

    def blocks_text(self) -> str:
        first, last = self.block_paths[0], self.block_paths[-1]
        return first if len(self.blocks) == 1 else f"{first} … {last} ({len(self.blocks)})"

    def record(self) -> dict:
        return {"stage": self.index, "blocks": list(self.block_paths),
                "outside_blocks": list(self.holds),
                "parameters": sum(g.numel for g in self.groups),
                "trainable": sum(g.trainable for g in self.groups),
                "buffer_elements": self.buffer_numel}


def in_flight(pp: int, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage ``stage`` of ``pp`` holds at once under 1F1B."""
    return min(pp - stage, micro_batches)


def split(subject, wrap: str | None, sizes: dict[str, int], pp: int,
          build=None) -> list[Stage]:
    """The stages of ``subject``'s model over ``pp`` (see the module's docstring): built and run
    once on meta (or fake tensors) at ``sizes`` to see where the modules outside the blocks
    are called. ``build``: a function that returns the model to split, built on fake tensors
    on the CPU in the caller's fake mode (one rank's share under tensor parallelism); by
    default the subject's model, built here without weights."""
    import contextlib

    import torch

    from tfcli.subjects.base import running

    device, abstract = ("cpu", contextlib.nullcontext()) if build is not None else \
        subject.abstract_run("meta")
    with abstract:
        model = build() if build is not None else subject.build(device)
        units = find_units(model, wrap)
        blocks = units.modules
        if not blocks:
            raise TfcliError(f"--parallel pp={pp}: the model has no repeated blocks to split "
                             f"into stages ({units.how}); give --wrap CLASS to name its "
                             f"blocks, or drop pp")
        if len(blocks) < pp:
            raise TfcliError(f"--parallel pp={pp}: more stages than the model's {len(blocks)} "
                             f"blocks ({units.how}); use pp of at most {len(blocks)}")
        stage_of = [s for s, n in enumerate(stage_sizes(len(blocks), pp)) for _ in range(n)]
        path_of = {id(m): path for path, m in model.named_modules()}
        block_paths = [path_of[id(b)] for b in blocks]
        prefixes = tuple(p + "." for p in block_paths)
        outside = [(path, m) for path, m in model.named_modules()
                   if path not in block_paths and not path.startswith(prefixes)
                   and (any(True for _ in m.parameters(recurse=False))
                        or any(True for _ in m.buffers(recurse=False)))]
        where: dict[str, set[int]] = {path: set() for path, _ in outside}
        at = {"block": None, "done": -1}  # the block running; the last one that returned

        def entered(i: int):
            def hook(module, args):
                at["block"] = i
            return hook

        def returned(i: int):
            def hook(module, args, output):
                at["block"], at["done"] = None, i
            return hook

        def called(path: str):
            def hook(module, args):
                i, done = at["block"], at["done"]
                where[path].add(stage_of[i] if i is not None else 0 if done < 0 else
                                pp - 1 if done == len(blocks) - 1 else stage_of[done + 1])
            return hook

        handles = [h for i, b in enumerate(blocks)
                   for h in (b.register_forward_pre_hook(entered(i)),
                             b.register_forward_hook(returned(i)))]
        handles += [m.register_forward_pre_hook(called(path)) for path, m in outside]
        try:
            with running(model, during="placing the modules outside the blocks on pipeline "
                                       "stages"), torch.no_grad():
                subject.make_inputs(model, sizes, device)(model)
        finally:
            for handle in handles:
                handle.remove()
        return [_stage(s, pp, blocks, block_paths, stage_of, outside, where)
                for s in range(pp)]


def _stage(s: int, pp: int, blocks, block_paths, stage_of, outside, where) -> Stage:
    mine = tuple(i for i, st in enumerate(stage_of) if st == s)
    held = []
    for path, module in outside:
        owns = any(True for _ in module.parameters(recurse=False))
        if not owns or s in where[path] or (not where[path] and s == 0):
            held.append((path or "(model)", module,
                         "" if where[path] or not owns else " (not called: placed first)"))
    seen: set[int] = set()
    groups = [group(block_paths[i], blocks[i].parameters(), seen) for i in mine]
    root = group("root", (p for _, m, _ in held for p in m.parameters(recurse=False)), seen)
    buffers: dict[int, int] = {}
    for i in mine:
        buffers.update((id(b), b.numel()) for b in blocks[i].buffers())
    for _, module, _ in held:
        buffers.update((id(b), b.numel()) for b in module.buffers(recurse=False))
    def local(p) -> int:  # a tensor-parallel DTensor: this rank's shard
        return getattr(p, "_local_tensor", p).numel()

    own = [sum(local(p) for p in m.parameters(recurse=False))
           for i in mine for m in blocks[i].modules()]
    own += [sum(local(p) for p in m.parameters(recurse=False)) for _, m, _ in held]
    how = (f"stage {s} of {pp}: {len(mine)} block(s), {block_paths[mine[0]]}"
           + (f" … {block_paths[mine[-1]]}" if len(mine) > 1 else ""))
    units = Units([blocks[i] for i in mine], groups, root, how)
    named = [(f"{block_paths[i]}.{name}", p) for i in mine
             for name, p in blocks[i].named_parameters(remove_duplicate=False)]
    named += [(f"{path}.{name}" if path else name, p) for path, m, _ in held
              for name, p in m.named_parameters(recurse=False, remove_duplicate=False)]
    whole = sum({id(p): p.numel() for _, p in named}.values())
    return Stage(s, mine, tuple(block_paths[i] for i in mine),
                 _named(held, [path for path, _ in outside], block_paths), units,
                 sum(buffers.values()), max(own, default=0), whole,
                 frozenset(name for name, _ in named))


def _named(held, outside: list[str], block_paths: list[str]) -> tuple[str, ...]:
    """The modules outside the blocks a stage holds, in few words: each under the outermost
    module none of whose blocks or other modules it lacks (the whole ``model.encoder`` of an
    encoder-decoder whose decoder layers are the blocks, not each of its layers' linears);
    "(buffers)" where that is all they hold."""
    here = {path or "(model)" for path, _, _ in held}
    out: dict[str, bool] = {}  # name: buffers only
    for path, module, note in held:
        name = path or "(model)"
        parts = path.split(".") if path else []
        for n in range(1, len(parts)):
            top = ".".join(parts[:n])
            under = [p for p in outside if p == top or p.startswith(top + ".")]
            if not any(b.startswith(top + ".") for b in block_paths) and \
                    all(p in here for p in under):
                name = top
                break
        only = not any(True for _ in module.parameters(recurse=False))
        out[name + note] = out.get(name + note, True) and only
    return tuple(name + (" (buffers)" if only else "") for name, only in out.items())


def view_of(traced, stage: Stage):
    """``traced`` (a TracedModel) as if its model were the stage: its lines then describe the
    stage's parameters, buffers and units."""
    view = copy.copy(traced)
    groups = stage.groups
    view.units = stage.units
    view.numel = sum(g.numel for g in groups)
    view.trainable = sum(g.trainable for g in groups)
    view.shapes = [s for g in groups for s in g.shapes]
    view.trainable_shapes = [s for g in groups for s in g.trainable_shapes]
    view.buffer_numel = stage.buffer_numel
    view.largest_module = stage.largest_module
    view.experts = None
    return view


def pipeline_plan(traced, par: Parallel, sizes: dict[str, int] | None, checkpointing: str,
                  dtype: str, mixed: str | None, optimizer_states: int, kernel: str,
                  loop: str, precision: str, device: str,
                  micro_batches: int | None) -> Plan:
    """Every stage's memory of one training step (``sizes``: B and the lengths at the
    micro-batch; None: model states and buffers only), and the stage that needs the most as
    the plan's lines; each stage's figures under conditions["pipeline"]."""
    if par.ep > 1:
        raise TfcliError(f"--parallel pp={par.pp},ep={par.ep}: pipeline and expert parallelism "
                         f"together are not computed for --model yet; drop one of them")
    m = micro_batches if micro_batches is not None else par.pp
    if m < 1:
        raise TfcliError(f"--micro-batches {m}: must be a positive integer")
    sb = policy(precision, dtype, mixed, optimizer_states)
    n, zero, pp = par.shard, par.zero, par.pp
    check_stage(sb, zero)
    stages = traced.stages(pp, sizes)
    estimate = how = None
    if sizes is not None:
        estimate, how = traced.replay(tuple(sorted(sizes.items())), sb.run_dtype, sb.autocast,
                                      kernel, loop, device)
    results, peaks = [], []
    for st in stages:
        view = traced.stage_view(st)
        lines = view._state_lines(n, zero, sb)
        lines[0].how = (f"stage {st.index} of {pp}: blocks {st.blocks_text()}"
                        + (f", and {', '.join(st.holds)}" if st.holds else "") + "; "
                        + lines[0].how)
        lines += view._buffer_lines(sb) + view._communication_lines(n, zero, sb)
        fsdp = zero == 3 and n > 1 and sb.name != "deepspeed" and st.units.largest is not None
        if fsdp:
            lines = _unsynced_gradients(lines, view, sb)
        kept = 0
        if estimate is not None:
            act, kept = _activation_lines(st, estimate, pp, m, checkpointing, sb)
            lines += act
            trained = st.units.most_trained  # a unit's gradients (frozen weights: none)
            unit = (st.largest_module if sb.name == "deepspeed"
                    else trained.trainable if trained else 0)
            shard = shard_numel(trained.trainable_shapes, n) if trained else 0
            last = _last_blocks_backward(estimate, m) if st.index == pp - 1 else None
            peaks.append(
                _fsdp_stage_peak(lines, in_flight(pp, st.index, m), m, len(st.units.groups),
                                 st.units.largest.numel * sb.gathered, view.numel * sb.gathered,
                                 last)
                if fsdp else
                _stage_peak(lines, kept, in_flight(pp, st.index, m), m,
                            unit * sb.unit_grads if zero == 3 else 0,
                            shard * sb.grads if zero == 3 else 0, last))
        results.append(lines)
    totals = [sum(line.bytes for line in lines) for lines in results]
    need = [p.bytes for p in peaks] if peaks else totals
    worst = max(range(pp), key=need.__getitem__)
    view = traced.stage_view(stages[worst])
    records = [st.record() | {"in_flight": in_flight(pp, st.index, m), "total_bytes": total,
                              "peak_bytes": peaks[st.index].bytes if peaks else None,
                              "memory": [line.record() for line in lines]}
               for st, total, lines in zip(stages, totals, results)]
    conditions = {"micro_batch": sizes.get("B") if sizes else None,
                  "sizes": traced.subject.sizes_used(sizes),
                  "seq_len": None, "seq_len_per_rank": None, "micro_batches": m,
                  "checkpointing": checkpointing, "dtype": dtype, "mixed_precision": mixed,
                  "precision": sb.name, "state_bytes": sb.how, "sharded_over": n,
                  "attention_kernel": kernel, "replayed_as": device, "activations": how,
                  "loop": loop if sizes is not None else None,
                  "wrap_units": traced.units.how, "expert_parallel": None,
                  "model_states_by_zero": [
                      {"zero": z, "bytes": sum(line.bytes for line in view._state_lines(n, z, sb))}
                      for z in range(4)],
                  "model_states_from": f"the built model: {traced.numel:,} parameters "
                                       f"({traced.trainable:,} trainable); stage {worst} holds "
                                       f"{view.numel:,}",
                  "pipeline": {"stages": records, "worst": worst, "schedule": SCHEDULE,
                               "split": "blocks in order, the first L mod P stages one more; "
                                        "modules outside the blocks where the forward calls "
                                        "them (before the blocks: the first stage, after: the "
                                        "last), those with buffers only on every stage"}}
    return Plan(par, worst, results[worst], [], totals, conditions,
                peaks[worst] if peaks else None)


# the activation lines that hold one copy per micro-batch in flight
_PER_MICRO_BATCH = ("activations: layers", "activations: stage outputs",
                    "activations: before the blocks", "activations: after the blocks")


def _stage_peak(lines: list[Line], kept: int, flight: int, m: int, unit_grads: int,
                unit_shard: int, blocks_backward: tuple[int, int] | None = None) -> Peak:
    """A stage's peak. With more micro-batches than it keeps in flight, gradients accumulate
    while it holds the most activations (its second backward onwards runs beside forwards).
    With all M in flight before the first backward (M ≤ P - s: the first stage at M = P) the
    first backward, the one with the most activations, runs before any gradient exists, and
    from the second on one micro-batch's activations are gone: both moments are compared.
    ``blocks_backward``: the last stage's, what its blocks' backward holds beside the lines
    (see :func:`_last_stage_recomputed`)."""
    accumulating = m > flight
    by = {line.name: line.bytes for line in lines}
    if blocks_backward is not None and by.get(RECOMPUTED):
        return _last_stage_recomputed(lines, kept, accumulating, unit_grads, unit_shard,
                                      *blocks_backward)
    peak = step_peak(lines, kept, accumulating, unit_grads, unit_shard)
    if accumulating or flight < 2:
        return peak
    bytes_of = {line.name: line.bytes for line in lines}
    one = sum(bytes_of.get(name, 0) for name in _PER_MICRO_BATCH) // flight
    moments = {**peak.moments, "second backward": (peak.moments["backward start"] - one
                                                    + bytes_of.get("gradients", 0))}
    moment = max(moments, key=moments.__getitem__)
    return Peak(moments[moment], moment, moments,
                peak.how + f"; all {m} micro-batches in flight before the first backward "
                f"(M ≤ P - s), which runs before any gradient exists: second backward (backward "
                f"start less one micro-batch's activations, plus the gradients)")


RECOMPUTED, AFTER = "activations: recomputed layer", "activations: after the blocks"
UNSYNCED = "unsharded gradients, accumulated"


def _unsynced_gradients(lines: list[Line], view, sb: Policy) -> list[Line]:
    """FSDP's lines as torch.distributed.pipelining runs a stage: every micro-batch's backward
    with FSDP's gradient sync and its resharding after backward off
    (set_requires_gradient_sync(False), set_reshard_after_backward(False)), and one
    reduce-scatter of every unit after the last (perform_reduce_grad). So the stage's
    gradients are whole, accumulated over the micro-batches, from its first backward to that
    reduce, where the plan of one micro-batch holds a unit's at a time and the root's: the
    root's line gives way to them all. Read in torch's profiler on real gloo ranks (a user's
    decoder at pp = 2 × dp = 2, ZeRO-3): at a stage's peak, every Linear's whole weight
    gradient of its blocks and the embedding's, made by earlier micro-batches' backward."""
    out = [line for line in lines if line.name != "unsharded root gradients"]
    out.append(Line(UNSYNCED, view.trainable * sb.unit_grads,
                    f"{sb.tag()} every gradient of the stage, {view.trainable:,} × "
                    f"{sb.unit_grads} B, whole: torch.distributed.pipelining runs each "
                    f"micro-batch's backward with FSDP's gradient sync off "
                    f"(set_requires_gradient_sync(False)), so they accumulate unsharded until "
                    f"one reduce-scatter after the last (perform_reduce_grad)",
                    "communication", sb.name))
    return out


def _fsdp_stage_peak(lines: list[Line], flight: int, m: int, units: int, unit_gathered: int,
                     all_gathered: int, blocks_backward: tuple[int, int] | None = None) -> Peak:
    """A stage's peak under FSDP as torch's schedule runs it (:func:`_unsynced_gradients`).
    In backward the sharded gradients and the reduce-scatter buffer do not exist yet; the
    whole gradients do from the stage's first backward (at M ≤ P - s, when every micro-batch
    is in flight before it, only from the second, one micro-batch's activations fewer).
    Inside a backward each unit stays gathered once its backward is over (no resharding
    after backward; a forward in between reshards them): at the stage's first unit's backward
    all of its ``units`` are, where backward start has the root, one unit and the next
    prefetched, and of the micro-batch in backward only that unit's activations are left.
    With two units that is no more than backward start (torch's stage 0 of two checkpointed
    blocks peaked within 1 % of it; counting a third unit gathered put the plan 7 % high).
    After the last
    backward every unit is gathered while each is reduce-scattered to its sharded gradients;
    the activations are gone (the last stage's kept outputs but). The last stage with its
    blocks recomputed (``blocks_backward``, as :func:`_last_stage_recomputed`): the head's
    and the loss's backward without a recomputed block, then its blocks' backward without
    them."""
    by = {line.name: line.bytes for line in lines}
    total = sum(by.values())
    during = total - by.get("gradients", 0) - by.get("reduce-scatter buffer", 0)
    layers = by.get("activations: layers", 0)
    moments = {}
    if blocks_backward is not None and by.get(RECOMPUTED):
        moments["blocks' backward start"] = during + sum(
            line.bytes for line in _blocks_backward_lines(lines, *blocks_backward)) - total
        during -= by[RECOMPUTED]
    if m > flight or flight < 2:  # gradients accumulate beside the most activations
        moments["backward start"] = during
    else:
        per_micro_batch = sum(by.get(name, 0) for name in _PER_MICRO_BATCH) // flight
        moments["backward start"] = during - by[UNSYNCED]
        moments["second backward"] = during - per_micro_batch
    if units > 2:
        moments["first unit's backward"] = (max(moments.values())
                                            - layers // flight * (units - 1) // units
                                            + (units - 2) * unit_gathered)
    activations = sum(line.bytes for line in lines if line.kind == "activations"
                      and line.name != "activations: outputs kept")
    gathered = by.get("unsharded parameters", 0) + by.get("all-gather buffer", 0)
    moments["gradient reduce"] = (total - activations - gathered + all_gathered)
    moment = max(moments, key=moments.__getitem__)
    return Peak(moments[moment], moment, moments,
                "the largest of these moments of a stage's step under FSDP as "
                "torch.distributed.pipelining runs it (gradient sync and resharding after "
                "backward off until the last micro-batch): backward start (every line but "
                "the sharded gradients and the reduce-scatter buffer, the whole gradients "
                "accumulating"
                + ("" if "second backward" not in moments else
                   "; at the first backward, with every micro-batch in flight, none yet; the "
                   "second backward, one micro-batch's activations fewer, beside them")
                + ")" + ("" if "blocks' backward start" not in moments else
                         "; with the blocks recomputed, backward start holds none of them and "
                         "the blocks' backward start holds one, the head's working set and "
                         "what ran after the blocks gone")
                + ("" if "first unit's backward" not in moments else
                         "; the first unit's backward (every unit gathered, of the "
                         "micro-batch in backward only that unit's activations left)")
                + "; the gradient reduce after the last backward (every unit "
                "gathered, the whole and the sharded gradients and the reduce-scatter buffer, "
                "no activations)")


def _last_blocks_backward(estimate, m: int) -> tuple[int, int]:
    """What the last stage holds in its blocks' backward beside its lines, in bytes: the most
    one block's backward adds, and the current micro-batch's output, which PipelineStage keeps
    (output_chunks) after the loss's backward has freed what autograd saved of it — less the
    part the "outputs kept" line already counts (M > 1: what autograd did not save of it)."""
    counted = estimate.output_unsaved - estimate.held_output if m > 1 else 0
    return estimate.unit_working, estimate.output_bytes - counted


def _blocks_backward_lines(lines: list[Line], block_working: int, output: int) -> list[Line]:
    """The last stage's lines as its blocks' backward holds them: what ran after the blocks
    gone, the head's working set given way to the most one block's backward adds and the
    current micro-batch's output (:func:`_last_blocks_backward`)."""
    return [replace(line, bytes=block_working + output) if line.name == WORKING else line
            for line in lines if line.name != AFTER]


def _last_stage_recomputed(lines: list[Line], kept: int, accumulating: bool, unit_grads: int,
                           unit_shard: int, block_working: int, output: int) -> Peak:
    """The last stage's peak when its blocks are recomputed in backward (checkpointing). Its
    backward begins with the head's and the loss's, before any block is recomputed: the
    moment holds what ran after the blocks and the gradients in flight there, not a recomputed
    block. Once the blocks' backward begins those are gone but the current output, and a
    block's activations are recomputed beside the most its backward adds. Counting both at
    once put the last stage 10 % above torch's Schedule1F1B (a user's decoder and a
    Transformers Llama at pp = 3, every block under torch's checkpoint), where checkpointing
    lowered torch's peak by 8 %."""
    head = step_peak([line for line in lines if line.name != RECOMPUTED], kept, accumulating,
                     unit_grads, unit_shard)
    blocks = step_peak(_blocks_backward_lines(lines, block_working, output), kept,
                       accumulating, unit_grads, unit_shard)
    moments = {"backward start": head.moments["backward start"],
               "blocks' backward start": blocks.moments["backward start"],
               **{name: n for name, n in blocks.moments.items() if name != "backward start"}}
    moment = max(moments, key=moments.__getitem__)
    return Peak(moments[moment], moment, moments, blocks.how.replace(
        "backward start (every line but the gradients",
        "backward start (the head's and the loss's backward: every line but the gradients and "
        "the recomputed layer); the blocks' backward start (every line but the gradients, "
        "what ran after the blocks and the head's working set, which give way to the most "
        f"one block's backward adds, {block_working:,} B, and the current micro-batch's "
        f"output, kept by PipelineStage, {output:,} B"))


def _activation_lines(st: Stage, estimate, pp: int, m: int, checkpointing: str,
                      sb: Policy) -> tuple[list[Line], int]:
    """The stage's activation lines and one block's kept bytes (for the peak's moments)."""
    flight = in_flight(pp, st.index, m)
    every, how, again, what = kept_per_unit(estimate, checkpointing)
    kept = [every[i] for i in st.blocks]
    recomputed = [again[i] for i in st.blocks]
    why = f"min(P - s, M) = min({pp} - {st.index}, {m})"
    first, last = st.index == 0, st.index == pp - 1
    received = 0 if first else _handed_over(st, estimate, pp, into=True)  # the stage's input
    sent = 0 if last else _handed_over(st, estimate, pp)  # its output
    if checkpointing == "full" and received:
        # the stage's first block keeps its input for the recomputation: the receive buffer
        # it was handed, counted under send/recv (counted twice, the middle stages of a user's
        # decoder and encoder-decoder and of a Transformers Llama at pp = 3 were 1.8-3.1 %
        # above torch's Schedule1F1B under torch's checkpoint, each by one hidden state per
        # micro-batch in flight)
        shared = min(kept[0], received)
        kept[0] -= shared
        how += (f"; the first block's ({shared:,} B) is the receive buffer it was handed, "
                f"under pipeline send/recv")
    kinds = ([f"its input ({received:,} B)"] if received else []) + (
        [f"its output's gradient ({sent:,} B)"] if sent else [])
    out = [Line("pipeline send/recv", m * (received + sent) + received,
                f"{sb.tag()} a receive buffer per micro-batch (M = {m}) for "
                + " and for ".join(kinds) + ", as torch.distributed.pipelining's PipelineStage "
                "allocates them at the first step and keeps them"
                + (f", and the gradient of its input, made in backward, until it is sent "
                   f"({received:,} B)" if received else "")
                + " (what the blocks are called with that needs a gradient: the hidden state, "
                  "and an encoder's output where they read it; Megatron-LM allocates one per "
                  "transfer)", "communication", sb.name),
           Line("activations: layers", flight * sum(kept),
                f"{len(kept)} block(s) × {flight} micro-batch(es) in flight ({why}): {how}; "
                f"largest {max(kept):,} B per micro-batch", "activations")]
    if any(recomputed):
        out.append(Line(RECOMPUTED, max(recomputed),
                        f"the stage's largest block's {what}", "activations"))
    if st.index < pp - 1:
        # (what it hands on beside the hidden state, an encoder's output, is held already:
        # saved by the blocks that read it, or the stage's own receive buffer)
        out.append(Line("activations: stage outputs",
                        flight * estimate.unit_inputs[st.blocks[-1] + 1],
                        f"the stage's output (the hidden state) of each of {flight} "
                        f"micro-batch(es) in flight, kept for its backward as "
                        f"torch.distributed.pipelining's PipelineStage keeps it (fwd_cache; "
                        f"Megatron-LM frees its data once sent: deallocate_pipeline_outputs)",
                        "activations"))
    before = sum(estimate.before_units.values())
    if st.index == 0:
        out.append(Line("activations: before the blocks", flight * before,
                        f"what ran before the first block (embeddings) saved for backward, × "
                        f"{flight} micro-batch(es) in flight", "activations"))
    if not last:
        out.append(Line(WORKING, estimate.unit_working,
                        "the most one block's backward adds to what is alive as it begins "
                        "(gradients in flight inside it, less what it frees as it goes), the "
                        "replay's largest", "activations"))
    if last and m > 1:
        # (the keep-output loop's held output is the current one's already, in the working set)
        out.append(Line("activations: outputs kept", (m - 1) * estimate.output_bytes
                        + estimate.output_unsaved - estimate.held_output,
                        f"the model's output of each micro-batch, kept by "
                        f"torch.distributed.pipelining's PipelineStage (output_chunks) until "
                        f"step() returns them merged: {m - 1} earlier micro-batch(es)' "
                        f"({estimate.output_bytes:,} B each, detached after their backward) "
                        f"and the current one's beyond what autograd saved", "activations"))
    if last:
        in_units = sum(sum(kinds.values()) for kinds in estimate.unit_saved)
        outside = sum(estimate.saved_bytes.values()) - in_units
        out.append(Line(AFTER, flight * (outside - before),
                        f"what ran after the last block (final norm, head, loss) saved for "
                        f"backward, × {flight} micro-batch(es) in flight", "activations"))
        out.append(Line(WORKING, max(estimate.peak_bytes - in_units - outside, 0),
                        "the replay's peak less every saved tensor: gradients in flight where "
                        "backward starts (the loss's and the head's)"
                        + (f"; {estimate.held_output:,} B of it the model's output, held by "
                           f"the keep-output loop" if estimate.held_output else ""),
                        "activations"))
    return out, max(kept)


def _handed_over(st: Stage, estimate, pp: int, into: bool = False) -> int:
    """What the stage sends on (``into``, or the last stage: what it receives): the tensors
    the next stage's first block (or its own) is called with that need a gradient — the
    hidden state, and an encoder-decoder's memory; what needs none (masks, rotary angles)
    each stage makes for itself."""
    following = st.blocks[0] if into or st.index == pp - 1 else st.blocks[-1] + 1
    return estimate.unit_sent[following]
