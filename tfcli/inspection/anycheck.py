"""Mask checks for any model, from its inputs and outputs and from the attention it computes.

- Causality of an input: changing its tokens after position t leaves the outputs at positions
  before t unchanged.
- Padding: with positions past each sequence's length set to the pad id (and zeroed in any
  ``*mask*`` input of the same shape), growing the padded length — and, where a mask input
  exists, changing the padded content — leaves the real positions' outputs unchanged; no
  output is NaN, also for a sequence that is all padding.
- Where attention can be seen (a softmax taking a product of activations, or SDPA with a mask
  or ``is_causal``), the largest weight any query with an allowed key put on a blocked key.
Convention: bool, True = may attend. Runs for real on the CPU, at the example's small sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tfcli.errors import TfcliError
from tfcli.inspection.ops import Op, OpObserver
from tfcli.subjects.base import Inputs, RunFailed, primary_output, running

TOLERANCE = 1e-5  # relative to the output's largest magnitude: same arithmetic, other shapes


@dataclass
class SeenAttention:
    path: str  # the module whose forward computed it
    how: str  # "softmax of Q·Kᵀ" or "scaled_dot_product_attention"
    scores: list[int]  # [B, h, T, S]
    allowed: Tensor | None = None  # [B, T, S] as head 0 saw it; None when nothing was masked
    max_blocked_weight: float | None = None  # over query rows with at least one allowed key
    empty_rows: int = 0  # query rows with no allowed key (their weights are the model's choice)
    nan: bool = False

    @property
    def ok(self) -> bool:
        return not self.nan and (self.max_blocked_weight or 0.0) == 0.0

    def to_dict(self) -> dict:
        return {"path": self.path, "how": self.how, "scores": self.scores,
                "max_blocked_weight": self.max_blocked_weight, "empty_rows": self.empty_rows,
                "nan": self.nan, "ok": self.ok,
                "allowed": self.allowed.tolist() if self.allowed is not None else None}


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable here
    detail: str


@dataclass
class AnyReport:
    attention: list[SeenAttention] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(a.ok for a in self.attention) and all(c.ok is not False for c in self.checks)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "attention": [a.to_dict() for a in self.attention],
                "checks": [vars(c) for c in self.checks]}


def run_and_capture(model: nn.Module, inputs: Inputs) -> tuple[Tensor, list[SeenAttention]]:
    """One forward pass (no grad); every attention call seen, with what it blocked."""
    seen: list[SeenAttention] = []
    stack: list[str] = []
    names = {id(m): path for path, m in model.named_modules()}
    def enter(module, args) -> None:
        stack.append(names.get(id(module), "?"))

    def leave(module, args, output) -> None:  # returns None: a hook's value would replace output
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]

    def on_op(op: Op) -> None:
        if op.kind == "softmax" and op.weights is not None and op.weights.dim() >= 3:
            seen.append(_summarise(stack[-1] if stack else "", "softmax of Q·Kᵀ", op))
        elif op.kind == "sdpa":
            seen.append(_summarise(stack[-1] if stack else "", "scaled_dot_product_attention",
                                   op))

    try:
        with running(model), torch.no_grad(), OpObserver(on_op, keep_values=True):
            output = primary_output(inputs(model))
    finally:
        for h in handles:
            h.remove()
    return output, seen


def _summarise(path: str, how: str, op: Op) -> SeenAttention:
    record = SeenAttention(path, how, list(op.shape or []))
    if op.weights is None:
        return record
    weights = op.weights.float()
    record.nan = bool(weights.isnan().any())
    if op.blocked is None:
        return record
    blocked = op.blocked.expand(weights.shape)
    has_key = (~blocked).any(-1, keepdim=True)  # rows with at least one allowed key
    on_blocked = weights.masked_fill(~blocked | ~has_key, 0.0)
    record.max_blocked_weight = float(on_blocked.abs().amax()) if on_blocked.numel() else 0.0
    allowed = ~blocked
    record.allowed = allowed.reshape(allowed.size(0), -1, *allowed.shape[-2:])[:, 0]  # head 0
    record.empty_rows = int((~record.allowed.any(-1)).sum())
    return record


def _perturb(x: Tensor, where: Tensor, high: int, pad_id: int | None) -> Tensor:
    """Other tokens (or vectors) at ``where`` [B, L]; never the pad id."""
    x = x.clone()
    if x.is_floating_point():
        x[where] = x[where] + 1.0
        return x
    new = (x[where] + 1) % high
    if pad_id is not None:
        new = torch.where(new == pad_id, (new + 1) % high, new)
    x[where] = new
    return x


def _moved(a: Tensor, b: Tensor, where: Tensor | None = None) -> float:
    diff = (a.float() - b.float()).abs()
    if where is not None:
        diff = diff[where]
    return float(diff.amax()) if diff.numel() else 0.0


def check_any(model: nn.Module, inputs: Inputs, causal: list[str], lengths: dict[str, list[int]],
              pad_id: int | None, high: int) -> tuple[AnyReport, list[SeenAttention]]:
    """Run the checks on ``inputs`` (already padded by :func:`pad_inputs`)."""
    model.eval()
    named = inputs.named(model)
    output, seen = run_and_capture(model, inputs)
    report = AnyReport(attention=seen)
    scale = max(1.0, float(output.float().abs().amax())) * TOLERANCE
    report.checks.append(Check("no NaN", not bool(output.isnan().any()),
                               "every output is a number" if not output.isnan().any()
                               else "the output holds NaN"))
    for name in causal:
        x = named[name]
        t = x.size(1) // 2
        if t == 0 or output.dim() < 2 or output.size(1) != x.size(1):
            report.checks.append(Check(f"causality of {name}", None,
                                       f"the output's positions do not line up with {name}'s"))
            continue
        later = torch.zeros(x.shape[:2], dtype=torch.bool)
        later[:, t:] = True
        again = primary_output(_call(model, inputs.replace(model, name,
                                                           _perturb(x, later, high, pad_id))))
        moved = _moved(again[:, :t], output[:, :t])
        report.checks.append(Check(
            f"causality of {name}", moved <= scale,
            f"changed {name}'s tokens {t}..{x.size(1) - 1}; outputs at 0..{t - 1} moved by at "
            f"most {moved:.3g}"))
    for name, lens in lengths.items():
        report.checks.extend(_padding_checks(model, inputs, named, output, name, lens, pad_id,
                                             high, scale))
    return report, seen


def _call(model, inputs: Inputs):
    with running(model, during="on changed inputs, checking the masks"), torch.no_grad():
        return inputs(model)


def _mask_inputs(named: dict, name: str) -> list[str]:
    x = named[name]
    return [k for k, v in named.items() if k != name and "mask" in k.lower()
            and isinstance(v, Tensor) and tuple(v.shape) == tuple(x.shape[:2])]


def pad_inputs(model: nn.Module, inputs: Inputs, lengths: dict[str, list[int]],
               pad_id: int | None) -> Inputs:
    """Positions past each length become ``pad_id`` (and 0 in matching mask inputs)."""
    named = inputs.named(model)
    for name, lens in lengths.items():
        x = named[name]
        valid = torch.arange(x.size(1))[None, :] < torch.tensor(lens)[:, None]  # [B, L]
        if not x.is_floating_point():
            if pad_id is None:
                raise TfcliError(f"--lengths {name}: say which token id is padding with --pad-id")
            x = x.masked_fill(~valid, pad_id)
        else:
            x = x.masked_fill(~valid[..., None], 0.0)
        inputs = inputs.replace(model, name, x)
        for mask_name in _mask_inputs(named, name):
            inputs = inputs.replace(model, mask_name, named[mask_name] * valid.to(
                named[mask_name].dtype) if named[mask_name].dtype != torch.bool
                else named[mask_name] & valid)
        named = inputs.named(model)
    return inputs


def _padding_checks(model, inputs, named, output, name, lens, pad_id, high, scale) -> list[Check]:
    x = named[name]
    valid = torch.arange(x.size(1))[None, :] < torch.tensor(lens)[:, None]
    aligned = output.dim() >= 2 and output.size(1) == x.size(1)
    real = valid if aligned else torch.ones(output.shape[:2], dtype=torch.bool)
    out: list[Check] = []
    if bool(valid.all()):
        return [Check(f"padding of {name}", None, "nothing is padded")]
    masks = _mask_inputs(named, name)
    if masks:  # the model is told where padding is: its content must not matter
        changed = inputs.replace(model, name, _perturb(x, ~valid, high, pad_id))
        moved = _moved(primary_output(_call(model, changed)), output, real)
        out.append(Check(f"padding of {name}: content", moved <= scale,
                         f"changed every padded token of {name} (masked by "
                         f"{', '.join(masks)}); real positions' outputs moved by at most "
                         f"{moved:.3g}"))
    grow = 2  # two more padded positions at the end
    extra = {name: torch.cat([x, x[:, -1:].expand(-1, grow, *x.shape[2:]).clone()], 1)}
    if not x.is_floating_point():
        extra[name][:, -grow:] = pad_id
    else:
        extra[name][:, -grow:] = 0.0
    for mask_name in masks:
        m = named[mask_name]
        extra[mask_name] = torch.cat([m, torch.zeros_like(m[:, :1]).expand(-1, grow)], 1)
    grown = inputs
    for key, value in extra.items():
        grown = grown.replace(model, key, value)
    try:
        longer = primary_output(_call(model, grown))
    except RunFailed as failed:  # e.g. a position table no longer than the input
        return out + [Check(f"padding of {name}: length", None,
                            f"the model does not take {x.size(1) + grow} positions "
                            f"({type(failed.__cause__).__name__})")]
    if aligned:
        longer = longer[:, :x.size(1)]
    moved = _moved(longer, output, real)
    out.append(Check(f"padding of {name}: length", moved <= scale,
                     f"{grow} more padded positions; real positions' outputs moved by at most "
                     f"{moved:.3g}"))
    return out
