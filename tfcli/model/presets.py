"""Named presets: override dicts on top of :class:`~tfcli.model.config.Config` (the paper's base model).

Each preset says where its numbers come from. Published parameter counts that the test suite
checks exactly are given in the descriptions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tfcli.model.config import Config
from tfcli.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Preset:
    description: str
    source: str
    overrides: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "small encoder-decoder for tests and quick runs (every size distinct)",
        "tfcli",
        dict(d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2, n_decoder_layers=2,
             src_vocab_size=101, tgt_vocab_size=103, max_seq_len=64, tie_embeddings="none"),
    ),
    "vaswani-base": Preset(
        "the paper's base model: 6+6 layers, d_model 512, shared 37k vocabulary, three-way tying",
        "Vaswani et al. 2017, Table 3 (base), §3.4, §5.1",
    ),
    "vaswani-big": Preset(
        "the paper's big model: 6+6 layers, d_model 1024, 16 heads, d_ff 4096, dropout 0.3",
        "Vaswani et al. 2017, Table 3 (big)",
        dict(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3),
    ),
    "annotated": Preset(
        "pre-norm from-scratch tutorial variant: final norms, separate vocabularies, biases",
        "The Annotated Transformer (Harvard NLP) layout; vocabulary sizes are illustrative",
        dict(norm_placement="pre", final_norm=True, src_vocab_size=8000, tgt_vocab_size=6000,
             tie_embeddings="none", attention_bias=True, output_bias=True, max_seq_len=5000),
    ),
    "torch-transformer": Preset(
        "torch.nn.Transformer() defaults: no vocabularies or positions, 44,140,544 parameters",
        "torch.nn.Transformer defaults (d_model 512, nhead 8, 6+6 layers, dim_feedforward 2048)",
        dict(src_vocab_size=0, tgt_vocab_size=0, positional="none", embed_scale=False,
             norm_eps=1e-5, final_norm=True, attention_bias=True, tie_embeddings="none"),
    ),
    "gpt2-small": Preset(
        "GPT-2 small: decoder-only, 12 layers, d_model 768, 124,439,808 parameters",
        "Radford et al. 2019; published count of the 124M checkpoint",
        dict(d_model=768, n_heads=12, d_ff=3072, n_encoder_layers=0, n_decoder_layers=12,
             src_vocab_size=0, tgt_vocab_size=50257, max_seq_len=1024, positional="learned",
             activation="gelu", norm_placement="pre", final_norm=True, norm_eps=1e-5,
             embed_scale=False, attention_bias=True, output_bias=False,
             tie_embeddings="tgt_output"),
    ),
    "bert-base": Preset(
        "BERT-base-shaped encoder-only: 12 layers, d_model 768, embedding LayerNorm, no head",
        "Devlin et al. 2019 (BERT-base); token-type embeddings and pooler omitted",
        dict(d_model=768, n_heads=12, d_ff=3072, n_encoder_layers=12, n_decoder_layers=0,
             src_vocab_size=30522, tgt_vocab_size=0, max_seq_len=512, positional="learned",
             activation="gelu", norm_eps=1e-12, embed_scale=False, embed_norm=True,
             attention_bias=True, tie_embeddings="none"),
    ),
}

DEFAULT_PRESET = "vaswani-base"


def preset_values(name: str) -> dict[str, Any]:
    """The full field values of preset ``name`` (defaults plus its overrides)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"choose one of {', '.join(PRESETS)}")
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    return {**defaults, **PRESETS[name].overrides}


def get_preset(name: str) -> Config:
    return Config(**preset_values(name))
