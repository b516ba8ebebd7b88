"""The masks a configured model uses for an example batch, as rules and as tensors.

The mask set is built with the same functions the model calls (:mod:`tfcli.model.masks`); the
check that the model obeys them is :mod:`tfcli.inspection.verdict`, the same for every subject.
Convention: bool, True = may attend.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from tfcli.model import masks
from tfcli.model.config import Config


@dataclass
class NamedMask:
    key: str  # encoder_self, decoder_causal, decoder_padding, decoder_self, cross
    name: str
    description: str
    mask: Tensor | None  # as stored, bool, True = may attend; broadcastable to [B, h, Q, K]
    query_side: str  # "src" or "tgt"
    key_side: str
    used_by_model: bool  # False for the components shown only to explain the combination
    # The same mask as a rule on positions (see shown_cells): each query may attend to one
    # span of keys (structure: "causal", "band" = both sides, or None = every key; window: its
    # width), AND, with padded, only to the key side's real tokens.
    structure: str | None = None
    window: int | None = None
    padded: bool = False

    def expanded(self, batch: int, q_len: int, k_len: int) -> Tensor:
        """[B, Q, K]: the mask as every head sees it."""
        return self.mask.expand(batch, 1, q_len, k_len)[:, 0]

    def stored_shape(self, batch: int, q_len: int, k_len: int) -> list[int]:
        """The shape the model's mask functions give it, [B|1, 1, Q|1, K], without building it."""
        return [batch if self.padded else 1, 1, q_len if self.structure else 1, k_len]

    def key_span(self, queries: Tensor, k_len: int) -> tuple[Tensor, Tensor]:
        """First and last key (inclusive) each query position may attend to, padding aside."""
        return masks.key_span(queries, k_len, self.structure == "causal",
                              self.window if self.structure else None)


def mask_rules(cfg: Config) -> list[NamedMask]:
    """The masks tfcli's model builds, as rules (no tensors): what each allows and why."""
    out: list[NamedMask] = []
    window = cfg.attention_window
    if cfg.has_encoder:
        if window is not None:
            out.append(NamedMask("encoder_window", "encoder sliding window",
                                 f"query i may attend to keys j with |i - j| < {window}",
                                 None, "src", "src", False, "band", window))
        out.append(NamedMask("encoder_self", "encoder self-attention",
                             "source padding: every query may attend to every real source token"
                             if window is None else "sliding window AND source padding "
                             "(what the model uses)", None, "src", "src", True,
                             None if window is None else "band", window, padded=True))
    if cfg.has_decoder:
        structure = (NamedMask("decoder_causal", "decoder causal",
                               "query i may attend to keys 0..i (itself and the past)",
                               None, "tgt", "tgt", False, "causal")
                     if window is None else
                     NamedMask("decoder_window", "decoder causal sliding window",
                               f"query i may attend to keys j with i - {window} < j <= i",
                               None, "tgt", "tgt", False, "causal", window))
        out += [
            structure,
            NamedMask("decoder_padding", "decoder target padding",
                      "every query may attend to every real target token",
                      None, "tgt", "tgt", False, padded=True),
            NamedMask("decoder_self", "decoder self-attention",
                      f"{'causal' if window is None else 'causal window'} AND target padding "
                      f"(what the model uses)", None, "tgt", "tgt", True, "causal", window,
                      padded=True),
        ]
    if cfg.has_encoder and cfg.has_decoder:
        out.append(NamedMask("cross", "cross-attention (memory)",
                             "target queries x source keys: source padding only",
                             None, "tgt", "src", True, padded=True))
    return out


def mask_set(cfg: Config, src_valid: Tensor | None, tgt_valid: Tensor | None) -> list[NamedMask]:
    """The masks tfcli's model builds for this batch, by the functions it calls itself."""
    window = cfg.attention_window
    s = src_valid.size(1) if src_valid is not None else 0
    t = tgt_valid.size(1) if tgt_valid is not None else 0
    built = {
        "encoder_window": lambda: masks.sliding_window(s, window, False)[None, None],
        "encoder_self": lambda: masks.encoder_self_mask(src_valid, s, window=window),
        "decoder_causal": lambda: masks.causal(t)[None, None],
        "decoder_window": lambda: masks.sliding_window(t, window, True)[None, None],
        "decoder_padding": lambda: masks.key_padding(tgt_valid),
        "decoder_self": lambda: masks.decoder_self_mask(tgt_valid, t, window=window),
        "cross": lambda: masks.cross_attention_mask(src_valid),
    }
    out = mask_rules(cfg)
    for m in out:
        m.mask = built[m.key]()
    return out
