"""The masks a configured model uses for an example batch, and a check that it obeys them.

The mask set is built with the same functions the model calls (:mod:`tfcli.model.masks`); the check
runs the model's own attention (naive path, which returns its weights) and compares what it did
with what the masks allow. Convention: bool, True = may attend.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tfcli.model import masks
from tfcli.model.attention import Attend
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


# --- verification -----------------------------------------------------------------------------


@dataclass
class LayerCheck:
    path: str
    mask: str  # key of the NamedMask this layer must obey
    max_blocked_weight: float  # must be 0
    nan: bool

    @property
    def ok(self) -> bool:
        return self.max_blocked_weight == 0.0 and not self.nan


@dataclass
class EmptyRow:
    mask: str
    batch: int
    query: int
    output: str  # "zeros", "NaN" or "nonzero"


@dataclass
class CheckReport:
    layers: list[LayerCheck] = field(default_factory=list)
    causal_ok: bool | None = None  # None: not applicable (no decoder)
    causal_detail: str = ""
    padding_ok: bool | None = None  # None: nothing is padded in the example batch
    padding_detail: str = ""
    empty_rows: list[EmptyRow] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (all(layer.ok for layer in self.layers) and self.causal_ok is not False
                and self.padding_ok is not False
                and all(row.output == "zeros" for row in self.empty_rows))


def _mask_key(attention_path: str) -> str:
    """Which mask an attention module of tfcli's model must obey, from where it sits."""
    if attention_path.endswith("cross_attn"):
        return "cross"
    return "decoder_self" if attention_path.startswith("decoder.") else "encoder_self"


def _attention_records(model: nn.Module, inputs: dict) -> tuple[Tensor, list]:
    """Run the model once; return its output and (path, weights, out) for each Attend call."""
    records: list[tuple[str, Tensor | None, Tensor]] = []
    handles = []
    try:
        for path, module in model.named_modules():
            if isinstance(module, Attend):
                handles.append(module.register_forward_hook(
                    lambda m, args, out, path=path: records.append((path, out[1], out[0]))))
        with torch.no_grad():
            output = model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return output, records


def _perturb(x: Tensor, where: Tensor, vocab: int) -> Tensor:
    """Change the tokens (or vectors) at ``where`` [B, L]."""
    x = x.clone()
    if vocab:
        x[where] = (x[where] + 1) % vocab
    else:
        x[where] = x[where] + 1.0
    return x


def check_model(model: nn.Module, cfg: Config, inputs: dict, src_valid: Tensor | None,
                tgt_valid: Tensor | None) -> CheckReport:
    """Does ``model`` (in eval mode, attention returning weights) obey the masks for this batch?"""
    model.eval()
    expected = {m.key: m for m in mask_set(cfg, src_valid, tgt_valid)}
    batch_inputs = dict(inputs, src_valid=src_valid, tgt_valid=tgt_valid)
    batch_inputs = {k: v for k, v in batch_inputs.items() if v is not None}
    output, records = _attention_records(model, batch_inputs)
    report = CheckReport()

    empty_seen: set[tuple[str, int, int]] = set()
    for path, weights, out in records:
        assert weights is not None, "the check needs the naive attention path (it returns weights)"
        attention_path = path.rpartition(".")[0]
        key = _mask_key(attention_path)
        allowed = expected[key].expanded(*weights.shape[:1], *weights.shape[2:])  # [B, Q, K]
        blocked_weights = weights.masked_fill(allowed[:, None], 0.0)  # [B, h, Q, K]
        report.layers.append(LayerCheck(attention_path, key,
                                        float(blocked_weights.abs().amax()),
                                        bool(weights.isnan().any() or out.isnan().any())))
        for b, q in (~allowed.any(-1)).nonzero().tolist():
            if (key, b, q) in empty_seen:
                continue
            empty_seen.add((key, b, q))
            row = out[b, :, q]
            state = "NaN" if row.isnan().any() else ("zeros" if not row.any() else "nonzero")
            report.empty_rows.append(EmptyRow(key, b, q, state))

    if cfg.has_decoder:
        t = inputs["tgt"].size(1)
        k = t // 2
        if k == 0:
            report.causal_detail = "target length 1: nothing earlier to compare"
        else:
            later = torch.zeros(inputs["tgt"].shape[:2], dtype=torch.bool)
            later[:, k:] = True
            changed = dict(batch_inputs, tgt=_perturb(inputs["tgt"], later, cfg.tgt_vocab_size))
            again = _attention_records(model, changed)[0]
            diff = float((again[:, :k] - output[:, :k]).abs().amax())
            report.causal_ok = diff == 0.0
            report.causal_detail = (f"changed target tokens {k}..{t - 1}; outputs at 0..{k - 1} "
                                    f"moved by at most {diff:.3g}")

    pads = [(side, valid) for side, valid in (("src", src_valid), ("tgt", tgt_valid))
            if valid is not None and not bool(valid.all())]
    if pads:
        changed = dict(batch_inputs)
        for side, valid in pads:
            vocab = cfg.src_vocab_size if side == "src" else cfg.tgt_vocab_size
            changed[side] = _perturb(inputs[side], ~valid, vocab)
        again = _attention_records(model, changed)[0]
        real = tgt_valid if cfg.has_decoder else src_valid
        diff = float((again - output)[real].abs().amax()) if real.any() else 0.0
        report.padding_ok = diff == 0.0
        report.padding_detail = (f"changed every padded {' and '.join(s for s, _ in pads)} token; "
                                 f"outputs at real positions moved by at most {diff:.3g}")
    else:
        report.padding_detail = "nothing is padded in this batch"
    return report
