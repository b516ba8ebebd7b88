"""Per-rank training memory under data parallelism (DDP, ZeRO-1/2/3, FSDP) for any subject —
a user's ``nn.Module``, a Transformers model — from its built module tree and a fake-tensor
replay, not from tfcli's configuration fields (those are :mod:`tfcli.parallel.plan`'s).

- Model states: the parameters the model really has (tied weights once, frozen ones without
  gradients or optimizer state, as the single-device table counts them); sharded lines split
  each parameter's first dimension N ways, as FSDP2 shards (ZeRO's flat buffers give Ψ/N,
  within a row per parameter).
- Wrap units (:mod:`tfcli.parallel.units`): FSDP gathers the root unit for the whole step and
  one layer unit at a time, with the next one prefetched; backward reduce-scatters a unit's
  gradients when its backward is over, the root's last (the head's are held unsharded through
  every layer's backward).
- Activations: one replay of the whole model at the rank's batch
  (:func:`tfcli.inspection.memory.estimate_activations`), each saved tensor attributed to the
  unit whose forward saved it; the rest (embeddings, head, loss, backward's working set) is the
  replay's peak less the units' saved bytes. Checkpointing is per unit: ``full`` keeps each
  unit's input and recomputes one unit at a time; ``selective`` drops the attention matrices.

- Expert parallelism (``ep``, :mod:`tfcli.parallel.experts`): each rank holds E/ep of every
  MoE layer's experts, sharded over the dp/ep ranks holding the same ones, and one MoE
  layer's all-to-all dispatch and combine buffers.

- Pipeline parallelism (``pp``, :mod:`tfcli.parallel.pipeline`): the blocks split over stages,
  each stage's lines as above over its own parameters, with 1F1B's micro-batches in flight.
- Tensor parallelism (``tp``, :mod:`tfcli.parallel.tensor`): the same lines for one rank's
  share, the model split by torch's ``parallelize_module`` on a fake process group; beside
  pipeline stages, each stage of that share.

Context parallelism splits sequences that only tfcli's own configuration describes so far:
refused here in one line.
"""

from __future__ import annotations

import functools
import math

from tfcli.errors import TfcliError
from tfcli.parallel.experts import ExpertLayout
from tfcli.parallel.layout import Line, Parallel
from tfcli.parallel.plan import (CHECKPOINTING, Plan, deepspeed_zero3_lines, optimizer_step,
                                 step_peak)
from tfcli.parallel.precision import Policy, check_stage, policy, state_parts
from tfcli.parallel.units import Units, find_units, shard_numel


WORKING = "activations: backward working set"


def refuse_model_splits(par: Parallel, tensor: bool = False) -> None:
    """Tensor parallelism is computed by tfcli.parallel.tensor.TensorParallelModel
    (``tensor``: the caller is it)."""
    if par.tp > 1 and not tensor:
        raise TfcliError(f"--parallel tp={par.tp}: this is a plan of the whole model; one "
                         f"rank's share under tensor parallelism is "
                         f"tfcli.parallel.tensor.TensorParallelModel's")


CONTEXT_WORDS = ("each rank replays its {local} of the {whole} positions; the other ranks' keys "
                 "and values its attention reads (all-gathered, or passed round a ring) are not "
                 "counted")


def check_context(subject, par: Parallel, seq_len: int | None) -> None:
    """Context parallelism splits every length ``cp`` ways: the model needs a length, and
    the length must divide evenly."""
    if par.cp == 1:
        return
    if not subject.has_sequence():
        raise TfcliError(f"--parallel cp={par.cp}: context parallelism splits the token "
                         f"sequence, and the model's inputs have no sequence length "
                         f"({subject.why_no_sequence()}); drop cp")
    if seq_len and seq_len % par.cp:
        raise TfcliError(f"--seq-len {seq_len} is not divisible by cp={par.cp}")


def runs_whole(subject, sizes: dict[str, int]) -> str | None:
    """Whether the whole model runs a forward pass at ``sizes`` (fake tensors, no weights):
    None if it does, else the model's own failure (one line). Context parallelism replays one
    rank's share of the length, which cannot see what the model refuses of the whole
    sequence (more positions than it has)."""
    from tfcli.subjects.base import RunFailed, running

    device, abstract = subject.abstract_run("meta")
    try:
        with abstract:
            model = subject.build(device)
            inputs = subject.step_inputs(model, sizes, device)
            with running(model):
                inputs(model)
    except RunFailed as error:
        return str(error)
    return None


class TracedModel:
    """A subject's model built once on meta (its units and parameter groups), and plans of it
    at any batch and length, each from a replay (cached: --fit asks again)."""

    def __init__(self, subject, wrap: str | None = None,
                 probe: dict[str, int] | None = None) -> None:
        self.subject, self.wrap = subject, wrap
        # the sizes a forward is run at to place modules on pipeline stages without a replay
        self.probe = probe or {**subject.default_sizes, "B": 1}
        self._stages: dict[int, list] = {}
        device, abstract = subject.abstract_run("meta")
        with abstract:
            self._survey(subject.build(device))

    def _survey(self, model) -> None:
        """Units, parameter groups and buffers of the built ``model`` (a tensor-parallel
        rank's share: its local shards)."""
        self.units: Units = find_units(model, self.wrap)
        self.buffer_numel = sum(b.numel() for b in model.buffers())
        # DeepSpeed ZeRO-3's unit: the most parameters one module holds itself
        self.largest_module = max(sum(getattr(p, "_local_tensor", p).numel()
                                      for p in m.parameters(recurse=False))
                                  for m in model.modules())
        self.experts = ExpertLayout.of(model, self.units, self.subject)  # None: no MoE
        groups = [*self.units.groups, self.units.root]
        self.numel = sum(g.numel for g in groups)
        self.trainable = sum(g.trainable for g in groups)
        self.shapes = [s for g in groups for s in g.shapes]
        self.trainable_shapes = [s for g in groups for s in g.trainable_shapes]

    def stages(self, pp: int, sizes: dict[str, int] | None = None) -> list:
        """The model split over ``pp`` pipeline stages (tfcli.parallel.pipeline.split), found
        by a forward at ``sizes`` (or the probe's) the first time."""
        from tfcli.parallel.pipeline import split

        if pp not in self._stages:
            self._stages[pp] = split(self.subject, self.wrap, sizes or self.probe, pp)
        return self._stages[pp]

    def stage_view(self, stage):
        """This model as if it were the pipeline stage ``stage`` (its lines then describe the
        stage's parameters, buffers and units): tfcli.parallel.pipeline.view_of."""
        from tfcli.parallel.pipeline import view_of

        return view_of(self, stage)

    def _units_of(self, model):
        return find_units(model, self.wrap).modules

    @functools.lru_cache(maxsize=64)
    def replay(self, sizes: tuple, dtype: str, mixed: str | None, kernel: str,
               loop: str = "loss-only", device: str = "cpu"):
        """The replay at ``sizes`` with the model's weights in ``dtype``, under autocast
        ``mixed`` (None: none), for the training loop ``loop``."""
        from tfcli.inspection.memory import estimate_activations

        return estimate_activations(self.subject, dict(sizes), dtype, mixed, kernel,
                                    units=self._units_of, loop=loop, device=device)

    def plan(self, par: Parallel, sizes: dict[str, int] | None, checkpointing: str = "none",
             dtype: str = "fp32", mixed: str | None = None, optimizer_states: int = 2,
             kernel: str = "auto", loop: str = "loss-only", precision: str = "autocast",
             device: str = "cpu", micro_batches: int | None = None,
             optimizer: str | None = None, optimizer_impl: str | None = None) -> Plan:
        """One rank's memory; ``sizes`` (B and the lengths at the rank's micro-batch, and
        with cp > 1 its share of each length, as per_rank passes them) gives the activation
        lines, None only model states and buffers; every line follows the
        precision policy ``precision`` (tfcli.parallel.precision); ``loop``: the training
        loop the replay assumes (tfcli.inspection.memory.LOOPS). With pp > 1, the stage that
        needs the most, ``micro_batches`` (default pp) per step (tfcli.parallel.pipeline).
        ``optimizer`` and ``optimizer_impl`` (data and context parallelism alone) add the
        optimizer's step as a moment (tfcli.parallel.plan.optimizer_step)."""
        self._check_splits(par)
        if checkpointing != "none" and not self.units.modules:
            raise TfcliError(f"--checkpointing {checkpointing}: {self.units.how}; tfcli "
                             f"checkpoints each unit but the root, so nothing would change: "
                             f"name the blocks to checkpoint with --wrap CLASS, or drop "
                             f"--checkpointing")
        if par.pp > 1:
            from tfcli.parallel.pipeline import pipeline_plan

            if checkpointing not in CHECKPOINTING:
                raise TfcliError(f"--checkpointing {checkpointing!r}: allowed: "
                                 f"{', '.join(CHECKPOINTING)}")
            return pipeline_plan(self, par, sizes, checkpointing, dtype, mixed,
                                 optimizer_states, kernel, loop, precision, device,
                                 micro_batches)
        ep = self._expert_parallel(par)
        if checkpointing not in CHECKPOINTING:
            raise TfcliError(f"--checkpointing {checkpointing!r}: allowed: "
                             f"{', '.join(CHECKPOINTING)}")
        sb = policy(precision, dtype, mixed, optimizer_states)
        n, zero = par.shard, par.zero
        check_stage(sb, zero)
        lines = self._state_lines(n, zero, sb, ep) + self._buffer_lines(sb)
        lines += self._communication_lines(n, zero, sb, ep)
        peak, how, per_unit = None, None, 0
        if sizes is not None:
            estimate, how = self.replay(tuple(sorted(sizes.items())), sb.run_dtype,
                                        sb.autocast, kernel, loop, device)
            act, per_unit = self._activation_lines(estimate, checkpointing)
            if ep > 1:
                lines.append(self.experts.all_to_all(self.subject.tokens(sizes), ep,
                                                     sb.residual, sb.tag()))
                how += (f"; ep={ep}: routing uniform, each rank's E/{ep} experts process "
                        f"the B·L·k token slots it receives, as many as in the replay")
            lines += act
            peak = self._peak(lines, estimate, per_unit, n, zero, sb, ep)
            # context-parallel ranks step the same shards as data-parallel ones (par.shard)
            if optimizer and optimizer_impl and ep == 1 and par.tp == 1:
                line, peak = optimizer_step(peak, lines, self.trainable_shapes, n, zero, sb,
                                            optimizer, optimizer_impl)
                lines.append(line)
        conditions = {"micro_batch": sizes.get("B") if sizes else None,
                      "sizes": self.subject.sizes_used(sizes), "seq_len": None,
                      "seq_len_per_rank": None,
                      "micro_batches": 1, "checkpointing": checkpointing, "dtype": dtype,
                      "mixed_precision": mixed, "precision": sb.name,
                      "state_bytes": sb.how, "sharded_over": n, "attention_kernel": kernel,
                      "replayed_as": device,
                      "activations": how, "loop": loop if sizes is not None else None,
                      "wrap_units": self.units.how,
                      "expert_parallel": self._expert_record(ep),
                      "model_states_by_zero": [
                          {"zero": z, "bytes": sum(line.bytes
                                                   for line in self._state_lines(n, z, sb, ep))}
                          for z in range(4)],
                      "model_states_from": f"the built model: {self.numel:,} parameters "
                                           f"({self.trainable:,} trainable)"}
        total = sum(line.bytes for line in lines)
        return Plan(par, 0, lines, [], [total], conditions, peak)

    def _check_splits(self, par: Parallel) -> None:
        refuse_model_splits(par)

    # --- the lines ------------------------------------------------------------------------

    def _expert_parallel(self, par: Parallel) -> int:
        """ep, checked against the model's experts."""
        if par.ep > 1 and self.experts is None:
            raise TfcliError(f"--parallel ep={par.ep}: the model has no experts to split (no "
                             f"module with an integer num_experts and [E, ...] parameters, no "
                             f"ModuleList named *experts*); drop ep")
        if par.ep > 1:
            self.experts.check(par.ep)
        return par.ep

    def _expert_record(self, ep: int) -> dict | None:
        if ep == 1:
            return None
        layers = self.experts.layers
        return {"ep": ep, "moe_layers": len(layers),
                "experts_per_rank": sorted({x.experts // ep for x in layers}),
                "experts": sorted({x.experts for x in layers}),
                "routing": "assumed uniform: each rank receives as many token slots as it sends"}

    def _holdings(self, n: int, ep: int) -> list:
        from tfcli.parallel.experts import Holding

        if ep > 1:
            return self.experts.holdings(n, ep)
        return [Holding("", self.numel, self.trainable, tuple(self.shapes),
                        tuple(self.trainable_shapes), n)]

    def _state_lines(self, n: int, zero: int, sb: Policy, ep: int = 1) -> list[Line]:
        holdings = self._holdings(n, ep)
        numel = sum(h.numel for h in holdings)
        trainable = sum(h.trainable for h in holdings)

        def split(sharded: bool, trainable_only: bool) -> str:
            if ep == 1:
                return ""
            parts = [f"{h.trainable if trainable_only else h.numel:,} {h.what}"
                     + (f" split {h.shard_over} way(s)" if sharded else "") for h in holdings]
            return (f"; the rank holds E/{ep} of each MoE layer's experts: {', '.join(parts)}"
                    + (" (the experts over the ranks that hold the same ones)" if sharded
                       else ""))

        def share(part, total: int, trainable_only: bool, of: str) -> Line:
            what, per = f"{sb.tag()} {part.what}", part.per_param
            if zero >= part.sharded_from and n > 1:
                local = sum(shard_numel(h.trainable_shapes if trainable_only else h.shapes,
                                        h.shard_over) for h in holdings)
                ways = f" {n} ways" if ep == 1 else ""
                return Line(part.name, local * per,
                            f"{what}: {per} B × {local:,} of {total:,} {of} (ZeRO-{zero}: each "
                            f"parameter's rows split{ways}, as FSDP2 shards"
                            + split(True, trainable_only) + ")", precision=sb.name)
            return Line(part.name, total * per, f"{what}: {per} B × {total:,} {of}"
                        + (" (replicated)" if n > 1 and ep == 1 else "")
                        + (f" ({split(False, trainable_only)[2:]})" if ep > 1 else ""),
                        precision=sb.name)

        frozen = numel - trainable
        lines = []
        for part in state_parts(sb, zero):
            if part.name == "weights":
                lines.append(share(part, numel, False, "parameters"))
                if frozen:
                    lines[-1].how += f"; {frozen:,} frozen: no gradients or optimizer state"
            else:
                lines.append(share(part, trainable, True, "trainable"))
        return lines

    def _buffer_lines(self, sb: Policy) -> list[Line]:
        if not self.buffer_numel:
            return []
        # cast with the model (deepspeed, megatron: model.half()), not by FSDP's policy
        per = sb.weights if sb.name in ("autocast", "fsdp-mixed") else 2
        return [Line("buffers", self.buffer_numel * per,
                     f"{sb.tag()} {self.buffer_numel:,} elements × {per} B, on every rank (FSDP "
                     f"and ZeRO shard parameters, not buffers)", precision=sb.name)]

    def _communication_lines(self, n: int, zero: int, sb: Policy, ep: int = 1) -> list[Line]:
        units = self.experts.rank_units(ep) if ep > 1 else self.units
        out, tag, g = [], sb.tag(), sb.gathered
        if zero == 3 and sb.name == "deepspeed":
            return deepspeed_zero3_lines(
                self.experts.largest_module(ep) if ep > 1 else self.largest_module, sb)
        largest = units.largest
        unit = largest.numel if largest else 0
        if zero == 3:
            out.append(Line("unsharded parameters", (units.root.numel + unit) * g,
                            f"{tag} FSDP2: the root unit ({units.root.numel:,}, kept gathered "
                            f"from forward to backward) + the largest layer unit ({unit:,}) × "
                            f"{g} B; units: {units.how}", "communication", sb.name))
        if zero == 3 and n > 1 and largest:
            trained = units.most_trained.trainable  # a unit's gradients (frozen: none)
            # the root's buffers: its rows padded to a multiple of N, as FSDP2 pads them
            root = shard_numel(units.root.shapes, n) * n
            grads = shard_numel(units.root.trainable_shapes, n) * n
            mixed = (f" (computed in {sb.half}, reduced in fp32)"
                     if sb.unit_grads != sb.reduced else "")
            out += [
                Line("all-gather buffer", unit * g,
                     f"{tag} the next layer unit gathered ahead (prefetch): {unit:,} × {g} B"
                     + (f"; as forward starts, the root's own all-gather output, {root:,} × "
                        f"{g} B, kept until the next all-gather is copied out (the peak's "
                        f"root's all-gather moment)" if root > unit else ""),
                     "communication", sb.name),
                Line("reduce-scatter buffer", max(trained, grads) * sb.reduced,
                     f"{tag} the largest copy of a unit's gradients to be reduced: "
                     + (f"the root's, when its backward is over, {grads:,} × {sb.reduced} B "
                        f"(a layer unit's: {trained:,})" if grads > trained
                        else f"a layer unit's, {trained:,} × {sb.reduced} B")
                     + mixed, "communication", sb.name),
                Line("unsharded root gradients", units.root.trainable * sb.unit_grads,
                     f"{tag} the root unit's gradients, {units.root.trainable:,} × "
                     f"{sb.unit_grads} B: FSDP2 reduce-scatters a unit's gradients when its "
                     f"backward is over, so the head's are held through every layer unit's "
                     f"backward and the embeddings' join them at the end", "communication",
                     sb.name),
            ]
        elif zero == 0 and n > 1:
            trainable = sum(h.trainable for h in self._holdings(n, ep))
            copy = 0 if sb.name == "megatron" else trainable * sb.grads
            out.append(Line("DDP gradient buckets", copy,
                            f"{tag} " + ("Megatron's DDP all-reduces the contiguous main-"
                                         "gradient buffer in place: no second copy" if not copy
                                         else "a second copy of the gradients in all-reduce "
                                         "buckets (DDP's default; 0 with "
                                         "gradient_as_bucket_view=True)"),
                            "communication", sb.name))
        return out

    def _activation_lines(self, estimate, checkpointing: str) -> tuple[list[Line], int]:
        """The activation lines, and one unit's kept bytes (for the peak's moments)."""
        saved = [sum(kinds.values()) for kinds in estimate.unit_saved]
        in_units = sum(saved)
        count = len(saved)
        kept, how, recomputed, what = kept_per_unit(estimate, checkpointing)
        out = [Line("activations: layers", sum(kept),
                    f"{count} unit(s): {how}" + (f"; largest {max(kept):,} B" if kept else ""),
                    "activations")]
        if any(recomputed):
            out.append(Line("activations: recomputed layer", max(recomputed),
                            f"the largest unit's {what}", "activations"))
        outside = sum(estimate.saved_bytes.values()) - in_units
        out.append(Line("activations: outside the units", outside,
                        "what the modules outside the units (embeddings, head, loss) saved "
                        "for backward in the replay", "activations"))
        out.append(Line(WORKING, max(estimate.peak_bytes - in_units - outside, 0),
                        "the replay's peak less every saved tensor: gradients in flight where "
                        + ("the embeddings' backward runs, after the units' (a tied head's "
                           "share, the embeddings' and their sum)"
                           if (estimate.end_peak or 0)
                           > (estimate.start_peak or estimate.peak_bytes)
                           else "backward starts (the loss's and the head's)")
                        + (f"; {estimate.held_output:,} B of it the model's output, held by "
                           f"the keep-output loop" if estimate.held_output else ""),
                        "activations"))
        return out, max(kept, default=0)

    def _peak(self, lines: list[Line], estimate, per_unit: int, n: int, zero: int,
              sb: Policy, ep: int = 1):
        """The step's moments. Without ZeRO-3, tfcli.parallel.plan.step_peak's; DeepSpeed's
        ZeRO-3 (module units, no root kept gathered) :meth:`_deepspeed_peak`'s. FSDP2, as
        fully_shard leaves the root (gathered from forward to backward) and its layer units
        (resharded after forward), in the order it runs them:

        - the root's all-gather as forward starts: FSDP2 keeps an all-gather's output until
          the next one is copied out, so the root's output is alive beside its gathered
          parameters while the first layer unit is gathered;
        - the loss's and the head's backward, the root alone gathered, every activation alive;
        - the layer units' backward, each unit gathered with the next one prefetched, its
          activations traded for its unsharded gradients; when a unit's backward is over its
          gradients are copied out to be reduce-scattered, and that copy is in flight while
          the next unit runs (on one rank too); the units done have left their sharded
          gradients, so with small activations or few ranks the last unit's backward holds
          the most;
        - the embeddings' backward, after every layer unit's;
        - the root's reduce-scatter, last: FSDP2 reduces a unit's gradients only when its
          whole backward is over, so the root's (the head's, the final norm's) are held
          unsharded through every layer unit's backward, and a weight tied to the embeddings
          collects the head's share and the embeddings' before they are summed.

        What autograd holds at each point is the replay's (``estimate``: where the units'
        backward begins and ends, tfcli.inspection.memory._UnitsBackward)."""
        from tfcli.parallel.plan import Peak

        peak = step_peak(lines, per_unit, False)
        if zero != 3:
            units = self.experts.rank_units(ep) if ep > 1 else self.units
            return self._replicated_peak(lines, estimate, peak, sb.grads if zero < 2 else 0,
                                         per_unit, units)
        if sb.name == "deepspeed":
            return self._deepspeed_peak(lines, per_unit, sb, ep, peak)
        units = self.experts.rank_units(ep) if ep > 1 else self.units
        root, largest = units.root, units.largest

        def shard(group) -> int:
            return (self.experts.unit_shard(group, n, ep) if ep > 1
                    else shard_numel(group.trainable_shapes, n))

        by = {line.name: line.bytes for line in lines}
        states = sum(line.bytes for line in lines if line.kind == "model states"
                     and line.name != "gradients")
        layers, outside = by["activations: layers"], by["activations: outside the units"]
        extra = by.get("activations: recomputed layer", 0)
        root_gathered = root.numel * sb.gathered
        root_grads = root.trainable * sb.unit_grads
        # every layer unit's sharded gradients, present once the layer units' backward is over
        # (none appear under Megatron's precision: its main gradients are one buffer kept
        # between steps, a model state counted from the start)
        made = "gradients" in by
        unit_shards = by["gradients"] - shard(root) * sb.grads if made else 0
        start, carried, late, after = self._backward_facts(estimate, by, root, sb)
        # FSDP2 keeps an all-gather's output until the next one is copied out
        unit_gathered = largest.numel * sb.gathered if largest else 0
        ahead = unit_gathered if n > 1 else 0
        # what the root's modules saved before the first layer unit runs: the embeddings',
        # or a whole encoder where the units are the decoder's layers
        before = sum(estimate.before_units.values())
        moments = {"root's all-gather": (states + root_gathered * (2 if n > 1 else 1)
                                         + unit_gathered + ahead + before),
                   # the last layer unit's all-gather output, from forward, is kept until
                   # backward's first all-gather is copied out
                   "loss backward": states + root_gathered + ahead + layers + outside + start}
        reduce = 0
        if largest:
            gathered = root_gathered + unit_gathered + ahead
            one = min(per_unit, layers)
            # the most a unit's backward adds to what is alive as it begins: its gradients,
            # kept, and its working set, as its activations go
            grows = (estimate.unit_excess if estimate.start_peak is not None
                     else max(largest.trainable * sb.unit_grads - one, 0))
            if ep > 1 and estimate.start_peak is not None:
                # the replay runs every expert; the gradients of those on other ranks are not
                # this rank's
                others = self.units.largest.trainable - largest.trainable
                grows = max(grows - others * sb.unit_grads, 0)
            # a layer unit's reduce-scatter copy, in flight while the next unit runs (made on
            # one rank too: FSDP2 copies the gradients out whatever the world)
            reduce = units.most_trained.trainable * sb.reduced
            held = states + gathered + layers + extra + carried + late
            moments["first unit's backward"] = held + grows
            count = len(units.groups)
            if count > 1:
                # the i-th unit after the first: i units' activations gone, their sharded
                # gradients present (with small activations or few ranks these outgrow what
                # was freed, so the last unit's is the largest); nothing is prefetched for the
                # last one (the first layer)
                moments["inside backward (FSDP)"] = max(
                    held + grows + reduce + i * (shard(largest) * sb.grads * made - one)
                    - (ahead if i == count - 1 else 0) for i in range(1, count))
        moments["embeddings' backward"] = states + unit_shards + root_gathered + after + reduce
        moments["root's reduce-scatter"] = (states + unit_shards + root_grads
                                            + shard(root) * n * sb.reduced)
        moment = max(moments, key=moments.__getitem__)
        how = ("the largest of these moments of a step with zero_grad(set_to_none=True) under "
               "FSDP2's default resharding (the root gathered from forward to backward, the "
               "layer units resharded after forward), in the order they come: the root's "
               "all-gather as forward starts (its all-gather output beside its gathered "
               "parameters, the first layer unit gathered and the next prefetched, and what "
               "the root's modules saved before it: embeddings, an encoder); the loss's "
               "backward (model states but the gradients, the root gathered, the last "
               "all-gather's output from forward, every activation, and the replay's working "
               "set until the units' backward); the "
               "first unit's backward (the head's activations gone; the root, one unit and "
               "the next, prefetched, gathered; the root's gradients made so far, held "
               "unsharded until its own backward is over; what autograd holds beside the "
               "units' activations, a tied weight's head share included; and the most a "
               "unit's backward adds in the replay, its unsharded gradients kept); inside "
               "backward (each later unit's, the largest of them: as many units' activations "
               "gone as units done and their sharded gradients present, the last one's "
               "reduce-scatter copy in flight, nothing prefetched for the last unit); the "
               "embeddings' backward (every unit's sharded gradients and the last "
               "reduce-scatter copy, the root gathered, its gradients and the replay's peak "
               "after the units: a tied weight's two shares and their sum); the root's "
               "reduce-scatter (its unsharded gradients and their copy, the root resharded)")
        return Peak(moments[moment], moment, moments, how)

    @staticmethod
    def _replicated_peak(lines: list[Line], estimate, peak, whole_grads: int, per_unit: int,
                         units: Units):
        """Without ZeRO-3 (DDP, ZeRO-1/2: every parameter whole on each rank), backward's end
        from the replay: every gradient made, beside what autograd still holds once the units'
        backward is over (the embeddings' saved tensors, the gradients in flight), where
        step_peak's formula keeps one layer's activations and everything the modules outside
        the units saved (the head's and the loss's too, freed first: 11 % high for a
        Transformers Llama of two layers at dp=1, against the single-device replay)."""
        from tfcli.parallel.plan import Peak

        if estimate.end_peak is None:
            return peak
        held = sum(line.bytes for line in lines
                   if line.kind != "activations" and line.name != "all-gather buffer")
        # The replay accumulates into gradients that exist before the step: its peak after
        # the units counts the gradient made there (the embeddings', a tied weight's sum) in
        # flight, which a line of whole gradients holds already (``whole_grads``: their bytes
        # each, 0 under ZeRO-2, whose line is a rank's partition; counted twice, a
        # Transformers GPT-2 of two layers with a tied vocabulary of 4,096 at B x L = 1 x 16
        # was 13 % above MemTracker's real CPU step)
        last = max((math.prod(shape) for shape in units.root.trainable_shapes), default=0)
        moments = {**peak.moments,
                   "backward end": held - last * whole_grads + estimate.end_peak}
        by = {line.name: line.bytes for line in lines}
        extra = by.get("activations: recomputed layer", 0)
        recomputing = ""
        if extra and estimate.start_peak is not None and units.groups:
            # Checkpointed units are recomputed in their own backward, after the loss's and
            # the head's: backward start holds none of them. The units' backward then makes
            # gradients where it frees only each unit's input, so it peaks at its last unit,
            # the first in forward: every gradient made by then (the head's and the other
            # units'), that unit's input and its recomputation, the most its backward adds
            # (its own gradients among them) and what autograd holds beside the units.
            # Both at once (every line) put a Transformers GPT-2 of two layers (vocabulary
            # 4,096, B x L = 4 x 64) 15.9 % above MemTracker's real CPU step; the loss's
            # backward alone is within 0.01 % of it, and a Transformers Llama's (B x L = 2 x
            # 64) last unit within 1.0 %.
            start = moments["backward start"]
            activations = sum(line.bytes for line in lines if line.kind == "activations")
            in_units = sum(sum(kinds.values()) for kinds in estimate.unit_saved)
            # the gradients made by then, a share of the gradients line (ZeRO-2's is one
            # rank's partition): all but the embeddings' (made after) and the unit's own (in
            # the most its backward adds)
            root = units.root
            trainable = root.trainable + sum(g.trainable for g in units.groups)
            unmade = (root.trainable - estimate.late_root_numel) + units.most_trained.trainable
            made = by.get("gradients", 0) * max(trainable - unmade, 0) // max(trainable, 1)
            layers = by.get("activations: layers", 0)
            moments["backward start"] = start - extra
            moments["last unit's backward"] = (
                start - activations + made + min(per_unit, layers) + extra
                + estimate.unit_excess + (estimate.start_live - in_units))
            recomputing = ("; with checkpointed units, backward start without a recomputed "
                           "unit (the loss's and the head's backward come first), and the last "
                           "unit's backward (the first in forward): every gradient made by "
                           "then, its input, its recomputation and the most its backward adds, "
                           "and what autograd holds beside the units' activations")
        moment = max(moments, key=moments.__getitem__)
        formula = ("backward end (every line but the all-gather buffer, one layer's "
                   "activations left)")
        assert formula in peak.how, peak.how  # step_peak's words, replaced by what is done here
        how = peak.how.replace(formula, (
            "backward end (every line but the activations and the all-gather buffer, and what "
            "the replay holds once the units' backward is over: the embeddings' saved tensors, "
            "the gradients in flight)")) + recomputing
        return Peak(moments[moment], moment, moments, how)

    @staticmethod
    def _backward_facts(estimate, by: dict, root, sb: Policy) -> tuple[int, int, int, int]:
        """From the replay, in bytes: the working set until the units' backward begins (the
        loss's and the head's gradients in flight); what autograd holds beside the units'
        activations when it begins; the root gradients FSDP2 holds from then on (the
        parameters whose gradients came before); what it holds at the peak after the units'
        backward beside the gathered root and the sharded gradients. Without units, the
        replay's working set stands for each."""
        if estimate.start_peak is None:
            working = by[WORKING]
            return working, by["activations: outside the units"] + working, 0, working
        start = estimate.start_peak - sum(estimate.saved_bytes.values())
        in_units = sum(sum(kinds.values()) for kinds in estimate.unit_saved)
        carried = estimate.start_live - in_units
        late = estimate.late_root_numel * sb.unit_grads
        if estimate.end_peak is None:
            return start, carried, late, late + by[WORKING]
        # The replay accumulates into gradients that exist before the step, so its peak after
        # the units counts only gradients in flight, where FSDP2 holds every root gradient
        # made so far: the late ones, or all of them less the one made at that peak (the
        # embeddings', or a tied weight's sum), which becomes a gradient itself.
        biggest = max((math.prod(shape) for shape in root.trainable_shapes), default=0)
        after = estimate.end_peak + max(late, (root.trainable - biggest) * sb.unit_grads)
        return start, carried, late, after

    def _deepspeed_peak(self, lines: list[Line], per_unit: int, sb: Policy, ep: int, peak):
        """DeepSpeed ZeRO-3 gathers and reduce-scatters one module's own parameters at a
        time: the loss's backward, the units' backward start (the working set still in
        flight) and inside backward (one unit's activations traded for the largest
        module's gradients), beside step_peak's backward end."""
        from tfcli.parallel.plan import Peak

        by = {line.name: line.bytes for line in lines}
        states = sum(line.bytes for line in lines if line.kind == "model states"
                     and line.name != "gradients")
        layers = by["activations: layers"]
        activations = layers + by["activations: outside the units"]
        extra = by.get("activations: recomputed layer", 0)
        gathered = by["unsharded parameters"] + by.get("all-gather buffer", 0)
        module = self.experts.largest_module(ep) if ep > 1 else self.largest_module
        moments = {
            "loss backward": states + activations + by[WORKING],
            "units' backward start": states + gathered + layers + extra + by[WORKING],
            "inside backward (FSDP)": (states + gathered + activations + extra
                                       - min(per_unit, layers) + module * sb.unit_grads
                                       + by.get("reduce-scatter buffer", 0)),
            "backward end": peak.moments["backward end"]}
        moment = max(moments, key=moments.__getitem__)
        how = ("the largest of these moments of a step with zero_grad(set_to_none=True), "
               "DeepSpeed ZeRO-3 gathering one module at a time: the loss's backward (model "
               "states but the gradients, every activation and the working set); the units' "
               "backward start (the head's activations gone, the working set still in "
               "flight, the largest module gathered); inside backward (one unit's "
               "activations less, the largest module's unsharded gradients and their "
               "reduce-scatter copy); backward end (every line but the all-gather buffer, "
               "one unit's activations left)")
        return Peak(moments[moment], moment, moments, how)


def kept_per_unit(estimate, checkpointing: str) -> tuple[list[int], str, list[int], str]:
    """What each unit keeps for backward under ``checkpointing``, and how, in words; and what
    each unit's recomputation holds while it runs in backward, and what that is."""
    from tfcli.inspection.memory import REPEATED

    saved = [sum(kinds.values()) for kinds in estimate.unit_saved]
    if checkpointing == "full":
        return (list(estimate.unit_inputs),
                "each unit's input (the tensors it is called with), kept; the rest recomputed",
                saved, "activations while it is recomputed for backward")
    if checkpointing == "selective":
        # the attention core (Megatron-LM's selective recomputation: Q·Kᵀ, softmax, dropout,
        # weights·V) run again in backward: what it saved goes, the tensors it is called
        # with stay (with grouped-query attention, the K/V heads before their copies)
        attention = [kinds.get("attention matrices", 0) for kinds in estimate.unit_saved]
        repeated = [kinds.get(REPEATED, 0) for kinds in estimate.unit_saved]
        sources = estimate.unit_core_inputs or [0] * len(saved)
        core = [a + r for a, r in zip(attention, repeated)]
        kept = [s - c + k for s, c, k in zip(saved, core, sources)]
        dropped = ["the attention matrices"] if any(attention) else []
        if any(repeated):
            dropped.append(f"the K/V heads copied for grouped-query attention "
                           f"({sum(repeated):,} B)")
        if dropped:
            how = (("its attention kernel keeps no attention matrices; " if not any(attention)
                    else "")
                   + f"what each unit saved for backward, less its attention core's "
                     f"({' and '.join(dropped)}; recomputed), plus what the core is called "
                     f"with that nothing else saved ({sum(sources):,} B: kept for it)")
        else:
            how = ("what each unit saved for backward: its attention kernel keeps no "
                   "attention matrices, so selective recomputation saves nothing here")
        # recomputed as its backward reaches the attention call, once what the unit saved
        # after that call (output projection, feed-forward) has been freed
        after = estimate.unit_after_attention or [0] * len(saved)
        what = ("attention core while it is recomputed for backward, less what the unit "
                "saved after it (freed by then)")
        return kept, how, [max(c - a, 0) for c, a in zip(core, after)], what
    return saved, "what each unit saved for backward in the replay", [0] * len(saved), ""


def per_rank(subject, parallel: str | None, batch: int, seq_len: int | None,
             micro_batches: int | None, sizes_at,
             checkpointing: str, dtype: str, mixed: str | None, optimizer_states: int,
             kernel: str, device_memory: str | None, fit_what: str | None,
             wrap: str | None, loop: str = "loss-only", precision: str = "autocast",
             device: str = "cpu", tp_plan: str | None = None,
             optimizer: str | None = None, optimizer_impl: str | None = None) -> dict:
    """:func:`tfcli.parallel.report.per_rank` for any subject: the plan at (batch, seq_len) as
    a dict, its headroom on ``device_memory``, and with ``fit_what`` the largest batch or
    length that fits. ``sizes_at(b, s)`` gives every letter's size; ``tp_plan``: --tp-plan's
    text (tfcli.parallel.tensor)."""
    from tfcli.inspection.fit import SEARCHED, fit, fit_length, parse_device_memory
    from tfcli.parallel.layout import parse_parallel
    from tfcli.parallel.report import FIT, check_request, fit_replays, steps_words

    par = parse_parallel(parallel) if parallel is not None else Parallel()
    refuse_model_splits(par, tensor=True)
    check_request(par, fit_what, device_memory, seq_len, micro_batches, dtype, mixed)
    check_context(subject, par, seq_len)
    subject.refuse_search(fit_what)
    capacity, board = parse_device_memory(device_memory) if device_memory else (None, None)
    if par.tp > 1:
        from tfcli.parallel.tensor import TensorParallelModel, sequence_parallel_asked

        traced = TensorParallelModel(subject, wrap, par, tp_plan,
                                     sequence_parallel_asked(parallel),
                                     sizes_at(1, seq_len // par.cp) if seq_len else None)
    elif tp_plan is not None:
        raise TfcliError("--tp-plan splits the model over tensor-parallel ranks: add tp=T "
                         "(T > 1) to --parallel")
    else:
        traced = TracedModel(subject, wrap, sizes_at(1, seq_len or subject.default_sizes["L"]))
    if (par.cp > 1 and getattr(traced, "sequence", False) and seq_len
            and seq_len // par.cp % par.tp):
        raise TfcliError(f"--seq-len {seq_len}: cp={par.cp} leaves each rank "
                         f"{seq_len // par.cp} positions, which sequence parallelism splits "
                         f"tp={par.tp} ways; give a multiple of {par.cp * par.tp}")
    positions = getattr(getattr(subject, "config", None), "max_position_embeddings", None)
    limit = positions if isinstance(positions, int) and positions > 0 else 1 << 20

    whole_fails = functools.lru_cache(maxsize=None)(
        lambda s: runs_whole(subject, sizes_at(1, s)) if par.cp > 1 else None)

    needs: dict[int, int] = {}  # what each batch or length the search tried needs

    def at(b: int, s: int | None) -> Plan:  # a context-parallel rank runs s / cp positions
        result = traced.plan(par, sizes_at(b, s // par.cp) if s is not None else None,
                             checkpointing, dtype, mixed, optimizer_states, kernel, loop,
                             precision, device, micro_batches, optimizer, optimizer_impl)
        needs[b if fit_what == "batch" else s] = result.need
        return result

    found = bound = refused_at = None
    step = searched_in = 1
    if fit_what == "batch":
        bound = 1 << 16
        found = fit(lambda b: at(b, seq_len).need, capacity, 1, bound)
        batch = found or 1
    elif fit_what == "seq-len":
        step = 64 if limit >= 256 else 1
        # lengths the context-parallel ranks, then the sequence-parallel ones, split evenly
        unit = par.cp * (par.tp if getattr(traced, "sequence", False) else 1)
        step = math.lcm(step, unit)
        if step > limit:
            raise TfcliError(f"--fit seq-len: the lengths searched are multiples of {step} "
                             f"(split evenly over the ranks), more than the configuration's "
                             f"max_position_embeddings={limit}; use fewer ranks on the "
                             f"sequence, or give --seq-len")
        bound = limit // step * step
        from tfcli.subjects.base import RunFailed

        def need(s: int) -> int:
            """A length the model refuses (its own limit, a position table; with cp the whole
            model is asked, whatever one rank replays) does not fit; why is kept."""
            why = whole_fails(s)
            if why is None:
                try:
                    return at(batch, s).need
                except RunFailed as error:
                    why = str(error)
            refused[s] = why
            return capacity + 1

        refused: dict[int, str] = {}
        found, searched_in = fit_length(need, capacity, step, unit, limit // step)
        if found is None and searched_in in refused:  # the model runs at no length tried
            raise RunFailed(refused[searched_in])
        above = [s for s in refused if found is not None and s > found]
        if above and min(above) <= found + searched_in:  # the model, not the device, stopped it
            refused_at = min(above)
        seq_len = found or searched_in  # nothing fits: the plan at the shortest length tried
    if seq_len and whole_fails(seq_len):
        from tfcli.subjects.base import RunFailed

        raise RunFailed(f"{whole_fails(seq_len)} (a forward pass of the whole model at "
                        f"L={seq_len}, B=1, on fake tensors: with cp={par.cp} each rank "
                        f"replays {seq_len // par.cp} positions, but the model is given the "
                        f"whole sequence)")
    from tfcli.subjects.base import RunFailed

    try:
        result = at(batch, seq_len)
    except RunFailed as error:
        if par.cp == 1 or not seq_len:
            raise
        raise TfcliError(f"--parallel cp={par.cp}: the model runs whole at L={seq_len} but "
                         f"not on one rank's {seq_len // par.cp} positions: {error}; it does "
                         f"not take its sequence split over context-parallel ranks (a "
                         f"position table or a fixed length sized to the whole); drop cp, "
                         f"or make it take a shard of the length") from None
    data = result.to_dict()
    data["world_size"] = par.world
    if not any(d in ("S", "T", "L") for d in subject.length_dims()):
        seq_len = None  # (a model without a sequence: its step was replayed at its own sizes)
    data["conditions"]["seq_len"] = seq_len
    data["conditions"]["seq_len_per_rank"] = seq_len // par.cp if seq_len else None
    if par.cp > 1 and seq_len and data["conditions"].get("activations"):
        data["conditions"]["activations"] += "; cp={}: {}".format(par.cp, CONTEXT_WORDS.format(
            local=seq_len // par.cp, whole=seq_len))
    if capacity is not None:
        data["device"] = {"name": board, "bytes": capacity,
                          "headroom_bytes": capacity - result.need,
                          "compared": "peak" if result.peak else "total",
                          "fits": result.need <= capacity}
    if fit_what is not None:
        assert fit_what in FIT
        data["fit"] = {"what": fit_what, "largest": found, "step": step, "bound": bound,
                       "at_bound": found == bound,
                       "below_step": fit_what == "seq-len" and searched_in < step,
                       "smallest": 1 if fit_what == "batch" else searched_in,  # tried
                       # the next length, refused by the model itself (None: memory decided)
                       "model_refused": (None if refused_at is None else
                                         {"seq_len": refused_at, "why": refused[refused_at]}),
                       "replays": fit_replays(needs),
                       "bound_is": ("the largest batch searched" if fit_what == "batch" else
                                    "the configuration's max_position_embeddings"
                                    + (f" ({limit:,}) rounded down to a multiple of {step}"
                                       if bound != limit else "")
                                    if limit == positions else
                                    "the plan's limit for a model without a known length "
                                    "limit"),
                       "searched": SEARCHED.format(what=fit_what)
                                   + (steps_words(step, unit) if fit_what == "seq-len"
                                      else "")}
    return data
