"""tfcli's own Transformer as a Subject: a configuration (preset + file + --set) and the model
it builds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tfcli.model.config import Config
from tfcli.subjects.base import Inputs, Subject


class OwnSubject(Subject):
    kind = "tfcli"
    kernels = ("naive", "sdpa")

    def __init__(self, cfg: Config, name: str | None = None) -> None:
        self.cfg = cfg
        self.label = f"{cfg.kind}" + (f" ({name})" if name else "")

    def build(self, device="meta", dtype=None, kernel=None) -> nn.Module:
        from tfcli.model.transformer import build_model

        cfg = self.cfg.replace(attention=kernel) if kernel and kernel != self.cfg.attention \
            else self.cfg
        return build_model(cfg, device, dtype)

    def make_inputs(self, model, sizes, device="meta", seed=0) -> Inputs:
        """Token ids (or embeddings when a vocabulary is 0) for src [B, S] and tgt [B, T]; on
        meta they are made there directly, so no batch or length costs memory."""
        cfg, batch = self.cfg, sizes["B"]
        g = torch.Generator().manual_seed(seed)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                     torch.float32)

        def side(vocab: int, length: int) -> Tensor:
            shape = (batch, length) if vocab else (batch, length, cfg.d_model)
            if str(device) == "meta":
                return torch.empty(shape, dtype=torch.long if vocab else dtype, device="meta")
            if vocab:
                return torch.randint(0, vocab, shape, generator=g).to(device)
            return torch.randn(shape, generator=g).to(device, dtype)

        kwargs = {}
        if cfg.has_encoder:
            kwargs["src"] = side(cfg.src_vocab_size, sizes["S"])
        if cfg.has_decoder:
            kwargs["tgt"] = side(cfg.tgt_vocab_size, sizes["T"])
        return Inputs((), kwargs)

    def length_dims(self) -> list[str]:
        return [d for d, present in (("S", self.cfg.has_encoder), ("T", self.cfg.has_decoder))
                if present]

    def loss(self, output) -> Tensor:
        """Cross-entropy over the target vocabulary when the model emits logits, else the mean
        square of the hidden states (a stand-in)."""
        if self.cfg.has_output:
            targets = torch.zeros(output.shape[:-1], dtype=torch.long, device=output.device)
            return F.cross_entropy(output.float().flatten(0, 1), targets.flatten())
        return output.float().square().mean()

    def loss_name(self) -> str:
        return "cross-entropy loss" if self.cfg.has_output else "mean-square loss on hidden states"

    def model_dims(self, model=None) -> dict[str, int]:
        return dimension_names(self.cfg)

    def windowed_flops(self, events) -> int | None:
        """Forward FLOPs counting only the (query, key) pairs a sliding window allows (exact,
        causal included), or None without a window. Cross-attention has no window."""
        from tfcli.model.masks import allowed_pairs

        window = self.cfg.attention_window
        if window is None:
            return None
        total = events[0].flops
        for e in events:
            if e.type != "Attend" or e.path.endswith("cross_attn.attend"):
                continue
            (batch, heads, t, d_k), d_v = e.inputs[0], e.inputs[2][-1]
            pairs = allowed_pairs(t, self.is_causal_scope(e.path), window)
            total += 2 * batch * heads * pairs * (d_k + d_v) - e.attention_flops
        return total

    def is_causal_scope(self, path: str) -> bool:
        return path.startswith("decoder.") and ".self_attn" in path  # decoder self-attention

    def describe(self) -> dict:
        return {**super().describe(), "config": self.cfg.to_dict()}

    _DIMS = {"src": ("B", "S"), "src_valid": ("B", "S"), "tgt": ("B", "T"),
             "tgt_valid": ("B", "T")}

    def input_dims(self, name: str) -> tuple | None:
        return self._DIMS.get(name)

    def mask_conventions(self) -> dict[str, tuple[str, str]]:
        how = "tfcli's own model: {} [B, {}], True = a real token"
        return {"src_valid": ("bool-allowed", how.format("src_valid", "S")),
                "tgt_valid": ("bool-allowed", how.format("tgt_valid", "T"))}

    def causal_inputs(self) -> list[str]:
        return ["tgt"] if self.cfg.has_decoder else []

    def windows(self) -> dict[str, tuple[int, bool]]:
        w = self.cfg.attention_window
        if w is None:
            return {}
        return {**({"S": (w, False)} if self.cfg.has_encoder else {}),
                **({"T": (w, True)} if self.cfg.has_decoder else {})}


def layers(model: nn.Module) -> list[nn.Module]:
    """Every layer of every stack of tfcli's model, the encoder's first: the units FSDP2 is
    applied to (tfcli.parallel.measure) and that tfcli's replays of its own model mark."""
    return [layer for stack in (model.encoder, model.decoder) if stack is not None
            for layer in stack.layers]


def dimension_names(cfg: Config, batch: int | None = None, src_len: int | None = None,
                    tgt_len: int | None = None) -> dict[str, int]:
    """The paper's names for the sizes in play: B, S, T, h, d_k, d_model, d_ff, V."""
    names = {"B": batch} if batch is not None else {}
    if cfg.has_encoder and src_len is not None:
        names["S"] = src_len
    if cfg.has_decoder and tgt_len is not None:
        names["T"] = tgt_len
    names.update(h=cfg.n_heads, d_k=cfg.d_k, d_model=cfg.d_model, d_ff=cfg.d_ff)
    if cfg.kv_heads != cfg.n_heads:
        names["h_kv"] = cfg.kv_heads
    if cfg.embed_dim != cfg.d_model:
        names["d_embed"] = cfg.embed_dim
    vocab = {"V_src": cfg.src_vocab_size, "V_tgt": cfg.tgt_vocab_size}
    vocab = {k: v for k, v in vocab.items() if v}
    if len(set(vocab.values())) == 1:  # one shared vocabulary: just V
        vocab = {"V": next(iter(vocab.values()))}
    names.update(vocab)
    return names
