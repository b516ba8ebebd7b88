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
    per_norm = d if cfg.norm_affine == "feature" else 1
    norm = per_norm * (2 if cfg.has_norm_bias else 1)  # gain, and bias unless RMSNorm-style
    q_width, kv_width = cfg.n_heads * cfg.d_k, cfg.kv_heads * cfg.d_k
    attention = (_linear(d, q_width, cfg.attention_bias)  # W_Q
                 + 2 * _linear(d, kv_width, cfg.attention_bias)  # W_K, W_V: h_kv heads only
                 + _linear(q_width, d, cfg.attention_bias))  # W_O
    n_in = 2 if cfg.gated_ffn else 1  # W_1, and W_gate when gated
    ffn = n_in * _linear(d, cfg.d_ff, cfg.ffn_bias) + _linear(cfg.d_ff, d, cfg.ffn_bias)  # + W_2
    # Rotary positions have no parameters; sinusoidal ones are a buffer.

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


@dataclass(frozen=True)
class KVCache:
    elements: int  # cached K and V elements for the whole batch
    positions: int  # positions each layer keeps: L, or at most the window
    formula: str  # how it is computed, to print beside the figure

    def bytes(self, bytes_per_element: int) -> int:
        return self.elements * bytes_per_element


def kv_cache(cfg: Config, batch_size: int, seq_len: int, src_len: int = 0,
             rolling_window: bool = True) -> KVCache:
    """K and V kept for decoding ``seq_len`` positions: 2 · layers · h_kv · d_k · L · B elements
    in the decoder's self-attention, plus the cross-attention's K and V of the ``src_len``-long
    memory in an encoder-decoder. With a sliding window and ``rolling_window`` each layer keeps
    only the last W positions (Mistral's rolling buffer cache); without it, all L."""
    if not cfg.has_decoder:
        return KVCache(0, 0, "no decoder: nothing is cached")
    positions = seq_len
    if cfg.attention_window is not None and rolling_window:
        positions = min(seq_len, cfg.attention_window)
    per_position = 2 * cfg.n_decoder_layers * cfg.kv_heads * cfg.d_k  # K and V, every layer
    elements = per_position * positions * batch_size
    formula = (f"2 · {cfg.n_decoder_layers} layers · {cfg.kv_heads} KV heads · d_k {cfg.d_k} · "
               f"{positions} positions · B {batch_size}")
    if cfg.has_encoder and src_len:
        elements += per_position * src_len * batch_size
        formula += f" + the same for {src_len} memory positions (cross-attention)"
    return KVCache(elements, positions, formula)
