"""The configurable Transformer (Vaswani et al. 2017, §3.1–3.5) and the variants people write.

One :class:`Block` serves the encoder layer (self-attention, FFN), the decoder layer
(masked self-attention, cross-attention, FFN) and the decoder-only layer (no cross-attention).
Norm placement is one visible branch in :meth:`Block._residual`.

Legend: B batch, S source length, T target length, h heads, h_kv K/V heads, d_k head dimension
(d_model / h unless head_dim is set), V_src / V_tgt vocabulary sizes. Activations are batch-first: [B, L, d_model].
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tfcli.model import masks
from tfcli.model.attention import MultiHeadAttention, Rotary
from tfcli.model.config import Config
from tfcli.errors import InputError


class ScalarLayerNorm(nn.Module):
    """A norm with one learned gain (and bias) shared by all features (some tutorials); the
    LayerNorm by default, RMSNorm with ``rms``."""

    def __init__(self, eps: float, rms: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.rms = rms
        self.weight = nn.Parameter(torch.ones(()))
        self.bias = nn.Parameter(torch.zeros(())) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        normed = (F.rms_norm if self.rms else F.layer_norm)(x, x.shape[-1:], eps=self.eps)
        return self.weight * normed + self.bias if self.bias is not None else self.weight * normed


class RMSNorm(nn.RMSNorm):
    """RMSNorm(x) = x / sqrt(mean(x²) + eps) · g (Zhang & Sennrich 2019), with an optional bias
    (torch's has none; LLaMA's has none either)."""

    def __init__(self, d_model: int, eps: float, bias: bool) -> None:
        super().__init__(d_model, eps=eps)
        self.bias = nn.Parameter(torch.zeros(d_model)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out + self.bias if self.bias is not None else out


def make_norm(cfg: Config) -> nn.Module:
    rms, bias = cfg.norm == "rmsnorm", cfg.has_norm_bias
    if cfg.norm_affine == "scalar":
        return ScalarLayerNorm(cfg.norm_eps, rms=rms, bias=bias)
    if rms:
        return RMSNorm(cfg.d_model, cfg.norm_eps, bias)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=bias)


ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU,
               "gelu-tanh": lambda: nn.GELU(approximate="tanh")}


class FeedForward(nn.Module):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, eq. (2): [B, L, d_model] -> [B, L, d_ff] -> back.
    Gated (Shazeer 2020, SwiGLU / GeGLU): (act(x W_gate) ⊙ x W_1) W_2, three matrices."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        bias = cfg.ffn_bias
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias) if cfg.gated_ffn else None
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=bias)
        self.activation = ACTIVATIONS[cfg.activation]()
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is None:
            return self.linear2(self.activation(self.linear1(x)))
        return self.linear2(self.activation(self.gate(x)) * self.linear1(x))  # [B, L, d_ff] inside


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d_model)), PE(pos, 2i+1) = cos(...), §3.5.
    A buffer, not a parameter: it takes memory but is never trained."""

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # shapes only: no values, no memory
            self.register_buffer("table", torch.empty(max_len, d_model), persistent=False)
            return
        # Computed on the CPU (deterministic) and moved to the build device: on meta, arange and
        # friends would go through torch._refs, which imports torch._dynamo (~0.9 s).
        cpu = torch.device("cpu")
        position = torch.arange(max_len, dtype=torch.float32, device=cpu)[:, None]  # [max_len, 1]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32, device=cpu)
                             * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model, device=cpu)
        table[:, 0::2] = torch.sin(position * inv_freq)
        table[:, 1::2] = torch.cos(position * inv_freq[: d_model // 2])
        table = table.to(torch.get_default_device(), torch.get_default_dtype())
        self.register_buffer("table", table, persistent=False)

    def forward(self, length: int) -> Tensor:
        return self.table[:length]  # [L, d_model]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_len, d_model))

    def forward(self, length: int) -> Tensor:
        return self.weight[:length]  # [L, d_model]


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its own normal_() init (the model initialises every matrix in
    _reset_parameters): on the meta device that init alone costs ~0.9 s of torch imports."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class Embeddings(nn.Module):
    """Token ids [B, L] -> [B, L, d_model]: embed (×√d_model), project d_embed -> d_model, add
    positions, optional norm, dropout. With vocab_size 0 the input is already [B, L, d_model]."""

    def __init__(self, cfg: Config, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_len = cfg.max_seq_len
        self.token = _embedding(vocab_size, cfg.embed_dim) if vocab_size else None
        self.scale = math.sqrt(cfg.d_model) if (cfg.embed_scale and vocab_size) else 1.0
        needs_proj = vocab_size and cfg.embed_dim != cfg.d_model
        self.proj = nn.Linear(cfg.embed_dim, cfg.d_model) if needs_proj else None
        self.pos: nn.Module | None = None
        if cfg.positional == "sinusoidal":
            self.pos = SinusoidalPositions(cfg.max_seq_len, cfg.d_model)
        elif cfg.positional == "learned":
            self.pos = LearnedPositions(cfg.max_seq_len, cfg.d_model)
        self.norm = make_norm(cfg) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.token is not None:
            x = self.token(x) * self.scale  # [B, L, d_embed]
        if self.proj is not None:
            x = self.proj(x)  # [B, L, d_model]
        if self.pos is not None:
            x = x + self.pos(x.size(1))
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


class Block(nn.Module):
    """One layer: self-attention, optional cross-attention, FFN; each wrapped in a residual
    connection with dropout and a norm, placed after (post-norm) or before (pre-norm)."""

    def __init__(self, cfg: Config, cross: bool) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"

        def attention(rope: bool) -> MultiHeadAttention:
            rotary = Rotary(cfg.d_k, cfg.rope_theta) if rope else None
            return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_bias, cfg.attention,
                                      cfg.dropout, cfg.kv_heads, cfg.d_k, rotary)

        # Rotary positions turn queries and keys of one sequence; cross-attention compares two
        # sequences, so it is left unrotated (as in T5-style encoder-decoders).
        self.self_attn = attention(cfg.positional == "rope")
        self.self_attn_norm = make_norm(cfg)
        self.cross_attn = attention(False) if cross else None
        self.cross_attn_norm = make_norm(cfg) if cross else None
        self.ffn = FeedForward(cfg)
        self.ffn_norm = make_norm(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(norm(x)))  # x + Sublayer(LayerNorm(x))
        return norm(x + self.dropout(sublayer(x)))  # LayerNorm(x + Sublayer(x)), the paper

    def forward(self, x: Tensor, mask: Tensor | None, memory: Tensor | None = None,
                cross_mask: Tensor | None = None) -> Tensor:
        x = self._residual(x, self.self_attn_norm, lambda h: self.self_attn(h, h, mask))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_attn_norm,
                               lambda h: self.cross_attn(h, memory, cross_mask))
        return self._residual(x, self.ffn_norm, self.ffn)


class Stack(nn.Module):
    """N identical blocks and an optional final norm (needed by pre-norm models)."""

    def __init__(self, cfg: Config, n_layers: int, cross: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(cfg, cross) for _ in range(n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else None

    def forward(self, x: Tensor, mask: Tensor | None, memory: Tensor | None = None,
                cross_mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask, memory, cross_mask)
        return self.norm(x) if self.norm is not None else x


# torch.nn.init's in-place initialisers, as modules call them (``nn.init.trunc_normal_(w)``).
INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_",
                "dirac_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
                "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def initialisers_skipping(skip):
    """While the block runs, torch.nn.init's initialisers return a tensor for which
    ``skip(tensor)`` holds unchanged; the others they initialise as ever. A module-wide
    patch: for building a model in one thread."""
    init = nn.init
    originals = {name: getattr(init, name) for name in INITIALISERS if hasattr(init, name)}

    def skipping(original):
        def initialiser(tensor, *args, **kwargs):
            return tensor if skip(tensor) else original(tensor, *args, **kwargs)
        return initialiser

    try:
        for name, original in originals.items():
            setattr(init, name, skipping(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(init, name, original)


def _matrices_left_for_xavier():
    """While the Transformer's layers are made, every matrix (a tensor of two or more
    dimensions) is left as it is: Transformer._reset_parameters draws each one again (xavier),
    so what the layers drew for them (Linear's kaiming, Embedding's normal) was thrown away: a
    third of building GPT-2 small on the CPU (1.1-1.2 s of CPU, 0.76-0.91 s without). Vectors
    keep their draws (Linear's bias bound comes from the weight's shape, not its values)."""
    return initialisers_skipping(lambda tensor: tensor.dim() > 1)


def _holds_values(t: Tensor) -> bool:
    """Whether ``t`` has numbers to draw: not on meta, not a fake tensor (a replay builds the
    model under FakeTensorMode: a draw there is a dispatch that changes nothing, ~0.1 ms a
    matrix, 23,000 of them in the test suite). Fake tensors exist only once torch's fake-tensor
    module is loaded."""
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    return t.device.type != "meta" and not (fake is not None and fake.is_fake(t))


class Transformer(nn.Module):
    """Encoder-decoder, decoder-only (n_encoder_layers=0) or encoder-only (n_decoder_layers=0).

    ``src_valid`` / ``tgt_valid`` ([B, S] / [B, T] bool, True = real token) mark padding; see
    :func:`tfcli.model.masks.valid_from_lengths` and :func:`tfcli.model.masks.valid_from_ids`.
    Returns logits [B, T, V_tgt], or hidden states [B, L, d_model] when there is no output
    projection (tgt_vocab_size 0, or encoder-only).
    """

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg

        def embeddings(vocab_size: int) -> Embeddings | None:
            if vocab_size or cfg.positional in ("sinusoidal", "learned") or cfg.embed_norm:
                return Embeddings(cfg, vocab_size)
            return None  # already-embedded inputs pass straight in, as in torch.nn.Transformer

        enc, dec = cfg.n_encoder_layers, cfg.n_decoder_layers
        with _matrices_left_for_xavier():
            self.src_embed = embeddings(cfg.src_vocab_size) if enc else None
            self.encoder = Stack(cfg, enc, cross=False) if enc else None
            self.tgt_embed = embeddings(cfg.tgt_vocab_size) if dec else None
            self.decoder = Stack(cfg, dec, cross=bool(enc)) if dec else None
            self.output = (nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
                           if cfg.has_output else None)
        self._tie_weights()
        self._reset_parameters()  # tied first: a shared matrix is drawn once

    def _reset_parameters(self) -> None:
        for p in self.parameters():
            if p.dim() > 1 and _holds_values(p):
                nn.init.xavier_uniform_(p)  # as torch.nn.Transformer and the Annotated Transformer

    def _tie_weights(self) -> None:
        tie = self.cfg.tie_embeddings
        if tie in ("src_tgt", "all"):
            self.tgt_embed.token.weight = self.src_embed.token.weight
        if tie in ("tgt_output", "all"):
            self.output.weight = self.tgt_embed.token.weight

    # --- forward ---------------------------------------------------------------------------

    def _embed(self, embed: Embeddings | None, x: Tensor, valid: Tensor | None,
               side: str) -> Tensor:
        vocab = embed.vocab_size if embed is not None else 0
        if vocab and (x.dim() != 2 or x.dtype.is_floating_point):
            raise InputError(f"{side}: expected token ids [B, L] (integer), got "
                             f"{x.dtype} {list(x.shape)}; {side}_vocab_size={vocab}")
        if not vocab and (x.dim() != 3 or x.size(-1) != self.cfg.d_model):
            raise InputError(f"{side}: expected embeddings [B, L, {self.cfg.d_model}] "
                             f"({side}_vocab_size=0), got {list(x.shape)}")
        positions = self.cfg.positional != "none"  # a table, or rotary angles per position
        if positions and x.size(1) > self.cfg.max_seq_len:
            raise InputError(f"{side}: length {x.size(1)} exceeds "
                             f"max_seq_len={self.cfg.max_seq_len}")
        if valid is not None and tuple(valid.shape) != tuple(x.shape[:2]):
            raise InputError(f"{side}_valid: expected shape {list(x.shape[:2])}, "
                             f"got {list(valid.shape)}")
        return embed(x) if embed is not None else x

    def encode(self, src: Tensor, src_valid: Tensor | None = None) -> Tensor:
        x = self._embed(self.src_embed, src, src_valid, "src")  # [B, S, d_model]
        window = self.cfg.attention_window
        mask = masks.encoder_self_mask(src_valid, x.size(1), x.device, window)  # [B|1, 1, 1|S, S]
        return self.encoder(x, mask)  # memory [B, S, d_model]

    def decode(self, tgt: Tensor, memory: Tensor | None = None, src_valid: Tensor | None = None,
               tgt_valid: Tensor | None = None) -> Tensor:
        x = self._embed(self.tgt_embed, tgt, tgt_valid, "tgt")  # [B, T, d_model]
        window = self.cfg.attention_window
        mask = masks.decoder_self_mask(tgt_valid, x.size(1), x.device, window)  # [B|1, 1, T, T]
        cross = masks.cross_attention_mask(src_valid) if memory is not None else None
        h = self.decoder(x, mask, memory, cross)  # [B, T, d_model]
        return self.output(h) if self.output is not None else h  # [B, T, V_tgt]

    def forward(self, src: Tensor | None = None, tgt: Tensor | None = None, *,
                src_valid: Tensor | None = None, tgt_valid: Tensor | None = None) -> Tensor:
        kind = self.cfg.kind
        if (src is None) == (self.encoder is not None) or (tgt is None) == (self.decoder is not None):
            wants = {"encoder-decoder": "src and tgt", "decoder-only": "tgt only",
                     "encoder-only": "src only"}[kind]
            raise InputError(f"this {kind} model takes {wants}")
        memory = self.encode(src, src_valid) if self.encoder is not None else None
        if self.decoder is None:
            return memory
        return self.decode(tgt, memory, src_valid, tgt_valid)


def build_model(cfg: Config, device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> Transformer:
    """Build ``cfg``. On ``device="meta"`` nothing is allocated or computed: shapes only.
    ``dtype`` (floating) is used for every parameter and buffer as they are created, so no
    conversion pass is needed (one is impossible under fake tensors)."""
    previous = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device):
            return Transformer(cfg)
    finally:
        torch.set_default_dtype(previous)


def example_inputs(cfg: Config, batch_size: int, src_len: int, tgt_len: int,
                   device: str | torch.device = "cpu", seed: int = 0) -> dict[str, Tensor | None]:
    """Random ``src`` / ``tgt`` for ``cfg``: token ids, or embeddings when a vocabulary is 0."""
    g = torch.Generator().manual_seed(seed)

    def side(vocab: int, length: int) -> Tensor:
        if vocab:
            return torch.randint(0, vocab, (batch_size, length), generator=g).to(device)
        return torch.randn(batch_size, length, cfg.d_model, generator=g).to(device)

    return {"src": side(cfg.src_vocab_size, src_len) if cfg.has_encoder else None,
            "tgt": side(cfg.tgt_vocab_size, tgt_len) if cfg.has_decoder else None}
