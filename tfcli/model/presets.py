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


def _gpt2(d_model: int, n_heads: int, layers: int) -> dict[str, Any]:
    """GPT-2 (Radford et al. 2019): pre-norm, learned positions, tanh-approximated GELU
    (``gelu_new`` in the released code), biases everywhere but the tied output projection."""
    return dict(d_model=d_model, n_heads=n_heads, d_ff=4 * d_model, n_encoder_layers=0,
                n_decoder_layers=layers, src_vocab_size=0, tgt_vocab_size=50257,
                max_seq_len=1024, positional="learned", activation="gelu-tanh",
                norm_placement="pre", final_norm=True, norm_eps=1e-5, embed_scale=False,
                attention_bias=True, output_bias=False, tie_embeddings="tgt_output")


def _llama(d_model: int, n_heads: int, n_kv_heads: int | None, d_ff: int, layers: int,
           vocab: int, max_seq_len: int, rope_theta: float,
           attention_window: int | None = None) -> dict[str, Any]:
    """The LLaMA layout (Touvron et al. 2023), also Mistral's: pre-norm RMSNorm (eps 1e-5, no
    bias), rotary positions, SwiGLU, no biases anywhere, untied embedding and output, no
    dropout, no embedding scale."""
    return dict(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=d_ff,
                n_encoder_layers=0, n_decoder_layers=layers, src_vocab_size=0,
                tgt_vocab_size=vocab, max_seq_len=max_seq_len, dropout=0.0, activation="silu",
                ffn="swiglu", ffn_bias=False, norm="rmsnorm", norm_placement="pre",
                norm_eps=1e-5, final_norm=True, positional="rope", rope_theta=rope_theta,
                embed_scale=False, attention_window=attention_window, attention_bias=False,
                output_bias=False, tie_embeddings="none")


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
        _gpt2(768, 12, 12),
    ),
    "gpt2-medium": Preset(
        "GPT-2 medium: 24 layers, d_model 1024, 16 heads, 354,823,168 parameters",
        "Radford et al. 2019 (345M); count of Transformers' GPT2LMHeadModel, gpt2-medium",
        _gpt2(1024, 16, 24),
    ),
    "gpt2-large": Preset(
        "GPT-2 large: 36 layers, d_model 1280, 20 heads, 774,030,080 parameters",
        "Radford et al. 2019 (762M); count of Transformers' GPT2LMHeadModel, gpt2-large",
        _gpt2(1280, 20, 36),
    ),
    "gpt2-xl": Preset(
        "GPT-2 XL: 48 layers, d_model 1600, 25 heads, 1,557,611,200 parameters",
        "Radford et al. 2019 (1542M); count of Transformers' GPT2LMHeadModel, gpt2-xl",
        _gpt2(1600, 25, 48),
    ),
    "llama-2-7b": Preset(
        "Llama 2 7B: 32 layers, d_model 4096, 32 heads, SwiGLU 11008, 6,738,415,616 parameters",
        "Touvron et al. 2023 (Llama 2), Table 1; meta-llama/Llama-2-7b-hf config.json",
        _llama(d_model=4096, n_heads=32, n_kv_heads=None, d_ff=11008, layers=32, vocab=32000,
               max_seq_len=4096, rope_theta=10000.0),
    ),
    "llama-3-8b": Preset(
        "Llama 3 8B: 32 layers, 32 query / 8 K/V heads, SwiGLU 14336, 128k vocabulary, "
        "8,030,261,248 parameters",
        "Meta Llama 3 model card; meta-llama/Meta-Llama-3-8B config.json",
        _llama(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, layers=32, vocab=128256,
               max_seq_len=8192, rope_theta=500000.0),
    ),
    "mistral-7b": Preset(
        "Mistral 7B v0.1: Llama-shaped, 8 K/V heads, 4096-token sliding window, "
        "7,241,732,096 parameters",
        "Jiang et al. 2023 (Mistral 7B), Table 1; mistralai/Mistral-7B-v0.1 config.json",
        _llama(d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336, layers=32, vocab=32000,
               max_seq_len=32768, rope_theta=10000.0, attention_window=4096),
    ),
    "llama-tiny": Preset(
        "Llama-shaped decoder for tests: RMSNorm, rotary, 6 query / 3 K/V heads, SwiGLU "
        "(every size distinct from the others and from the example B and T)",
        "tfcli",
        _llama(d_model=48, n_heads=6, n_kv_heads=3, d_ff=64, layers=2, vocab=103,
               max_seq_len=64, rope_theta=10000.0),
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
