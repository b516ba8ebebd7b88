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

Activation = Literal["relu", "gelu"]
NormPlacement = Literal["post", "pre"]
NormAffine = Literal["feature", "scalar"]
Positional = Literal["sinusoidal", "learned", "none"]
Tying = Literal["none", "src_tgt", "tgt_output", "all"]
AttentionKernel = Literal["naive", "sdpa"]


@dataclass(frozen=True)
class Config:
    # --- sizes (paper Table 3, base model) ---
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6  # 0: decoder-only (GPT-style, no cross-attention)
    n_decoder_layers: int = 6  # 0: encoder-only (BERT-style)
    # 0 means the model takes already-embedded inputs [B, S, d_model], like torch.nn.Transformer.
    # The paper shares one 37000-token byte-pair vocabulary between source and target (§5.1).
    src_vocab_size: int = 37000
    tgt_vocab_size: int = 37000
    # The paper fixes no maximum for sinusoidal positions; 4096 covers the usual bench sweeps.
    max_seq_len: int = 4096
    dropout: float = 0.1  # P_drop, on sublayer outputs, embeddings+positions and attention weights
    activation: Activation = "relu"
    # --- normalisation ---
    norm_placement: NormPlacement = "post"  # the paper: LayerNorm(x + Sublayer(x))
    # The paper gives no epsilon; 1e-6 is tensor2tensor's (the authors' code). torch uses 1e-5.
    norm_eps: float = 1e-6
    norm_affine: NormAffine = "feature"  # "scalar": one gain and one bias per norm (tutorials)
    final_norm: bool = False  # a norm after each stack; pre-norm models need it, the paper has none
    # --- embeddings ---
    positional: Positional = "sinusoidal"
    embed_scale: bool = True  # multiply token embeddings by sqrt(d_model) (§3.4)
    d_embed: int | None = None  # None: embeddings are d_model wide, no projection
    embed_norm: bool = False  # LayerNorm after adding positions (BERT, some tutorials)
    # --- biases, tying, kernels ---
    attention_bias: bool = False  # eq. (4)-(5) project Q, K, V and heads without biases
    output_bias: bool = False
    tie_embeddings: Tying = "all"  # §3.4: source, target and pre-softmax weights shared
    attention: AttentionKernel = "sdpa"

    def __post_init__(self) -> None:
        validate(self)

    # --- derived sizes ---
    @property
    def d_k(self) -> int:
        """Per-head dimension d_k = d_v = d_model / h."""
        return self.d_model // self.n_heads

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


def _fail(name: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{name}={value!r}: {allowed}")


# --- validation -------------------------------------------------------------------------------


def validate(cfg: Config) -> None:
    """Reject every impossible value or combination, naming the field, the value and what is
    allowed."""
    for f in fields(cfg):
        _check_type(f.name, getattr(cfg, f.name))
    for name in ("d_model", "n_heads", "d_ff", "max_seq_len"):
        if getattr(cfg, name) <= 0:
            _fail(name, getattr(cfg, name), "must be a positive integer")
    for name in ("n_encoder_layers", "n_decoder_layers", "src_vocab_size", "tgt_vocab_size"):
        if getattr(cfg, name) < 0:
            _fail(name, getattr(cfg, name), "must be 0 or a positive integer")
    if cfg.d_model % cfg.n_heads:
        raise ConfigError(
            f"d_model={cfg.d_model} is not divisible by n_heads={cfg.n_heads}: d_model must be a "
            f"multiple of n_heads (d_k = d_model / n_heads)"
        )
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
    elif hint is bool:
        if not isinstance(value, bool):
            _fail(name, value, "must be true or false")
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
    if hint is bool:
        lowered = raw.lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        _fail(name, text, "must be true or false")
    if hint != int and raw.lower() in ("none", "null", ""):
        return None
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


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif suffix == ".json":
            data = json.loads(path.read_text())
        else:
            raise ConfigError(f"--config {str(path)!r}: unknown format; use a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config {str(path)!r}: not valid {suffix[1:].upper()}: {err}") from None
    if not isinstance(data, dict) or any(isinstance(v, (dict, list)) for v in data.values()):
        raise ConfigError(f"--config {str(path)!r}: expected flat key = value pairs")
    return data


def load_config(
    preset: str | None = None, config_file: Path | None = None, overrides: list[str] = ()
) -> Config:
    """Preset (default ``vaswani-base``), then the file, then ``--set`` overrides."""
    from tfcli.model.presets import DEFAULT_PRESET, preset_values

    from_file = read_config_file(config_file) if config_file is not None else {}
    return resolve(
        preset_values(preset or DEFAULT_PRESET),
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
