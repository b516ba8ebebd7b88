"""The model configuration: one frozen, typed dataclass, validated on construction.

A configuration is resolved in a fixed order: a named preset (:mod:`tfcli.model.presets`), then a
config file (TOML or JSON, flat ``key = value``), then ``--set key=value`` overrides. Nothing here
imports torch, so ``tfcli config`` and ``tfcli presets`` answer instantly.

The defaults are the paper's base model (Vaswani et al. 2017, Table 3), so ``Config()`` is
``vaswani-base``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, Mapping

from tfcli.errors import ConfigError, did_you_mean

Activation = Literal["relu", "gelu", "gelu-tanh", "silu"]
NormKind = Literal["layernorm", "rmsnorm"]
NormPlacement = Literal["post", "pre"]
NormAffine = Literal["feature", "scalar"]
Positional = Literal["sinusoidal", "learned", "rope", "none"]
FFNKind = Literal["mlp", "swiglu", "geglu"]
Tying = Literal["none", "src_tgt", "tgt_output", "all"]
AttentionKernel = Literal["naive", "sdpa"]


def _field(default: Any, meaning: str, allowed: str = "") -> Any:
    """A field whose meaning (and, beyond its type, allowed range) is part of the definition:
    ``tfcli config --fields`` and the README's table are generated from it."""
    return dataclasses.field(default=default, metadata={"meaning": meaning, "allowed": allowed})


@dataclass(frozen=True)
class Config:
    # --- sizes (paper Table 3, base model) ---
    d_model: int = _field(512, "model width: every residual activation is [B, L, d_model]",
                          "positive")
    n_heads: int = _field(8, "attention heads h (query heads)", "positive")
    d_ff: int = _field(2048, "FFN hidden width (gated FFNs: width of the gate and of the up "
                       "projection)", "positive")
    # None: multi-head attention, one K/V head per query head, as the paper.
    n_kv_heads: int | None = _field(
        None, "K/V heads h_kv for grouped-query attention (1: multi-query); none = n_heads",
        "positive divisor of n_heads, or none")
    # None: d_model / n_heads, the paper's d_k = d_v; set it where a model decouples the two.
    head_dim: int | None = _field(None, "per-head width d_k; none = d_model / n_heads",
                                  "positive, or none")
    n_encoder_layers: int = _field(6, "encoder layers; 0: decoder-only (GPT-style, no "
                                   "cross-attention)", ">= 0, not both stacks 0")
    n_decoder_layers: int = _field(6, "decoder layers; 0: encoder-only (BERT-style)",
                                   ">= 0, not both stacks 0")
    # 0 means the model takes already-embedded inputs [B, S, d_model], like torch.nn.Transformer.
    # The paper shares one 37000-token byte-pair vocabulary between source and target (§5.1).
    src_vocab_size: int = _field(37000, "source vocabulary; 0: inputs are already embedded "
                                 "[B, S, d_model]", ">= 0; 0 without an encoder")
    tgt_vocab_size: int = _field(37000, "target vocabulary (and output logits); 0: inputs are "
                                 "already embedded, no output projection",
                                 ">= 0; 0 without a decoder")
    # The paper fixes no maximum for sinusoidal positions; 4096 covers the usual bench sweeps.
    max_seq_len: int = _field(4096, "longest sequence: size of the learned or sinusoidal "
                              "position table, or of the rotary positions", "positive")
    dropout: float = _field(0.1, "P_drop on sublayer outputs, embeddings + positions and "
                            "attention weights", "[0, 1)")
    activation: Activation = _field(
        "relu", "FFN activation; gelu-tanh is GPT-2's tanh approximation; swiglu needs silu, "
        "geglu gelu or gelu-tanh")
    ffn: FFNKind = _field("mlp", "mlp: act(x W1) W2 (eq. 2); swiglu/geglu: (act(x W_gate) * "
                          "x W1) W2, three matrices")
    ffn_bias: bool = _field(True, "biases in the FFN's matrices (eq. 2 has b1, b2)")
    # --- normalisation ---
    norm: NormKind = _field("layernorm", "LayerNorm (centre and scale) or RMSNorm (scale only)")
    norm_placement: NormPlacement = _field(
        "post", "post: Norm(x + Sublayer(x)) (the paper); pre: x + Sublayer(Norm(x))")
    # The paper gives no epsilon; 1e-6 is tensor2tensor's (the authors' code). torch uses 1e-5.
    norm_eps: float = _field(1e-6, "epsilon inside every norm", "> 0")
    norm_affine: NormAffine = _field(
        "feature", "feature: a gain (and bias) per feature; scalar: one of each per norm "
        "(tutorials)")
    # None: each norm's usual form; LLaMA's and T5's RMSNorm have no bias, LayerNorm has one.
    norm_bias: bool | None = _field(None, "a learned bias in every norm; none = true for "
                                    "layernorm, false for rmsnorm", "true, false or none")
    final_norm: bool = _field(False, "a norm after each stack; pre-norm models need it, the "
                              "paper has none")
    # --- embeddings ---
    positional: Positional = _field(
        "sinusoidal", "sinusoidal (a buffer, §3.5), learned table, rope (rotation of q and k in "
        "self-attention, no parameters) or none")
    # 10000 is RoFormer's and LLaMA 1/2's base; LLaMA 3 uses 500000.
    rope_theta: float = _field(10000.0, "rope base: pair i of each head turns by "
                               "pos / rope_theta^(2i / d_k)", "> 0")
    embed_scale: bool = _field(True, "multiply token embeddings by sqrt(d_model) (§3.4)")
    d_embed: int | None = _field(None, "token-embedding width, projected to d_model; none = "
                                 "d_model, no projection", "positive, or none")
    embed_norm: bool = _field(False, "a norm after adding positions (BERT, some tutorials)")
    # --- attention ---
    # None: every position may attend to all it is otherwise allowed to (the paper).
    attention_window: int | None = _field(
        None, "sliding-window self-attention of W positions: causal i-W < j <= i, "
        "bidirectional |i-j| < W; none = off", "positive, or none")
    # --- biases, tying, kernels ---
    attention_bias: bool = _field(False, "biases in W_Q, W_K, W_V, W_O (eq. 4-5 have none)")
    output_bias: bool = _field(False, "a bias in the pre-softmax output projection")
    tie_embeddings: Tying = _field(
        "all", "which of source embedding, target embedding and output projection share one "
        "matrix (§3.4: all three)")
    attention: AttentionKernel = _field(
        "sdpa", "naive: explicit softmax(QK^T/sqrt(d_k))V (returns weights); sdpa: "
        "F.scaled_dot_product_attention")

    def __post_init__(self) -> None:
        validate(self)

    # --- derived sizes ---
    @property
    def d_k(self) -> int:
        """Per-head dimension d_k = d_v: head_dim, or d_model / h."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """h_kv: heads of K and V (h for multi-head attention, fewer for grouped-query)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def has_norm_bias(self) -> bool:
        return self.norm_bias if self.norm_bias is not None else self.norm == "layernorm"

    @property
    def gated_ffn(self) -> bool:
        return self.ffn != "mlp"

    @property
    def embed_dim(self) -> int:
        return self.d_model if self.d_embed is None else self.d_embed

    @property
    def kind(self) -> Literal["encoder-decoder", "decoder-only", "encoder-only"]:
        if self.n_encoder_layers and self.n_decoder_layers:
            return "encoder-decoder"
        return "decoder-only" if self.n_decoder_layers else "encoder-only"

    @property
    def has_encoder(self) -> bool:
        return self.n_encoder_layers > 0

    @property
    def has_decoder(self) -> bool:
        return self.n_decoder_layers > 0

    @property
    def has_output(self) -> bool:
        """A pre-softmax projection to the target vocabulary exists (the model emits logits)."""
        return self.has_decoder and self.tgt_vocab_size > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Config:
        return resolve(self.to_dict(), ("replace()", changes))


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _allowed_values(name: str) -> tuple[str, ...] | None:
    hint = _HINTS[name]
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


def _type_name(name: str) -> str:
    hint = _HINTS[name]
    if typing.get_origin(hint) is Literal:
        return "choice"
    return {int: "int", float: "float", bool: "bool", int | None: "int or none",
            bool | None: "bool or none"}[hint]


def _text(value: Any) -> str:
    """A value as it is written after ``--set key=``."""
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def field_table() -> list[dict[str, str]]:
    """Every configuration key with its type, allowed values, default and meaning, from the
    dataclass itself (``tfcli config --fields``; the README's table is this, as Markdown)."""
    rows = []
    for name, f in FIELDS.items():
        choices = _allowed_values(name)
        allowed = (", ".join(choices) if choices is not None
                   else f.metadata["allowed"] or ("true, false" if _HINTS[name] is bool else ""))
        rows.append({"field": name, "type": _type_name(name), "allowed": allowed,
                     "default": _text(f.default), "meaning": f.metadata["meaning"]})
    return rows


def fields_markdown() -> str:
    lines = ["| field | type | allowed | default | meaning |", "|---|---|---|---|---|"]
    for row in field_table():
        cells = [f"`{row['field']}`", row["type"], row["allowed"], f"`{row['default']}`",
                 row["meaning"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r}: {allowed}")


# --- validation -------------------------------------------------------------------------------


# Upper bounds far above any published model, low enough that building one on meta stays cheap
# (every layer is a Python module) and that every product of sizes fits int64 element counts.
MAX_WIDTH = 2**20  # d_model, d_ff, heads, head_dim, d_embed: the largest published is ~2**16
MAX_LAYERS = 1024  # per stack: the deepest published model has ~128
MAX_LENGTH = 2**31 - 1  # vocabularies, max_seq_len, attention_window: int32 token ids/positions
LIMITS = {"d_model": MAX_WIDTH, "n_heads": MAX_WIDTH, "d_ff": MAX_WIDTH, "n_kv_heads": MAX_WIDTH,
          "head_dim": MAX_WIDTH, "d_embed": MAX_WIDTH, "n_encoder_layers": MAX_LAYERS,
          "n_decoder_layers": MAX_LAYERS, "src_vocab_size": MAX_LENGTH,
          "tgt_vocab_size": MAX_LENGTH, "max_seq_len": MAX_LENGTH, "attention_window": MAX_LENGTH}


def validate(cfg: Config) -> None:
    """Reject every impossible value or combination, naming the field, the value and what is
    allowed."""
    for f in fields(cfg):
        _check_type(f.name, getattr(cfg, f.name))
    for name, limit in LIMITS.items():
        value = getattr(cfg, name)
        if value is not None and value > limit:
            shown = value if value < 10**30 else f"a {len(str(value))}-digit number"
            raise ConfigError(f"{name}={shown}: must be at most {limit:,}")
    for name in ("d_model", "n_heads", "d_ff", "max_seq_len"):
        if getattr(cfg, name) <= 0:
            _fail(name, getattr(cfg, name), "must be a positive integer")
    for name in ("n_encoder_layers", "n_decoder_layers", "src_vocab_size", "tgt_vocab_size"):
        if getattr(cfg, name) < 0:
            _fail(name, getattr(cfg, name), "must be 0 or a positive integer")
    for name in ("n_kv_heads", "head_dim", "attention_window"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            _fail(name, getattr(cfg, name), "must be a positive integer, or none")
    if cfg.head_dim is None and cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}: d_model must be a "
            f"multiple of n_heads (d_k = d_model / n_heads), or set head_dim"
        )
    if cfg.n_heads % cfg.kv_heads:
        _fail("n_kv_heads", cfg.n_kv_heads,
              f"n_heads={cfg.n_heads} must be a multiple of n_kv_heads (each K/V head serves "
              f"n_heads / n_kv_heads query heads)")
    if cfg.positional == "rope" and cfg.d_k % 2:
        _fail("positional", "rope", f"rotates pairs of features, but the head dimension "
              f"d_k={cfg.d_k} is odd; use an even head_dim or d_model / n_heads")
    if not (cfg.rope_theta > 0 and math.isfinite(cfg.rope_theta)):
        _fail("rope_theta", cfg.rope_theta, "must be a positive number")
    gate_acts = {"swiglu": ("silu",), "geglu": ("gelu", "gelu-tanh")}.get(cfg.ffn)
    if gate_acts is not None and cfg.activation not in gate_acts:
        _fail("activation", cfg.activation,
              f"ffn={cfg.ffn!r} gates with {' or '.join(gate_acts)}; set activation="
              f"{gate_acts[0]}, or ffn=mlp")
    if not cfg.has_encoder and not cfg.has_decoder:
        raise ConfigError(
            "n_encoder_layers=0 and n_decoder_layers=0: at least one stack must have layers"
        )
    if not 0.0 <= cfg.dropout < 1.0:
        _fail("dropout", cfg.dropout, "must be in [0, 1)")
    if not (cfg.norm_eps > 0 and math.isfinite(cfg.norm_eps)):
        _fail("norm_eps", cfg.norm_eps, "must be a positive number")
    if cfg.d_embed is not None and cfg.d_embed <= 0:
        _fail("d_embed", cfg.d_embed, "must be a positive integer, or none (= d_model)")
    if not cfg.has_encoder and cfg.src_vocab_size:
        _fail("src_vocab_size", cfg.src_vocab_size,
              "a decoder-only model (n_encoder_layers=0) has no source side; set it to 0")
    if not cfg.has_decoder and cfg.tgt_vocab_size:
        _fail("tgt_vocab_size", cfg.tgt_vocab_size,
              "an encoder-only model (n_decoder_layers=0) has no target side; set it to 0")
    if cfg.d_embed is not None and cfg.d_embed != cfg.d_model and not (
        cfg.src_vocab_size or cfg.tgt_vocab_size
    ):
        _fail("d_embed", cfg.d_embed, "projects token embeddings, but both vocabulary sizes are 0")
    _validate_tying(cfg)


def _validate_tying(cfg: Config) -> None:
    tie = cfg.tie_embeddings
    if tie in ("src_tgt", "all"):
        if cfg.kind != "encoder-decoder":
            _fail("tie_embeddings", tie,
                  f"sharing source and target embeddings needs both stacks; this model is "
                  f"{cfg.kind}: use 'none' or 'tgt_output'")
        if cfg.src_vocab_size != cfg.tgt_vocab_size or cfg.src_vocab_size == 0:
            _fail("tie_embeddings", tie,
                  f"sharing source and target embeddings needs equal non-zero vocabularies, got "
                  f"src_vocab_size={cfg.src_vocab_size} and tgt_vocab_size={cfg.tgt_vocab_size}")
    if tie in ("tgt_output", "all"):
        if not cfg.has_output:
            _fail("tie_embeddings", tie,
                  "tying the output projection needs a decoder with tgt_vocab_size > 0")
        if cfg.embed_dim != cfg.d_model:
            _fail("tie_embeddings", tie,
                  f"the output projection is d_model={cfg.d_model} wide but embeddings are "
                  f"d_embed={cfg.d_embed} wide; use 'none' or 'src_tgt', or set d_embed=none")


def _check_type(name: str, value: Any) -> None:
    hint = _HINTS[name]
    allowed = _allowed_values(name)
    if allowed is not None:
        if value not in allowed:
            _fail(name, value, f"must be one of {', '.join(allowed)}{did_you_mean(str(value), allowed)}")
    elif hint is bool or hint == (bool | None):
        if value is None and hint is not bool:
            return
        if not isinstance(value, bool):
            _fail(name, value, "must be true or false" + ("" if hint is bool else " or none"))
    elif hint is int or hint == (int | None):
        if value is None and hint != int:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(name, value, "must be an integer" + ("" if hint is int else " or none"))
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(name, value, "must be a number")
    else:  # pragma: no cover - a new field type needs a branch here
        raise AssertionError(f"no type check for {name}: {hint}")


# --- resolution: preset -> file -> --set --------------------------------------------------------


def _check_key(key: str, source: str) -> None:
    if key not in FIELDS:
        raise ConfigError(f"unknown configuration key {key!r} in {source}{did_you_mean(key, FIELDS)}")


def _coerce_number(name: str, value: Any) -> Any:
    """File values arrive typed; ints are accepted where floats are expected (dropout = 0)."""
    if _HINTS[name] is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def resolve(base: Mapping[str, Any], *layers: tuple[str, Mapping[str, Any]]) -> Config:
    """Apply (source, values) layers in order over ``base``; unknown keys name their source."""
    values = dict(base)
    for source, layer in layers:
        for key, value in layer.items():
            _check_key(key, source)
            values[key] = _coerce_number(key, value)
    return Config(**values)


def parse_value(name: str, text: str) -> Any:
    """Parse the text of ``--set name=text`` into the field's type."""
    hint = _HINTS[name]
    raw = text.strip()
    if _allowed_values(name) is not None:
        return raw
    if hint != int and hint is not bool and raw.lower() in ("none", "null", ""):
        return None
    if hint is bool or hint == (bool | None):
        lowered = raw.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        _fail(name, text, "must be true or false" + ("" if hint is bool else " or none"))
    if hint in (int, int | None) and len(raw) > 40:  # int() refuses 4,300+ digits anyway
        kind = "digit number" if raw.lstrip("+-").isdigit() else "character value"
        shown = f"a {len(raw)}-{kind}"
        allowed = "must not be negative" if raw.startswith("-") else \
            f"must be at most {LIMITS.get(name, 2**63 - 1):,}"
        raise ConfigError(f"{name}={shown}: {allowed}")
    try:
        return int(raw) if hint in (int, int | None) else float(raw)
    except ValueError:
        kind = "an integer" if hint in (int, int | None) else "a number"
        _fail(name, text, f"must be {kind}" + (" or none" if hint == (int | None) else ""))


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set d_model=256")
        _check_key(key, "--set")
        out[key] = parse_value(key, text)
    return out


MAX_CONFIG_BYTES = 1 << 20  # a flat file of ~40 keys is ~1 KiB; never read more than this
MAX_CONFIG_DEPTH = 32  # a flat file has none; deep nesting would exhaust the parser's stack


def read_config_file(path: Path) -> dict[str, Any]:
    """A flat TOML or JSON file, read through bounds: a regular file, at most
    MAX_CONFIG_BYTES, nesting at most MAX_CONFIG_DEPTH, UTF-8."""
    import os
    import stat

    where = f"--config {str(path)!r}"
    suffix = path.suffix.lower()
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read: {err.strerror or err}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"{where}: is a directory; give a .toml or .json file")
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{where}: not a regular file (a device, pipe or socket); give a "
                          f".toml or .json file")
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"{where}: unknown format; use a .toml or .json file")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{where}: cannot be read: {err.strerror or err}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_CONFIG_BYTES // 1024} KiB; a configuration "
                          f"is a few flat key = value lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where}: not UTF-8 text (byte {err.start})") from None
    if _nesting(text) > MAX_CONFIG_DEPTH:
        raise ConfigError(f"{where}: nested more than {MAX_CONFIG_DEPTH} levels deep; expected "
                          f"flat key = value pairs")
    try:
        data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{where}: not valid {suffix[1:].upper()}: {message}") from None
    except (ValueError, RecursionError) as err:  # e.g. an integer of 4,300+ digits
        message = str(err).splitlines()[0].split(";")[0][:200] if str(err) else \
            type(err).__name__
        raise ConfigError(f"{where}: a value tfcli cannot read: {message}") from None
    if not isinstance(data, dict) or any(isinstance(v, (dict, list)) for v in data.values()):
        raise ConfigError(f"{where}: expected flat key = value pairs")
    return data


def _nesting(text: str) -> int:
    """An upper bound on bracket depth (strings are not skipped: only ever an overestimate,
    and a flat file's strings hold no brackets worth 32 levels)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


def load_config(
    preset: str | None = None, config_file: Path | None = None, overrides: list[str] = ()
) -> Config:
    """Preset (default ``vaswani-base``), then the file, then ``--set`` overrides."""
    from tfcli.model.presets import DEFAULT_PRESET, preset_values

    from_file = read_config_file(config_file) if config_file is not None else {}
    return resolve(
        preset_values(DEFAULT_PRESET if preset is None else preset),
        (str(config_file), from_file),
        ("--set", parse_overrides(list(overrides))),
    )


def to_toml(cfg: Config) -> str:
    """Flat TOML; ``None`` fields are omitted (TOML has no null) and mean the default."""
    lines = []
    for key, value in cfg.to_dict().items():
        if value is None:
            lines.append(f"# {key} = none")
        elif isinstance(value, bool):
            lines.append(f"{key} = {str(value).lower()}")
        elif isinstance(value, str):
            lines.append(f'{key} = "{value}"')
        else:
            lines.append(f"{key} = {value!r}")
    return "\n".join(lines) + "\n"
