"""Parameter counts in closed form, from the configuration alone (no torch, no model).

The tests check these formulas against the built model for every preset and for random valid
configurations, and against published counts (torch.nn.Transformer, GPT-2 small).
Tied weights are counted once, in the component that owns them (the source embedding, or the
target embedding when only the output projection is tied).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tfcli.model.config import Config


@dataclass(frozen=True)
class ParamCount:
    total: int
    by_component: dict[str, int]  # src_embed, encoder, tgt_embed, decoder, output
    by_kind: dict[str, int]  # embedding, attention, ffn, norm, output


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def count_params(cfg: Config) -> ParamCount:
    d = cfg.d_model
    norm = 2 * d if cfg.norm_affine == "feature" else 2
    attention = 4 * _linear(d, d, cfg.attention_bias)  # W_Q, W_K, W_V, W_O
    ffn = _linear(d, cfg.d_ff, True) + _linear(cfg.d_ff, d, True)  # eq. (2) has b1, b2

    component: Counter[str] = Counter()
    kind: Counter[str] = Counter()

    def add(where: str, what: str, n: int) -> None:
        component[where] += n
        kind[what] += n

    def embeddings(where: str, vocab: int, token_shared: bool) -> None:
        if vocab and not token_shared:
            add(where, "embedding", vocab * cfg.embed_dim)
        if vocab and cfg.embed_dim != d:
            add(where, "embedding", _linear(cfg.embed_dim, d, True))
        if cfg.positional == "learned":
            add(where, "embedding", cfg.max_seq_len * d)
        if cfg.embed_norm:
            add(where, "norm", norm)

    def stack(where: str, n_layers: int, cross: bool) -> None:
        n_attn, n_norm = (2, 3) if cross else (1, 2)
        add(where, "attention", n_layers * n_attn * attention)
        add(where, "ffn", n_layers * ffn)
        add(where, "norm", n_layers * n_norm * norm + (norm if cfg.final_norm else 0))

    if cfg.has_encoder:
        embeddings("src_embed", cfg.src_vocab_size, token_shared=False)
        stack("encoder", cfg.n_encoder_layers, cross=False)
    if cfg.has_decoder:
        shared = cfg.tie_embeddings in ("src_tgt", "all")
        embeddings("tgt_embed", cfg.tgt_vocab_size, token_shared=shared)
        stack("decoder", cfg.n_decoder_layers, cross=cfg.has_encoder)
    if cfg.has_output:
        tied = cfg.tie_embeddings in ("tgt_output", "all")
        weight = 0 if tied else d * cfg.tgt_vocab_size
        add("output", "output", weight + (cfg.tgt_vocab_size if cfg.output_bias else 0))

    return ParamCount(sum(component.values()), dict(component), dict(kind))
