"""Who holds what: the parallel layout (``dp=8,zero=3,tp=2,...``) and the parameters one
rank owns per pipeline stage, matrix by matrix (Megatron-LM's column/row splits, the
vocabulary-parallel embedding). No torch."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tfcli.errors import TfcliError, did_you_mean
from tfcli.model.config import Config

_KEYS = ("dp", "zero", "tp", "pp", "cp", "sp", "ep")


@dataclass
class Line:
    """One line of a per-rank report: bytes, and how they were found."""
    name: str
    bytes: int
    how: str
    kind: str = "model states"  # model states | activations | communication
    precision: str | None = None  # the precision policy a model-state line follows

    def record(self) -> dict:
        """The line in --json: the keys of ``tfcli params``'s memory lines
        (tfcli.inspection.memory.MemoryLine.record); none of these is a summary."""
        return {"name": self.name, "bytes": self.bytes, "how": self.how, "kind": self.kind,
                "summary": False, "precision": self.precision}


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel ranks N (ZeRO/FSDP shard over dp · cp)
    zero: int = 0  # 0: DDP; 1: optimizer state; 2: + gradients; 3: + weights (FSDP)
    tp: int = 1  # tensor-parallel ranks t
    pp: int = 1  # pipeline stages P
    cp: int = 1  # context-parallel ranks C (the sequence is split C ways)
    sp: bool = True  # sequence parallelism beside tensor parallelism (Megatron-LM's default pairing)
    # expert-parallel ranks: each MoE layer's experts split ep ways within the data-parallel
    # ranks (DeepSpeed-MoE's ep_size, Megatron-LM's expert-model-parallel size): not more ranks
    ep: int = 1

    def __post_init__(self) -> None:
        # sp splits what tensor parallelism leaves whole: with tp = 1 there is nothing to split,
        # so it is off (the header and --json said sp=True for dp=2 alone)
        if self.tp == 1 and self.sp:
            object.__setattr__(self, "sp", False)

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
        return (out + (f",sp={int(self.sp)}" if self.tp > 1 else "")
                + (f",ep={self.ep}" if self.ep > 1 else ""))


def parse_parallel(text: str) -> Parallel:
    """``dp=8,zero=3,tp=2`` (any subset of dp, zero, tp, pp, cp, sp, ep; the rest 1, zero 0,
    sp 1)."""
    values: dict[str, int] = {}
    if not text.replace(",", "").strip():
        raise TfcliError(f"--parallel {text!r}: give key=value items, e.g. --parallel "
                         f"dp=8,zero=3,tp=2")
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
        if re.fullmatch(r"-[0-9]+", raw.strip()):
            raise TfcliError(f"--parallel: {key}={raw.strip()} must be "
                             + ("0, 1, 2 or 3" if key == "zero" else "0 or 1" if key == "sp"
                                else "a positive integer"))
        if not re.fullmatch(r"[0-9]+", raw.strip()):  # int() also reads 2_0, +2 and ２
            raise TfcliError(f"--parallel: {key}={raw.strip()!r} must be an integer")
        values[key] = int(raw)
    if not values:
        raise TfcliError(f"--parallel {text!r}: expected e.g. dp=8,zero=3,tp=2")
    for key, value in values.items():
        if key == "zero" and value not in (0, 1, 2, 3):
            raise TfcliError(f"--parallel: zero={value} must be 0, 1, 2 or 3")
        if key == "sp" and value not in (0, 1):
            raise TfcliError(f"--parallel: sp={value} must be 0 or 1")
        if key not in ("zero", "sp") and value < 1:
            raise TfcliError(f"--parallel: {key}={value} must be a positive integer")
    if "sp" in values and values.get("tp", 1) == 1:
        raise TfcliError(f"--parallel: sp={values['sp']} applies with tp > 1 (sequence "
                         f"parallelism splits what tensor parallelism leaves replicated)")
    ep, dp = values.get("ep", 1), values.get("dp", 1)
    if dp % ep:
        raise TfcliError(f"--parallel: ep={ep} needs dp a multiple of {ep}, not dp={dp}: "
                         f"expert parallelism splits the experts over ep of the data-parallel "
                         f"ranks, e.g. dp={ep * -(-dp // ep)},ep={ep}")
    values["sp"] = bool(values.get("sp", 1))
    par = Parallel(**values)
    if par.world > MAX_WORLD:
        raise TfcliError(f"--parallel {text}: {par.world:,} ranks; tfcli plans at most "
                         f"{MAX_WORLD:,} (the largest training runs use tens of thousands)")
    return par


MAX_WORLD = 1 << 20  # ranks a plan may have (and a fake process group, tfcli.parallel.measure)


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
