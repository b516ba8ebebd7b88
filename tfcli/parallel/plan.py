"""Per-rank training memory under data (DDP, ZeRO-1/2/3, FSDP), tensor (+ sequence), pipeline
and context parallelism, for tfcli's own configuration.

Conventions (printed beside every figure):

- Ψ is the parameters one rank owns before data-parallel sharding: tensor parallelism splits
  W_Q, W_K, W_V, W_1 (and W_gate) by columns and W_O, W_2 by rows (Megatron-LM, Shoeybi et al.
  2019), the token embeddings and output projection by vocabulary rows (vocabulary-parallel);
  norms, positions and row-parallel biases are replicated. Pipeline parallelism gives each stage
  a contiguous run of layers; the first stage holds the embeddings, the last the final norms and
  the output projection (with tied embeddings, a copy of them, as Megatron-LM keeps).
- Model states follow one precision policy (:mod:`tfcli.parallel.precision`: autocast,
  fsdp-mixed, zero-paper, deepspeed, megatron), named on every line it shapes; N data-parallel
  ranks shard them. Autocast (the default): 16 B per parameter, ZeRO-0 (DDP) 16Ψ; ZeRO-1
  8Ψ + 8Ψ/N; ZeRO-2 4Ψ + 12Ψ/N; ZeRO-3 / FSDP 16Ψ/N. Rajbhandari et al. 2020's accounting
  (zero-paper): (2 + 2 + K)Ψ, K = 12: ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N.
- Activations: a fake-tensor replay (:func:`tfcli.inspection.memory.estimate_activations`) of
  one rank's share — heads, FFN width and vocabulary divided by t, length divided by C — at one
  and at two layers per stack; the difference is one layer, the rest is embeddings, output, loss
  and backward's working set. Beside it, Korthikanti et al. 2022 Table 2 (bytes per layer at 16
  bits) as the cross-check. Pipeline stage i keeps min(P - i, m) micro-batches in flight (1F1B).

The layout is :mod:`tfcli.parallel.layout`, the activations :mod:`tfcli.parallel.activations`,
"does it fit?" :mod:`tfcli.inspection.fit`. Nothing here imports torch except the replay and
:func:`largest_module`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from tfcli.parallel.activations import (activation_lines, cross_check, kept_per_layer,
                                    replay_share)
from tfcli.parallel.layout import (Line, Parallel, StageParams, parse_parallel,  # noqa: F401
                               stage_params)
from tfcli.parallel.precision import (Policy, check_stage, policy,  # noqa: F401
                                      state_parts, stage_totals)
from tfcli.errors import TfcliError
from tfcli.model.config import Config

CHECKPOINTING = ("none", "selective", "full")

# --- model states under ZeRO ----------------------------------------------------------------


def model_state_lines(psi: int, n: int, zero: int, pol: Policy) -> list[Line]:
    """Weights, gradients, (fp32 gradients, master weights,) optimizer state of Ψ parameters on
    one of N sharding ranks, as precision policy ``pol`` keeps them; each line names it."""
    def share(part) -> Line:
        per = part.per_param
        if zero >= part.sharded_from and n > 1:
            return Line(part.name, math.ceil(psi * per / n),
                        f"{pol.tag()} {part.what}: {per}Ψ/N = {per} B × {psi:,} / {n} "
                        f"(ZeRO-{zero})", precision=pol.name)
        return Line(part.name, psi * per, f"{pol.tag()} {part.what}: {per}Ψ = {per} B × "
                    f"{psi:,}" + (" (replicated)" if n > 1 else ""), precision=pol.name)

    return [share(part) for part in state_parts(pol, zero)]


def stage_states(psi: int, n: int, pol: Policy) -> list[dict]:
    """Model states per rank at every ZeRO stage (the comparison Rajbhandari et al.'s Figure 1
    draws), for the plan's record."""
    return [{"zero": zero, "bytes": b} for zero, b in stage_totals(psi, n, pol).items()]

# --- when the peak happens ------------------------------------------------------------------
#
# The lines are everything a rank holds at some moment of the step; they are not all alive at
# once. With zero_grad(set_to_none=True), PyTorch's default, backward trades activations for
# gradients layer by layer, so without FSDP a step's memory peaks where backward starts (every
# activation alive, no gradient yet) or where it ends (every gradient alive, one layer's
# activations left). FSDP adds a moment inside backward: one layer unit's unsharded gradients
# being computed while the previous unit's reduce-scatter and the next unit's all-gather are in
# flight. The model takes the largest of these moments. FSDP over data parallelism alone
# (zero=3, no tp, pp or cp) is taken in FSDP2's own order instead (_fsdp_peak), as for a
# --model: the three moments were up to 14 % above FSDPMemTracker's peak there.
_AT_START = {"all-gather buffer", "activations: layers"}
_AT_END = {"gradients", "reduce-scatter buffer"}


@dataclass(frozen=True)
class Peak:
    bytes: int
    moment: str  # "backward start" | "inside backward (FSDP)" | "backward end"
    moments: dict  # every moment modelled: bytes
    how: str


def step_peak(lines: list[Line], per_layer: int, pipelined: bool,
              unit_grads: int = 0, unit_shard: int = 0) -> Peak:
    """The moments above over ``lines``. ``per_layer`` is one layer's activations (what the end
    of backward has left; what the FSDP moment has already freed); ``unit_grads`` the unsharded
    gradients of the largest FSDP layer unit (0 without FSDP) and ``unit_shard`` its sharded
    gradients. Under pipelining micro-batches accumulate gradients while others still hold
    activations: gradients count at every moment."""
    start = end = 0
    bytes_of = {line.name: line.bytes for line in lines}
    for line in lines:
        at_start = line.name not in _AT_END or (pipelined and line.name == "gradients")
        start += line.bytes if at_start else 0
        end += line.bytes if line.name not in _AT_START else 0
    layers = bytes_of.get("activations: layers", 0)
    end += min(per_layer, layers)
    moments = {"backward start": start, "backward end": end}
    if unit_grads:
        moments["inside backward (FSDP)"] = (start - min(per_layer, layers) + unit_grads
                                             + bytes_of.get("reduce-scatter buffer", 0)
                                             + (0 if pipelined else unit_shard))
    moment = max(moments, key=moments.__getitem__)
    how = ("the largest of these moments of a step with zero_grad(set_to_none=True): backward "
           "start (every line but the gradients" + ("" if pipelined else " and the "
                                                    "reduce-scatter buffer")
           + "); backward end (every line but the all-gather buffer, one layer's activations "
           "left)" + ("; inside backward, FSDP (backward start less one layer's activations, "
                      "plus one layer unit's unsharded and sharded gradients and the "
                      "reduce-scatter buffer)" if unit_grads else "")
           + ("; 1F1B micro-batches keep accumulating gradients" if pipelined else ""))
    return Peak(moments[moment], moment, moments, how)


def stepped_shapes(shapes, n: int, zero: int) -> tuple[tuple[int, ...], ...]:
    """The shapes of what rank 0's optimizer steps: every parameter without ZeRO, else its
    shard of each, the first dim-0 chunk of n (as FSDP2's fully_shard splits a parameter)."""
    return tuple(tuple(shape) if zero == 0 or not shape else (-(-shape[0] // n), *shape[1:])
                 for shape in shapes)


def optimizer_step(peak: Peak, lines: list[Line], shapes, n: int, zero: int, pol: Policy,
                   optimizer: str, impl: str) -> tuple[Line, Peak]:
    """The optimizer's step, a moment of its own after backward: every model-state line
    (weights, gradients, states, master copies) and what ``optimizer.step()`` holds above them,
    its temporaries, replayed on fake tensors (tfcli.inspection.memory.optimizer_temporaries)
    over what this rank steps: the parameters of ``shapes``, or with ZeRO (``zero`` ≥ 1) the
    rank's shard of each (its dim-0 chunk, as FSDP2 shards; ZeRO-1/2 partitions differ in
    shape, not in total, which is what foreach's temporaries follow). Activations, gathered
    units and communication buffers are gone by then. Returns the temporaries' line and the
    peak with the moment added."""
    from tfcli.inspection.memory import _IMPL_WORDS, optimizer_temporaries

    stepped = stepped_shapes(shapes, n, zero)
    dtype = "fp32" if pol.master or pol.weights == 4 else (pol.half or "bf16")
    temporaries = optimizer_temporaries(stepped, dtype, optimizer, impl)
    whose = ("this rank's shard of each parameter (its dim-0 chunk of " + str(n) + ")"
             if zero else "every parameter")
    line = Line("optimizer step temporaries", temporaries,
                f"{optimizer}.step(), {impl}: {_IMPL_WORDS[impl]}; over {whose} in {dtype}, "
                f"fake-tensor replay of the optimizer alone", "working memory")
    states = sum(x.bytes for x in lines if x.kind == "model states")
    moments = {**peak.moments, "optimizer step": states + temporaries}
    moment = max(moments, key=moments.__getitem__)
    how = (peak.how + "; the optimizer's step (every model-state line and the step's "
           "temporaries, activations and gathered units gone)")
    return line, Peak(moments[moment], moment, moments, how)


@dataclass
class Plan:
    parallel: Parallel
    stage: int  # the stage reported (the one with the most memory)
    lines: list[Line]
    cross_check: list[Line]  # Korthikanti et al. per layer and for the stage, 16 bits
    stage_totals: list[int]
    conditions: dict = field(default_factory=dict)
    peak: Peak | None = None  # when activations are known

    @property
    def total(self) -> int:
        """The sum of the lines: what the rank holds if everything were alive at once."""
        return sum(line.bytes for line in self.lines)

    @property
    def need(self) -> int:
        """What must fit: the peak where it is modelled, else the sum of the lines."""
        return self.peak.bytes if self.peak else self.total

    def to_dict(self) -> dict:
        return {"parallel": self.parallel.__dict__ | {"world_size": self.parallel.world},
                "stage": self.stage, "total_bytes": self.total,
                "peak": None if self.peak is None else self.peak.__dict__,
                "stage_totals": self.stage_totals,
                "memory": [line.record() for line in self.lines],
                "cross_check": [line.record() for line in self.cross_check],
                "conditions": self.conditions}


def plan(cfg: Config, par: Parallel, batch: int | None = None, seq_len: int | None = None,
         micro_batches: int | None = None, checkpointing: str = "none", dtype: str = "fp32",
         mixed: str | None = None, optimizer_states: int = 2, precision: str = "autocast",
         kernel: str = "auto", loop: str = "loss-only", device: str = "cpu",
         optimizer: str | None = None, optimizer_impl: str | None = None) -> Plan:
    """Per-rank memory of one training step. ``batch`` is the micro-batch per data-parallel rank
    (b), ``seq_len`` the full sequence (s; each context-parallel rank holds s/C); without them
    only model states and parameter buffers are given. ``precision`` names the policy
    (tfcli.parallel.precision) every line follows. ``optimizer`` and ``optimizer_impl``
    (data and context parallelism alone: no tp, pp) add the optimizer's step as a moment."""
    if checkpointing not in CHECKPOINTING:
        raise TfcliError(f"--checkpointing {checkpointing!r}: allowed: {', '.join(CHECKPOINTING)}")
    if par.ep > 1:
        raise TfcliError(f"--parallel ep={par.ep}: tfcli's own model has no experts to split "
                         f"(expert parallelism is computed for a --model with mixture-of-experts "
                         f"layers, e.g. hf: Mixtral, Qwen2-MoE, DeepSeek); drop ep")
    pol = policy(precision, dtype, mixed, optimizer_states)
    check_stage(pol, par.zero)
    m = micro_batches if micro_batches is not None else par.pp
    if m < 1:
        raise TfcliError(f"--micro-batches {m}: must be a positive integer")
    stages = stage_params(cfg, par)
    n = par.shard
    s_local = -(-seq_len // par.cp) if seq_len else 0
    if seq_len and seq_len % par.cp:
        raise TfcliError(f"--seq-len {seq_len} is not divisible by cp={par.cp}")
    e = pol.residual  # bytes per element of the residual stream: layer inputs, stage sends
    t = par.tp

    rep = None
    if batch and seq_len:
        if par.pp == 1:
            depth = (cfg.n_encoder_layers, cfg.n_decoder_layers)
        else:  # the deepest stage, its layers shared between the stacks
            per_stack = -(-stages[0].layers // (cfg.has_encoder + cfg.has_decoder))
            depth = (per_stack, per_stack)
        rep = replay_share(cfg, t, batch, s_local, pol.run_dtype, pol.autocast, kernel, depth,
                           loop, device)

    module = largest_module(cfg, t) if pol.name == "deepspeed" and par.zero == 3 else 0
    results = []
    for st in stages:
        lines = model_state_lines(st.total, n, par.zero, pol)
        lines[0].how = f"Ψ = {st.total:,} on this rank ({_split_text(par, st)}); " + lines[0].how
        lines += _buffer_lines(cfg, par, st, pol, batch, s_local, e, module)
        if rep is not None:
            lines += activation_lines(cfg, par, st, rep, batch, s_local, m, checkpointing, e)
        results.append(lines)
    totals = [sum(line.bytes for line in lines) for lines in results]
    peaks = None
    if rep is not None:
        kept, _ = kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
        peaks = []
        for lines, st in zip(results, stages):
            unit = module or st.largest_layer
            peaks.append(step_peak(lines, kept, par.pp > 1,
                                   unit * pol.unit_grads if par.zero == 3 else 0,
                                   math.ceil(unit * pol.grads / n) if par.zero == 3 else 0))
        if par.zero == 3 and not module and par.tp == par.pp == par.cp == 1:
            peaks = [_fsdp_peak(cfg, par, batch, seq_len, checkpointing, dtype, mixed,
                                optimizer_states, precision, kernel, loop, device)]
        # context-parallel ranks step the same shards as data-parallel ones (par.shard)
        if optimizer and optimizer_impl and par.tp == par.pp == 1:
            line, peaks[0] = optimizer_step(peaks[0], results[0], _trainable_shapes(cfg), n,
                                            par.zero, pol, optimizer, optimizer_impl)
            results[0].append(line)
            totals[0] += line.bytes
    need = [p.bytes for p in peaks] if peaks else totals
    worst = max(range(len(need)), key=need.__getitem__)
    cross = []
    if rep is not None:
        cross = cross_check(cfg, par, stages[worst], rep, batch, s_local, m, checkpointing, e,
                            kernel, f"autocast {pol.autocast}" if pol.autocast else
                            f"{pol.run_dtype}, {pol.name}" if pol.half else pol.run_dtype)
    conditions = {"micro_batch": batch, "seq_len": seq_len, "seq_len_per_rank": s_local or None,
                  "micro_batches": m, "checkpointing": checkpointing, "dtype": dtype,
                  "mixed_precision": mixed, "precision": pol.name, "state_bytes": pol.how,
                  "sharded_over": n, "attention_kernel": kernel, "replayed_as": device,
                  "activations": rep.how if rep else None, "loop": loop if rep else None,
                  "model_states_by_zero": stage_states(stages[worst].total, n, pol)}
    return Plan(par, worst, results[worst], cross, totals, conditions,
                peaks[worst] if peaks else None)


def _fsdp_peak(cfg: Config, par: Parallel, batch: int, seq_len: int, checkpointing: str,
               dtype: str, mixed: str | None, optimizer_states: int, precision: str,
               kernel: str, loop: str, device: str) -> Peak:
    """FSDP2 over data parallelism alone (no tp, pp, cp): the peak in the order FSDP2 runs the
    step, as the traced plan of a --model finds it (tfcli.parallel.traced.TracedModel._peak:
    the root's all-gather, the loss's backward, each layer unit's backward with its gradients
    and reduce-scatter copy, the embeddings' backward, the root's reduce-scatter), over a
    replay of the whole model with one unit per layer and the root, as FSDP2 is applied to
    it. Within 0.02 % of FSDPMemTracker's peak for decoder-only configurations (tested), where
    step_peak's three moments, which do not follow that order, were up to 14 % above it;
    encoder-decoder and encoder-only ones within 5 % (README)."""
    sizes = {"B": batch, "S": seq_len, "T": seq_len, "L": seq_len}
    traced = _own_traced(cfg).plan(par, sizes, checkpointing, dtype, mixed, optimizer_states,
                                   kernel, loop, precision, device)
    return traced.peak


@functools.lru_cache(maxsize=8)
def _trainable_shapes(cfg: Config) -> tuple[tuple[int, ...], ...]:
    from tfcli.subjects.own import OwnSubject

    model = OwnSubject(cfg).build("meta")
    return tuple(tuple(p.shape) for p in model.parameters() if p.requires_grad)


@functools.lru_cache(maxsize=8)
def _own_traced(cfg: Config):
    """tfcli's own model as the traced plan sees a --model, with every layer of every stack a
    wrap unit (as tfcli.parallel.measure.fsdp_fake_memory shards it)."""
    from tfcli.parallel.traced import TracedModel
    from tfcli.parallel.units import Units, group
    from tfcli.subjects.own import OwnSubject, layers

    class OwnLayers(TracedModel):
        _units_of = staticmethod(layers)  # the function itself: its replays are remembered

        def _survey(self, model) -> None:
            super()._survey(model)
            seen: set[int] = set()
            modules = layers(model)
            stacks = [name for name in ("encoder", "decoder")
                      if getattr(model, name) is not None]
            groups = [group(f"layer {i}", m.parameters(), seen) for i, m in enumerate(modules)]
            self.units = Units(modules, groups, group("root", model.parameters(), seen),
                               f"every layer of the {' and '.join(stacks)}: {len(modules)} "
                               f"units, as FSDP2 is applied to tfcli's model")

    return OwnLayers(OwnSubject(cfg))


@functools.lru_cache(maxsize=16)
def largest_module(cfg: Config, t: int = 1) -> int:
    """The most parameters one module holds itself (not its children's) in one tensor-parallel
    rank's share: the unit DeepSpeed's ZeRO-3 gathers (each module's own parameters, as it
    runs), and the "largest layer" of its estimate_zero3_model_states_mem_needs. Built on
    meta."""
    from tfcli.parallel.activations import share_config
    from tfcli.subjects.own import OwnSubject

    model = OwnSubject(share_config(cfg, t, 1, 1)).build("meta")
    return max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())


def _split_text(par: Parallel, st: StageParams) -> str:
    parts = []
    if par.tp > 1:
        parts.append(f"attention and FFN matrices and vocabulary split {par.tp} ways")
    if par.pp > 1:
        parts.append(f"stage {st.stage} of {par.pp}: {st.layers} layers"
                     + (", embeddings" if st.stage == 0 else "")
                     + (", output" if st.stage == par.pp - 1 else ""))
    return "; ".join(parts) or "the whole model"


def deepspeed_zero3_lines(module: int, pol: Policy) -> list[Line]:
    """DeepSpeed ZeRO-3's communication lines: it gathers (and reduce-scatters the gradients
    of) one module's own parameters at a time, the largest ``module`` at the peak."""
    tag, g = pol.tag(), pol.gathered
    return [Line("unsharded parameters", module * g,
                 f"{tag} DeepSpeed ZeRO-3 gathers each module's own parameters as it runs: "
                 f"the largest module ({module:,}) × {g} B; prefetch "
                 f"(stage3_prefetch_bucket_size) not counted, as DeepSpeed's estimate",
                 "communication", pol.name),
            Line("reduce-scatter buffer", module * pol.reduced,
                 f"{tag} the largest module's unsharded gradients: {module:,} × "
                 f"{pol.reduced} B", "communication", pol.name)]


def _buffer_lines(cfg: Config, par: Parallel, st: StageParams, pol: Policy,
                  batch: int | None, s_local: int, e: int, module: int = 0) -> list[Line]:
    """Communication buffers whose size is known from the layout; ``module``: the largest
    module, DeepSpeed ZeRO-3's unit (0: FSDP's layer units)."""
    n, out = par.shard, []
    tag, g = pol.tag(), pol.gathered
    if par.zero == 3 and module:
        return deepspeed_zero3_lines(module, pol)
    if par.zero == 3:
        unit = st.largest_layer
        out.append(
            Line("unsharded parameters", (st.root + unit) * g,
                 f"{tag} FSDP2: the root unit ({st.root:,}, kept gathered from forward to "
                 f"backward) + the largest layer unit ({unit:,}) × {g} B", "communication",
                 pol.name))
    if par.zero == 3 and n > 1:
        out += [
            Line("all-gather buffer", unit * g,
                 f"{tag} the next layer unit gathered ahead (prefetch): {unit:,} × {g} B",
                 "communication", pol.name),
            Line("reduce-scatter buffer", unit * pol.reduced,
                 f"{tag} one layer unit's unsharded gradients: {unit:,} × {pol.reduced} B"
                 + (f" (computed in {pol.half}, reduced in fp32)"
                    if pol.unit_grads != pol.reduced else ""), "communication", pol.name),
        ]
    elif par.zero == 0 and n > 1 and pol.name == "megatron":
        out.append(Line("DDP gradient buckets", 0, f"{tag} Megatron's DDP all-reduces the "
                        f"contiguous main-gradient buffer in place: no second copy",
                        "communication", pol.name))
    elif par.zero == 0 and n > 1:
        out.append(Line("DDP gradient buckets", st.total * pol.grads,
                        f"{tag} a second copy of the gradients in all-reduce buckets (DDP's "
                        f"default; 0 with gradient_as_bucket_view=True)", "communication",
                        pol.name))
    if par.pp > 1 and batch and s_local:
        size = batch * s_local * cfg.d_model * e // (par.tp if par.sp and par.tp > 1 else 1)
        out.append(Line("pipeline send/recv", 2 * size,
                        f"{tag} one activation received and one sent: 2 × b·s·d_model × {e} B "
                        f"(the residual stream)", "communication", pol.name))
    return out
