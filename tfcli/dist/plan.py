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

Nothing here imports torch except the replay.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Callable

from tfcli.errors import TfcliError, did_you_mean
from tfcli.model.config import Config

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CHECKPOINTING = ("none", "selective", "full")
CONVENTIONS = ("tfcli", "zero-paper")
_KEYS = ("dp", "zero", "tp", "pp", "cp", "sp")


# --- the layout ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel ranks N (ZeRO/FSDP shard over dp · cp)
    zero: int = 0  # 0: DDP; 1: optimizer state; 2: + gradients; 3: + weights (FSDP)
    tp: int = 1  # tensor-parallel ranks t
    pp: int = 1  # pipeline stages P
    cp: int = 1  # context-parallel ranks C (the sequence is split C ways)
    sp: bool = True  # sequence parallelism beside tensor parallelism (Megatron-LM's default pairing)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """Ranks that ZeRO/FSDP shard model states over: data and context parallel ranks hold
        the same parameters (as Megatron-LM's distributed optimizer and torchtitan's FSDP)."""
        return self.dp * self.cp

    def text(self) -> str:
        out = f"dp={self.dp},zero={self.zero},tp={self.tp},pp={self.pp},cp={self.cp}"
        return out + (f",sp={int(self.sp)}" if self.tp > 1 else "")


def parse_parallel(text: str) -> Parallel:
    """``dp=8,zero=3,tp=2`` (any subset of dp, zero, tp, pp, cp, sp; the rest 1, zero 0, sp 1)."""
    values: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise TfcliError(f"--parallel {text!r}: expected key=value items, e.g. "
                             f"--parallel dp=8,zero=3,tp=2")
        if key not in _KEYS:
            raise TfcliError(f"--parallel: unknown key {key!r}{did_you_mean(key, _KEYS)}; "
                             f"allowed: {', '.join(_KEYS)}")
        if key in values:
            raise TfcliError(f"--parallel: {key} is given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise TfcliError(f"--parallel: {key}={raw.strip()!r} must be an integer") from None
    if not values:
        raise TfcliError(f"--parallel {text!r}: expected e.g. dp=8,zero=3,tp=2")
    for key, value in values.items():
        if key == "zero" and value not in (0, 1, 2, 3):
            raise TfcliError(f"--parallel: zero={value} must be 0, 1, 2 or 3")
        if key == "sp" and value not in (0, 1):
            raise TfcliError(f"--parallel: sp={value} must be 0 or 1")
        if key not in ("zero", "sp") and value < 1:
            raise TfcliError(f"--parallel: {key}={value} must be a positive integer")
    values["sp"] = bool(values.get("sp", 1))
    return Parallel(**values)


# --- parameters one rank owns (before ZeRO sharding) --------------------------------------------


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def check_divisible(cfg: Config, par: Parallel) -> None:
    t = par.tp
    for name, value in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.kv_heads),
                        ("d_ff", cfg.d_ff)):
        if value % t:
            raise TfcliError(f"--parallel tp={t}: {name}={value} is not divisible by {t}; "
                             f"tensor parallelism splits heads and FFN columns evenly")
    layers = cfg.n_encoder_layers + cfg.n_decoder_layers
    if par.pp > layers:
        raise TfcliError(f"--parallel pp={par.pp}: more stages than the model's {layers} layers")


def layer_params(cfg: Config, t: int, cross: bool) -> dict[str, int]:
    """One layer's parameters on one tensor-parallel rank: column-parallel W_Q, W_K, W_V, W_1
    (W_gate) with their biases split; row-parallel W_O, W_2 split, their biases replicated."""
    d, dk = cfg.d_model, cfg.d_k
    ab, fb = cfg.attention_bias, cfg.ffn_bias
    q, kv = cfg.n_heads // t * dk, cfg.kv_heads // t * dk
    attention = _linear(d, q, ab) + 2 * _linear(d, kv, ab) + q * d + (d if ab else 0)
    n_in = 2 if cfg.gated_ffn else 1
    f = cfg.d_ff // t
    ffn = n_in * _linear(d, f, fb) + f * d + (d if fb else 0)
    per_norm = (d if cfg.norm_affine == "feature" else 1) * (2 if cfg.has_norm_bias else 1)
    n_attn = 2 if cross else 1
    return {"attention": n_attn * attention, "ffn": ffn, "norm": (n_attn + 1) * per_norm}


@dataclass(frozen=True)
class StageParams:
    stage: int
    layers: int  # layers this stage runs (encoder and decoder layers together)
    by_part: dict[str, int]  # embedding, attention, ffn, norm, output
    largest_layer: int  # the largest FSDP unit among the layers (one unit per layer)
    root: int  # parameters outside the layers: FSDP's root unit

    @property
    def total(self) -> int:
        return sum(self.by_part.values())


def stage_sizes(n_layers: int, pp: int) -> list[int]:
    return [n_layers // pp + (1 if i < n_layers % pp else 0) for i in range(pp)]


def stage_params(cfg: Config, par: Parallel) -> list[StageParams]:
    """Parameters per pipeline stage on one tensor-parallel rank."""
    check_divisible(cfg, par)
    t, d = par.tp, cfg.d_model
    per_norm = (d if cfg.norm_affine == "feature" else 1) * (2 if cfg.has_norm_bias else 1)
    kinds = [False] * cfg.n_encoder_layers + [cfg.has_encoder] * cfg.n_decoder_layers  # cross?
    vocab = lambda v: -(-v // t)  # noqa: E731  vocabulary rows per rank (padded up)

    def embeddings(v: int, token_shared: bool) -> int:
        n = 0 if (not v or token_shared) else vocab(v) * cfg.embed_dim
        if v and cfg.embed_dim != d:
            n += _linear(cfg.embed_dim, d, True)
        if cfg.positional == "learned":
            n += cfg.max_seq_len * d
        return n + (per_norm if cfg.embed_norm else 0)

    out: list[StageParams] = []
    start = 0
    for i, n in enumerate(stage_sizes(len(kinds), par.pp)):
        parts = {"embedding": 0, "attention": 0, "ffn": 0, "norm": 0, "output": 0}
        largest = in_layers = 0
        for cross in kinds[start:start + n]:
            layer = layer_params(cfg, t, cross)
            for k, v in layer.items():
                parts[k] += v
            largest = max(largest, sum(layer.values()))
            in_layers += sum(layer.values())
        start += n
        if i == 0:
            if cfg.has_encoder:
                parts["embedding"] += embeddings(cfg.src_vocab_size, False)
            if cfg.has_decoder:
                parts["embedding"] += embeddings(
                    cfg.tgt_vocab_size, cfg.tie_embeddings in ("src_tgt", "all"))
        if i == par.pp - 1:
            parts["norm"] += per_norm * (cfg.has_encoder + cfg.has_decoder) * cfg.final_norm
            if cfg.has_output:
                tied = cfg.tie_embeddings in ("tgt_output", "all")
                rows = vocab(cfg.tgt_vocab_size)
                weight = 0 if (tied and par.pp == 1) else rows * d  # a copy on the last stage
                parts["output"] += weight + (rows if cfg.output_bias else 0)
        out.append(StageParams(i, n, parts, largest, sum(parts.values()) - in_layers))
    return out


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


@dataclass
class Line:
    name: str
    bytes: int
    how: str
    kind: str = "model states"  # model states | activations | communication


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


# --- activations --------------------------------------------------------------------------------


def korthikanti_layer(s: int, b: int, h: int, a: int, t: int, sp: bool,
                      checkpointing: str) -> tuple[float, str]:
    """Bytes one GPT-style layer keeps for backward at 16 bits (Korthikanti et al. 2022,
    Table 2), and the row used."""
    if checkpointing == "full":
        return (2 * s * b * h / (t if sp else 1),
                "2sbh" + ("/t" if sp and t > 1 else "") + " (full recomputation: the layer input)")
    attn = 0.0 if checkpointing == "selective" else 5 * a * s / (h * t)
    if t == 1:
        linear, row = 34.0, "sbh(34 + 5as/h)"
    elif sp:
        linear, row = 34.0 / t, "sbh(34/t + 5as/(ht))"
    else:
        linear, row = 10 + 24.0 / t, "sbh(10 + 24/t + 5as/(ht))"
    if checkpointing == "selective":
        row = row.split(" + 5as")[0] + ")" + " (selective: attention core recomputed)"
    return s * b * h * (linear + attn), row


@dataclass(frozen=True)
class Replay:
    """Replay of one rank's share at the stage's depth (and at one layer per stack)."""
    per_layer: int  # bytes one layer saves for backward (the same in every layer)
    per_layer_attention: int  # of which [B, h, T, S] attention matrices
    rest: int  # the peak less all layers' saved bytes: embeddings, output, loss, working set
    how: str


def share_config(cfg: Config, t: int, n_enc: int, n_dec: int) -> Config:
    """The model one tensor-parallel rank runs, with n_enc + n_dec layers: heads, FFN width and
    vocabularies divided by t (head width kept)."""
    vocab = lambda v: -(-v // t) if v else 0  # noqa: E731
    return cfg.replace(
        n_heads=cfg.n_heads // t, n_kv_heads=cfg.kv_heads // t, head_dim=cfg.d_k,
        d_ff=cfg.d_ff // t, src_vocab_size=vocab(cfg.src_vocab_size),
        tgt_vocab_size=vocab(cfg.tgt_vocab_size),
        n_encoder_layers=n_enc if cfg.has_encoder else 0,
        n_decoder_layers=n_dec if cfg.has_decoder else 0)


@functools.lru_cache(maxsize=64)  # --fit asks again for sizes it has seen
def replay_share(cfg: Config, t: int, batch: int, seq_len: int, dtype: str = "fp32",
                 mixed: str | None = None, kernel: str = "auto",
                 depth: tuple[int, int] = (1, 1)) -> Replay:
    """Replays at ``depth`` (encoder, decoder layers) and with one more layer per stack: the
    saved bytes grow exactly linearly with layers (their difference is one layer); the peak
    at ``depth`` less its layers is the rest."""
    from tfcli.inspection.memory import estimate_activations
    from tfcli.subjects.own import OwnSubject

    sizes = {"B": batch, "S": seq_len, "T": seq_len, "L": seq_len}

    def run(n_enc: int, n_dec: int):
        subject = OwnSubject(share_config(cfg, t, n_enc, n_dec))
        return estimate_activations(subject, sizes, dtype, mixed, kernel)

    at, how = run(*depth)
    more, _ = run(depth[0] + 1, depth[1] + 1)
    stacks = cfg.has_encoder + cfg.has_decoder
    layers = depth[0] * cfg.has_encoder + depth[1] * cfg.has_decoder
    saved = lambda e, kind=None: (sum(e.saved_bytes.values()) if kind is None  # noqa: E731
                                  else e.saved_bytes.get(kind, 0))
    # an encoder-decoder adds an encoder and a decoder layer: share the difference between them
    per_layer = (saved(more) - saved(at)) // stacks
    per_attn = (saved(more, "attention matrices") - saved(at, "attention matrices")) // stacks
    rest = at.peak_bytes - per_layer * layers
    return Replay(per_layer, per_attn, rest, how + (f", one rank's share (h/{t}, d_ff/{t}, V/{t})"
                                                     if t > 1 else ""))


@dataclass
class Plan:
    parallel: Parallel
    stage: int  # the stage reported (the one with the most memory)
    lines: list[Line]
    cross_check: list[Line]  # Korthikanti et al. per layer and for the stage, 16 bits
    stage_totals: list[int]
    conditions: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(line.bytes for line in self.lines)

    def to_dict(self) -> dict:
        return {"parallel": self.parallel.__dict__ | {"world_size": self.parallel.world},
                "stage": self.stage, "total_bytes": self.total, "stage_totals": self.stage_totals,
                "lines": [line.__dict__ for line in self.lines],
                "cross_check": [line.__dict__ for line in self.cross_check],
                "conditions": self.conditions}


def plan(cfg: Config, par: Parallel, batch: int | None = None, seq_len: int | None = None,
         micro_batches: int | None = None, checkpointing: str = "none", dtype: str = "fp32",
         mixed: str | None = None, optimizer_states: int = 2, convention: str = "tfcli",
         kernel: str = "auto") -> Plan:
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
    t, d = par.tp, cfg.d_model
    sp = par.sp and t > 1

    rep = None
    if batch and seq_len:
        if par.pp == 1:
            depth = (cfg.n_encoder_layers, cfg.n_decoder_layers)
        else:  # the deepest stage, its layers shared between the stacks
            per_stack = -(-stages[0].layers // (cfg.has_encoder + cfg.has_decoder))
            depth = (per_stack, per_stack)
        rep = replay_share(cfg, t, batch, s_local, dtype, mixed, kernel, depth)

    results = []
    for st in stages:
        lines = model_state_lines(st.total, n, par.zero, sb)
        lines[0].how = f"Ψ = {st.total:,} on this rank ({_split_text(par, st)}); " + lines[0].how
        lines += _buffer_lines(cfg, par, st, sb, batch, s_local, e)
        if rep is not None:
            lines += _activation_lines(cfg, par, st, rep, batch, s_local, m, checkpointing, e)
        results.append(lines)
    totals = [sum(line.bytes for line in lines) for lines in results]
    worst = max(range(len(totals)), key=totals.__getitem__)
    cross = []
    if rep is not None:
        cross = _cross_check(cfg, par, stages[worst], rep, batch, s_local, m, checkpointing, e)
    conditions = {"micro_batch": batch, "seq_len": seq_len, "seq_len_per_rank": s_local or None,
                  "micro_batches": m, "checkpointing": checkpointing, "dtype": dtype,
                  "mixed_precision": mixed, "convention": convention, "state_bytes": sb.how,
                  "sharded_over": n, "attention_kernel": kernel,
                  "activations": rep.how if rep else None}
    return Plan(par, worst, results[worst], cross, totals, conditions)


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
    elif par.zero in (0, 1) and n > 1:
        out.append(Line("DDP gradient buckets", st.total * sb.grads,
                        "a second copy of the gradients in all-reduce buckets (DDP's default; "
                        "0 with gradient_as_bucket_view=True)", "communication"))
    if par.pp > 1 and batch:
        size = batch * s_local * cfg.d_model * e // (par.tp if par.sp and par.tp > 1 else 1)
        out.append(Line("pipeline send/recv", 2 * size,
                        f"one activation received and one sent: 2 × b·s·d_model × {e} B",
                        "communication"))
    return out


def _in_flight(par: Parallel, stage: int, m: int) -> int:
    return min(par.pp - stage, m)  # 1F1B: stage i starts backward after P - i forwards


def _kept_per_layer(cfg: Config, par: Parallel, rep: Replay, batch: int, s_local: int,
                    checkpointing: str, e: int) -> tuple[int, str]:
    t, d = par.tp, cfg.d_model
    sp = par.sp and t > 1
    if checkpointing == "full":
        return (batch * s_local * d * e // (t if sp else 1),
                f"the layer input b·s·d_model × {e} B" + (" / t (sequence parallel)" if sp else ""))
    kept, how = rep.per_layer, "one layer of the replay"
    if checkpointing == "selective":
        kept -= rep.per_layer_attention
        how += f" less its attention matrices ({rep.per_layer_attention:,} B)"
    if sp:
        # what TP alone leaves replicated per residual sublayer: the norm's input and output
        # (e bytes each) and, with dropout, the output's dropout mask (1 byte), per position
        subs = 3 if cfg.kind == "encoder-decoder" else 2
        per_sub = 2 * e + (1 if cfg.dropout > 0 else 0)
        saved = int(subs * per_sub * batch * s_local * d * (1 - 1 / t))
        kept -= saved
        how += (f", less what sequence parallelism splits t ways ({subs} sublayers × "
                f"{per_sub} B × b·s·d_model × (1 - 1/t))")
    return max(kept, 0), how


def _activation_lines(cfg: Config, par: Parallel, st: StageParams, rep: Replay, batch: int,
                      s_local: int, m: int, checkpointing: str, e: int) -> list[Line]:
    flight = _in_flight(par, st.stage, m)
    kept, how = _kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
    out = [Line("activations: layers", st.layers * flight * kept,
                f"{st.layers} layers × {flight} micro-batch(es) in flight × {kept:,} B: {how}",
                "activations")]
    if checkpointing == "full":
        out.append(Line("activations: recomputed layer", rep.per_layer,
                        "one layer's activations while it is recomputed for backward",
                        "activations"))
    if st.stage == par.pp - 1:
        out.append(Line("activations: embeddings, output, loss, working set", rep.rest,
                        "the replay less its layers: embeddings, logits, loss and backward's "
                        "gradients in flight at the peak"
                        + ("; the first stage's embedding activations are counted here"
                           if par.pp > 1 else ""), "activations"))
    return out


def _cross_check(cfg: Config, par: Parallel, st: StageParams, rep: Replay, batch: int,
                 s_local: int, m: int, checkpointing: str, e: int) -> list[Line]:
    per, row = korthikanti_layer(s_local, batch, cfg.d_model, cfg.n_heads, par.tp,
                                 par.sp, checkpointing)
    kept, _ = _kept_per_layer(cfg, par, rep, batch, s_local, checkpointing, e)
    flight = _in_flight(par, st.stage, m)
    return [
        Line("per layer: replay", kept, f"fake-tensor replay, {e} B activations", "activations"),
        Line("per layer: Korthikanti et al. 2022", int(per),
             f"Table 2, {row}, s={s_local}, b={batch}, h={cfg.d_model}, a={cfg.n_heads}, "
             f"t={par.tp}; 16-bit tensors, GPT layer with dropout and a 4h MLP", "activations"),
        Line("stage layers: Korthikanti et al. 2022", int(per * st.layers * flight),
             f"{st.layers} layers × {flight} in flight × the row above", "activations"),
    ]


# --- does it fit? ---------------------------------------------------------------------------

# Nominal capacities as sold; the CUDA context and allocator reserve take 1-2 GiB of them.
DEVICES = {"H100": 80 * 10**9, "H100-80GB": 80 * 10**9, "H200": 141 * 10**9,
           "A100": 80 * 10**9, "A100-80GB": 80 * 10**9, "A100-40GB": 40 * 10**9,
           "V100": 32 * 10**9, "V100-16GB": 16 * 10**9, "L4": 24 * 10**9, "A10": 24 * 10**9,
           "L40S": 48 * 10**9, "RTX4090": 24 * 10**9, "MI300X": 192 * 10**9,
           "B200": 192 * 10**9}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_device_memory(text: str) -> tuple[int, str]:
    """``80GiB``, ``80GB``, ``81920MiB`` or a device name (``H100``): bytes and a label."""
    key = text.strip().upper()
    for name, size in DEVICES.items():
        if key == name.upper():
            return size, f"{name} ({size / 10**9:g} GB nominal)"
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?", key)
    if not match:
        raise TfcliError(f"--device-memory {text!r}: expected a size such as 80GiB or 40GB, "
                         f"or a device: {', '.join(DEVICES)}"
                         f"{did_you_mean(key, [d.upper() for d in DEVICES])}")
    size = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if size <= 0:
        raise TfcliError(f"--device-memory {text!r}: must be positive")
    return size, text.strip()


def fit(evaluate: Callable[[int], int], capacity: int, low: int, high: int) -> int | None:
    """The largest x in [low, high] with evaluate(x) <= capacity, assuming memory grows with x;
    None when even ``low`` does not fit. Memory is nearly affine in the batch, so the first
    guess extrapolates from x = low and low + 1; galloping from the guess and bisection correct
    it (a handful of replays, not log2(high))."""
    fits = lambda x: evaluate(x) <= capacity  # noqa: E731
    first = evaluate(low)
    if first > capacity:
        return None
    if low == high:
        return low
    second = evaluate(low + 1)
    if second > capacity:
        return low
    lo, hi = low + 1, high  # invariant: lo fits; the answer lies in [lo, hi]
    guess = min(hi, lo + (capacity - second) // max(second - first, 1))
    step = 1
    if fits(guess):
        lo = guess
        while lo < hi:  # gallop up
            probe = min(lo + step, hi)
            if not fits(probe):
                hi = probe - 1
                break
            lo, step = probe, step * 2
    else:
        hi = guess - 1
        while lo < hi:  # gallop down
            probe = max(hi - step, lo)
            if fits(probe):
                lo = probe
                break
            hi, step = probe - 1, step * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
