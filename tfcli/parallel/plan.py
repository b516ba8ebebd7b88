"""Per-rank training memory under data (DDP, ZeRO-1/2/3, FSDP), tensor (+ sequence), pipeline
and context parallelism, for tfcli's own configuration.

Conventions (printed beside every figure):

- Ψ is the parameters one rank owns before data-parallel sharding: tensor parallelism splits
  W_Q, W_K, W_V, W_1 (and W_gate) by columns and W_O, W_2 by rows (Megatron-LM, Shoeybi et al.
  2019), the token embeddings and output projection by vocabulary rows (vocabulary-parallel);
  norms, positions and row-parallel biases are replicated. Pipeline parallelism gives each stage
  a contiguous run of layers; the first stage holds the embeddings, the last the final norms and
  the output projection (with tied embeddings, a copy of them, as Megatron-LM keeps).
- Model states, ``tfcli`` convention: weights and gradients in the training dtype (fp32, also
  under autocast) plus k optimizer states (Adam: 2) — 16 B per parameter. N data-parallel ranks
  shard them: ZeRO-0 (DDP) 16Ψ; ZeRO-1 8Ψ + 8Ψ/N; ZeRO-2 4Ψ + 12Ψ/N; ZeRO-3 / FSDP 16Ψ/N.
  The ``zero-paper`` convention is Rajbhandari et al. 2020's mixed precision: 16-bit weights and
  gradients (2 + 2 B) and K = 12 B of optimizer state (fp32 master weights, momentum,
  variance): the same 16 B in total, but the fp32 master copy moves from "weights" to
  "optimizer state", so ZeRO-1 is 4Ψ + 12Ψ/N and ZeRO-2 2Ψ + 14Ψ/N.
- Activations: a fake-tensor replay (:func:`tfcli.inspection.memory.estimate_activations`) of
  one rank's share — heads, FFN width and vocabulary divided by t, length divided by C — at one
  and at two layers per stack; the difference is one layer, the rest is embeddings, output, loss
  and backward's working set. Beside it, Korthikanti et al. 2022 Table 2 (bytes per layer at 16
  bits) as the cross-check. Pipeline stage i keeps min(P - i, m) micro-batches in flight (1F1B).

The layout is :mod:`tfcli.parallel.layout`, the activations :mod:`tfcli.parallel.activations`,
"does it fit?" :mod:`tfcli.parallel.fit`. Nothing here imports torch except the replay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tfcli.parallel.activations import (activation_lines, cross_check, kept_per_layer,
                                    replay_share)
from tfcli.parallel.layout import (Line, Parallel, StageParams, parse_parallel,  # noqa: F401
                               stage_params)
from tfcli.errors import TfcliError
from tfcli.model.config import Config

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CHECKPOINTING = ("none", "selective", "full")
CONVENTIONS = ("tfcli", "zero-paper")

# --- model states under ZeRO ----------------------------------------------------------------


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state, and where they come from."""
    weights: int
    grads: int
    optimizer: int
    how: str


def state_bytes(dtype: str = "fp32", mixed: str | None = None, optimizer_states: int = 2,
                convention: str = "tfcli") -> StateBytes:
    if convention == "zero-paper":
        return StateBytes(2, 2, 4 + 4 * optimizer_states,
                          "Rajbhandari et al. 2020: 16-bit weights and gradients, fp32 master "
                          f"weights + {optimizer_states} fp32 optimizer states")
    wb = 4 if mixed else DTYPE_BYTES[dtype]
    name = f"fp32 (autocast {mixed} keeps fp32 weights)" if mixed else dtype
    return StateBytes(wb, wb, optimizer_states * wb,
                      f"{name} weights and gradients, {optimizer_states} optimizer states")

def model_state_lines(psi: int, n: int, zero: int, sb: StateBytes) -> list[Line]:
    """Weights, gradients and optimizer state of Ψ parameters on one of N sharding ranks."""
    def share(per_param: int, sharded: bool, what: str) -> Line:
        if sharded and n > 1:
            return Line(what, math.ceil(psi * per_param / n),
                        f"{per_param}Ψ/N = {per_param} B × {psi:,} / {n} (ZeRO-{zero})")
        return Line(what, psi * per_param, f"{per_param}Ψ = {per_param} B × {psi:,}"
                    + (" (replicated)" if n > 1 else ""))

    return [share(sb.weights, zero >= 3, "weights"),
            share(sb.grads, zero >= 2, "gradients"),
            share(sb.optimizer, zero >= 1, "optimizer state")]

# --- when the peak happens ------------------------------------------------------------------
#
# The lines are everything a rank holds at some moment of the step; they are not all alive at
# once. With zero_grad(set_to_none=True), PyTorch's default, backward trades activations for
# gradients layer by layer, so without FSDP a step's memory peaks where backward starts (every
# activation alive, no gradient yet) or where it ends (every gradient alive, one layer's
# activations left). FSDP adds a moment inside backward: one layer unit's unsharded gradients
# being computed while the previous unit's reduce-scatter and the next unit's all-gather are in
# flight. The model takes the largest of these moments.
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
         mixed: str | None = None, optimizer_states: int = 2, convention: str = "tfcli",
         kernel: str = "auto", loop: str = "loss-only") -> Plan:
    """Per-rank memory of one training step. ``batch`` is the micro-batch per data-parallel rank
    (b), ``seq_len`` the full sequence (s; each context-parallel rank holds s/C); without them
    only model states and parameter buffers are given."""
    if checkpointing not in CHECKPOINTING:
        raise TfcliError(f"--checkpointing {checkpointing!r}: allowed: {', '.join(CHECKPOINTING)}")
    if convention not in CONVENTIONS:
        raise TfcliError(f"convention {convention!r}: allowed: {', '.join(CONVENTIONS)}")
    m = micro_batches if micro_batches is not None else par.pp
    if m < 1:
        raise TfcliError(f"--micro-batches {m}: must be a positive integer")
    stages = stage_params(cfg, par)
    sb = state_bytes(dtype, mixed, optimizer_states, convention)
    n = par.shard
    s_local = -(-seq_len // par.cp) if seq_len else 0
    if seq_len and seq_len % par.cp:
        raise TfcliError(f"--seq-len {seq_len} is not divisible by cp={par.cp}")
    e = 2 if mixed else DTYPE_BYTES[dtype]  # bytes per activation element
    t = par.tp

    rep = None
    if batch and seq_len:
        if par.pp == 1:
            depth = (cfg.n_encoder_layers, cfg.n_decoder_layers)
        else:  # the deepest stage, its layers shared between the stacks
            per_stack = -(-stages[0].layers // (cfg.has_encoder + cfg.has_decoder))
            depth = (per_stack, per_stack)
        rep = replay_share(cfg, t, batch, s_local, dtype, mixed, kernel, depth, loop)

    results = []
    for st in stages:
        lines = model_state_lines(st.total, n, par.zero, sb)
        lines[0].how = f"Ψ = {st.total:,} on this rank ({_split_text(par, st)}); " + lines[0].how
        lines += _buffer_lines(cfg, par, st, sb, batch, s_local, e)
        if rep is not None:
            lines += activation_lines(cfg, par, st, rep, batch, s_local, m, checkpointing, e)
        results.append(lines)
    totals = [sum(line.bytes for line in lines) for lines in results]
    peaks = None
    if rep is not None:
        kept, _ = kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
        peaks = [step_peak(lines, kept, par.pp > 1,
                           st.largest_layer * sb.grads if par.zero == 3 else 0,
                           math.ceil(st.largest_layer * sb.grads / n) if par.zero == 3 else 0)
                 for lines, st in zip(results, stages)]
    need = [p.bytes for p in peaks] if peaks else totals
    worst = max(range(len(need)), key=need.__getitem__)
    cross = []
    if rep is not None:
        cross = cross_check(cfg, par, stages[worst], rep, batch, s_local, m, checkpointing, e,
                            kernel, f"autocast {mixed}" if mixed else dtype)
    conditions = {"micro_batch": batch, "seq_len": seq_len, "seq_len_per_rank": s_local or None,
                  "micro_batches": m, "checkpointing": checkpointing, "dtype": dtype,
                  "mixed_precision": mixed, "convention": convention, "state_bytes": sb.how,
                  "sharded_over": n, "attention_kernel": kernel,
                  "activations": rep.how if rep else None, "loop": loop if rep else None}
    return Plan(par, worst, results[worst], cross, totals, conditions,
                peaks[worst] if peaks else None)


def _split_text(par: Parallel, st: StageParams) -> str:
    parts = []
    if par.tp > 1:
        parts.append(f"attention and FFN matrices and vocabulary split {par.tp} ways")
    if par.pp > 1:
        parts.append(f"stage {st.stage} of {par.pp}: {st.layers} layers"
                     + (", embeddings" if st.stage == 0 else "")
                     + (", output" if st.stage == par.pp - 1 else ""))
    return "; ".join(parts) or "the whole model"


def _buffer_lines(cfg: Config, par: Parallel, st: StageParams, sb: StateBytes,
                  batch: int | None, s_local: int, e: int) -> list[Line]:
    """Communication buffers whose size is known from the layout."""
    n, out = par.shard, []
    if par.zero == 3:
        unit = st.largest_layer
        out.append(
            Line("unsharded parameters", (st.root + unit) * sb.weights,
                 f"FSDP2: the root unit ({st.root:,}, kept gathered from forward to backward) + "
                 f"the largest layer unit ({unit:,}) × {sb.weights} B", "communication"))
    if par.zero == 3 and n > 1:
        out += [
            Line("all-gather buffer", unit * sb.weights,
                 f"the next layer unit gathered ahead (prefetch): {unit:,} × {sb.weights} B",
                 "communication"),
            Line("reduce-scatter buffer", unit * sb.grads,
                 f"one layer unit's unsharded gradients: {unit:,} × {sb.grads} B",
                 "communication"),
        ]
    elif par.zero == 0 and n > 1:
        out.append(Line("DDP gradient buckets", st.total * sb.grads,
                        "a second copy of the gradients in all-reduce buckets (DDP's default; "
                        "0 with gradient_as_bucket_view=True)", "communication"))
    if par.pp > 1 and batch and s_local:
        size = batch * s_local * cfg.d_model * e // (par.tp if par.sp and par.tp > 1 else 1)
        out.append(Line("pipeline send/recv", 2 * size,
                        f"one activation received and one sent: 2 × b·s·d_model × {e} B",
                        "communication"))
    return out
