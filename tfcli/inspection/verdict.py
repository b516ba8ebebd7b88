"""One mask checker for every subject: does the model obey the masks it is asked to obey?

What is asserted comes from the user (``--causal NAME``, ``--lengths NAME=N,N``) or from the
subject (tfcli's own decoder is causal, its padding is ``src_valid``/``tgt_valid``). Every mask
*argument* is built from those lengths and that causality, in the convention settled by
:mod:`tfcli.inspection.maskargs` (a probe decides where nothing else does). Then:

- **no NaN** in the output (and, listed only when it fails, **no infinity**: a change at an
  infinite output cannot be seen);
- **causality of NAME at every position**: for each split t, changing NAME's real tokens after t
  leaves every real output at or before t unchanged;
- **padding of NAME**: changing the padded content (where a mask argument tells the model where
  padding is) and growing the padded length leave the real outputs unchanged;
- **each attention call** seen in the model (a softmax over Q·Kᵀ, SDPA, nn.MultiheadAttention):
  the largest weight a real query put on a key that the *asserted* pattern blocks (causal,
  window, padding), not only on what the model's own mask blocked.

Each check is passed, failed or not checked (with its reason); the verdict is PASSED only when
every check ran and passed. Output checks judge a plain run of the model; the attention calls
come from an observed run, and if observing changed the output, that is said.
Convention inside: bool, True = may attend. Runs for real on the CPU at the example's sizes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from tfcli.errors import TfcliError
from tfcli.inspection import maskargs
from tfcli.inspection.maskargs import MaskArg
from tfcli.subjects.base import Inputs, RunFailed, primary_output, running

TOLERANCE = 1e-5  # of each output channel's largest magnitude (see tolerance())
SEED = 0  # every run of the model starts from the same random state
GROW = 2  # padded positions the padding-length check adds
WEIGHT_TOLERANCE = 1e-6  # a blocked key's weight: exp(-1e9) and exp(-inf) are exactly 0
UNBLOCKED = "no key blocked"  # what attention along a length no mask reaches is held to


@dataclass
class Check:
    name: str
    status: str  # "passed", "failed", "not checked"
    detail: str
    asserted: str | None = None  # an attention call's: the pattern its weights were held to

    @property
    def ok(self) -> bool | None:
        return {"passed": True, "failed": False}.get(self.status)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "ok": self.ok, "detail": self.detail,
                "asserted": self.asserted}


def _judged(name: str, move: Move, detail: str) -> Check:
    return Check(name, "failed" if move.leaks else "passed", detail)


@dataclass
class Seq:
    """A sequence input: tokens [B, L] or vectors [B, L, d] (axes as its --input says)."""
    name: str
    letter: str
    batch_axis: int = 0
    length_axis: int = 1


@dataclass
class Plan:
    """What the model is fed and what it must obey."""
    base: Inputs  # as the subject made them; sequences and masks are replaced
    seqs: dict[str, Seq]
    masks: list[MaskArg]
    valid: dict[str, Tensor]  # letter -> [B, L] bool, True = real token
    causal: set[str]  # letters whose self-attention must be causal
    sizes: dict[str, int]  # letter -> padded length
    batch: int
    pad_id: int | None
    high: int  # token ids are drawn below this
    windows: dict[str, tuple[int, bool]] = field(default_factory=dict)  # letter -> (W, causal)
    notes: list[str] = field(default_factory=list)
    # lengths no mask reaches (patches, audio frames): letter -> (size, where, what they are)
    unmasked: dict[str, tuple[int, str, str]] = field(default_factory=dict)

    def values(self, model: nn.Module) -> dict[str, Tensor]:
        """The sequences as the plan feeds them (padded positions filled)."""
        named = self.base.named(model)
        return {name: named[name] for name in self.seqs}


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    masks: list[MaskArg] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seen: list = field(default_factory=list)  # the observed run's attention calls (for drawing)

    @property
    def status(self) -> str:
        if any(c.status == "failed" for c in self.checks):
            return "failed"
        return "passed" if self.checks and all(c.status == "passed" for c in self.checks) \
            else "incomplete"

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def exit_code(self) -> int:
        return {"passed": 0, "failed": 1, "incomplete": 3}[self.status]

    def headline(self) -> str:
        failed = [c for c in self.checks if c.status == "failed"]
        skipped = [c for c in self.checks if c.status == "not checked"]
        if failed:
            return f"FAILED: {len(failed)} of {len(self.checks)} checks failed"
        if skipped or not self.checks:
            n = len(skipped)
            return (f"INCOMPLETE: {n} of {len(self.checks)} checks could not run; none failed"
                    if self.checks else "INCOMPLETE: nothing to check")
        return f"PASSED: all {len(self.checks)} checks ran and passed"

    def to_dict(self) -> dict:
        return {"verdict": self.status, "passed": self.passed, "headline": self.headline(),
                "checks": [c.to_dict() for c in self.checks],
                "masks": [m.to_dict() for m in self.masks], "notes": self.notes}


# --- feeding the model ----------------------------------------------------------------------


def feed(model: nn.Module, plan: Plan, values: dict[str, Tensor], valid: dict[str, Tensor],
         sizes: dict[str, int], conventions: dict[str, str] | None = None) -> Inputs:
    """``plan.base`` with the sequences replaced by ``values`` and every mask argument built
    from ``valid``/``plan.causal`` at ``sizes`` in its convention (or ``conventions``)."""
    inputs = plan.base
    for name, value in values.items():
        inputs = inputs.replace(model, name, value)
    for arg in plan.masks:
        convention = (conventions or {}).get(arg.name, arg.convention)
        allowed = maskargs.allowed_pattern(arg, valid, sizes, plan.causal, plan.batch,
                                           plan.windows)
        inputs = inputs.replace(model, arg.name, maskargs.build(arg, allowed, convention))
    return inputs


def _run(model: nn.Module, inputs: Inputs, during: str, seed: int = SEED,
         watch=None) -> Tensor:
    """One run on fresh copies of ``inputs`` (a model may change its inputs in place), with
    the random numbers seeded alike, so that dropout left on in eval or noise drawn in
    forward is the same in the runs a check compares; ``watch``: a mode observing it."""
    fresh = Inputs(*tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t,
                             (inputs.args, inputs.kwargs)))
    torch.manual_seed(seed)
    with running(model, during=during), torch.no_grad(), watch or contextlib.nullcontext():
        return primary_output(fresh(model))


def _as_bl(output: Tensor, seq: Seq, length: int, batch: int) -> Tensor | None:
    """``output`` as [B, L, …] along ``seq``'s positions, or None if they do not line up."""
    shape = list(output.shape)
    b, l = seq.batch_axis, seq.length_axis
    if not (len(shape) > max(b, l) and shape[b] == batch and shape[l] == length):
        ls = [i for i, n in enumerate(shape) if n == length]
        bs = [i for i, n in enumerate(shape) if n == batch and i not in ls]
        if len(ls) != 1 or len(bs) != 1:
            return None
        b, l = bs[0], ls[0]
    return output.movedim((b, l), (0, 1))


def tolerance(output: Tensor) -> Tensor:
    """How far each output value may move and still count as unchanged (same arithmetic on
    other shapes rounds differently): TOLERANCE of the largest magnitude in its channel (the
    last axis of a [B, L, C] output; the whole output otherwise), at least TOLERANCE. Per
    channel, so one huge channel (a logit forbidden with -1e9) loosens no other."""
    x = output.detach().float().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
    if not x.numel():  # an empty output: nothing can move
        return torch.full_like(x, TOLERANCE)
    per = x.amax(dim=tuple(range(x.dim() - 1)), keepdim=True) if x.dim() >= 3 else x.amax()
    return (per.clamp(min=1.0) * TOLERANCE).expand(x.shape)


@dataclass
class Move:
    """How far outputs moved: the largest change, and whether any exceeded its tolerance."""
    size: float = 0.0
    leaks: bool = False

    def __or__(self, other: Move) -> Move:
        return Move(max(self.size, other.size), self.leaks or other.leaks)


def _move(a: Tensor, b: Tensor, where: Tensor, tol: Tensor) -> Move:
    """The move from ``b`` to ``a`` at ``where``: equal values (the same infinity too) did not
    move; NaN on one side only is a move."""
    diff = (a.float() - b.float()).abs()
    same = (a == b) | (a.isnan() & b.isnan())  # inf - inf is NaN, but inf did not move
    diff = torch.where(same, 0.0, diff.nan_to_num(float("inf")))[where]
    if not diff.numel():
        return Move()
    return Move(float(diff.amax()), bool((diff > tol[where]).any()))


def _perturb(x: Tensor, seq: Seq, where: Tensor, high: int, pad_id: int | None) -> Tensor:
    """Other tokens (or vectors) at ``where`` [B, L]; never the pad id."""
    x = x.clone()
    xv = x.movedim((seq.batch_axis, seq.length_axis), (0, 1))  # a view of x
    if x.is_floating_point():
        xv[where] = xv[where] + 1.0
        return x
    new = (xv[where] + 1) % max(high, 2)
    if pad_id is not None:
        new = torch.where(new == pad_id, (new + 1) % max(high, 2), new)
    xv[where] = new
    return x


def _grow(x: Tensor, seq: Seq, grow: int, pad_id: int | None) -> Tensor:
    """``x`` with ``grow`` more padded positions at the end."""
    tail_shape = list(x.shape)
    tail_shape[seq.length_axis] = grow
    fill = 0 if x.is_floating_point() or pad_id is None else pad_id
    return torch.cat([x, torch.full(tail_shape, fill, dtype=x.dtype)], seq.length_axis)


# --- conventions ------------------------------------------------------------------------------


def carries(arg: MaskArg, plan: Plan) -> bool:
    """Whether the mask built for ``arg`` blocks anything (padding or a causal pattern)."""
    padded = arg.key in plan.valid and arg.per_sequence and not bool(plan.valid[arg.key].all())
    return padded or (arg.query is not None and arg.query == arg.key and arg.key in plan.causal)


def settle_conventions(model: nn.Module, plan: Plan, say: Callable[[str], None]) -> None:
    """Give every mask argument a convention: probe those that have none."""
    open_ = [a for a in plan.masks if a.convention is None]
    if not open_:
        return
    quiet = [a for a in open_ if not carries(a, plan)]
    if quiet:
        names = ", ".join(a.name for a in quiet)
        choices = ", ".join(maskargs.CANDIDATES[maskargs.dtype_kind(quiet[0].dtype)])
        raise TfcliError(f"mask argument {names}: nothing here is padded or causal along its "
                         f"axes, so no probe can tell its convention; give --mask "
                         f"{quiet[0].name}=CONVENTION ({choices}), or --lengths/--causal for "
                         f"the sequence it masks")
    combos = list(itertools.product(*(maskargs.CANDIDATES[maskargs.dtype_kind(a.dtype)]
                                      for a in open_)))
    results, failures = [], []
    for combo in combos:
        say(f"probing mask conventions: {', '.join(combo)}")
        conventions = {a.name: c for a, c in zip(open_, combo)}
        try:
            results.append((combo, _influence(model, plan, conventions)))
        except RunFailed as failed:  # perhaps only under a convention read the wrong way
            failures.append(failed)
            results.append((combo, math.inf))
    clean = [combo for combo, moved in results if moved == 0.0]
    if failures and not clean:  # no convention ran clean: report the model's own failure
        raise failures[0]
    figures = "; ".join(f"{'/'.join(combo)}: "
                        + ("no influence" if moved == 0.0 else f"moved {moved:.3g}")
                        for combo, moved in results)
    names = ", ".join(a.name for a in open_)
    if len(clean) != 1 and len(combos) == 1:
        raise TfcliError(f"mask argument {names}: under {combos[0][0]}, the only convention "
                         f"of its dtype tfcli builds, the blocked positions kept their "
                         f"influence ({figures}); if the model reads it another way (1 = "
                         f"blocked), give it as bool, else --mask {open_[0].name}="
                         f"{combos[0][0]} checks the model as it is")
    if len(clean) != 1:
        why = ("under no convention did the blocked positions lose their influence (the model "
               "may ignore the mask: --mask lets the check report that)" if not clean
               else "blocked positions had no influence under more than one convention")
        raise TfcliError(f"mask argument {names}: cannot tell its convention — {why} "
                         f"({figures}); say it with --mask {open_[0].name}=CONVENTION")
    moves = [m for c, m in results if c != clean[0]]
    for arg, convention in zip(open_, clean[0]):
        arg.convention = convention
        arg.how = (f"probe: of {len(results)} conventions tried for {names}, only "
                   f"{'/'.join(clean[0])} left the blocked positions without influence on the "
                   f"real outputs" + (f" (the others moved them by {min(moves):.3g} or more)"
                                      if moves else ""))


def _influence(model: nn.Module, plan: Plan, conventions: dict[str, str]) -> float:
    """How far the blocked positions moved real outputs under ``conventions`` (0: within
    tolerance; inf: NaN at a real position): causality at the first split (every later token
    changed; a convention read the wrong way round leaks there), and padded content where a
    mask tells where padding is. The check proper then tests every split."""
    values = plan.values(model)
    inputs = feed(model, plan, values, plan.valid, plan.sizes, conventions)
    output = _run(model, inputs, "probing mask conventions")
    tol = tolerance(output)
    worst = Move()
    for seq in plan.seqs.values():
        out = _as_bl(output, seq, plan.sizes[seq.letter], plan.batch)
        real = plan.valid.get(seq.letter)
        if out is not None and real is not None and bool(out[real].isnan().any()):
            return math.inf
        if seq.letter in plan.causal and out is not None:
            for move, _ in _causal_moves(model, plan, seq, values, conventions, output, tol,
                                         first_only=True):
                worst |= move
        if seq.letter in plan.valid and _told(plan, seq.letter):
            worst |= _content_move(model, plan, seq, values, conventions, output, tol)
    return worst.size if worst.leaks else 0.0


# --- the checks -------------------------------------------------------------------------------


def _told(plan: Plan, letter: str) -> bool:
    """Whether a mask argument tells the model where ``letter``'s padding is."""
    return any(a.key == letter and a.per_sequence for a in plan.masks)


def _real_outputs(plan: Plan, output: Tensor) -> list[tuple[Seq, Tensor, Tensor]]:
    """(sequence, output as [B, L, …], real positions [B, L]) for each sequence the output's
    positions line up with."""
    out = []
    for seq in plan.seqs.values():
        bl = _as_bl(output, seq, plan.sizes[seq.letter], plan.batch)
        if bl is not None:
            real = plan.valid.get(seq.letter,
                                  torch.ones(plan.batch, plan.sizes[seq.letter], dtype=torch.bool))
            out.append((seq, bl, real))
    return out


def _causal_moves(model, plan: Plan, seq: Seq, values, conventions, output, tol,
                  first_only: bool = False):
    """For each split t: (the move of the real outputs at or before t when the real tokens
    after t change, t). Yields nothing when the output does not line up with ``seq``."""
    length = plan.sizes[seq.letter]
    base = _as_bl(output, seq, length, plan.batch)
    if base is None:
        return
    tol = _as_bl(tol, seq, length, plan.batch)
    real = plan.valid.get(seq.letter, torch.ones(plan.batch, length, dtype=torch.bool))
    positions = torch.arange(length)
    for t in range(length - 1):
        later = (positions > t)[None, :] & real
        if not bool(later.any()):
            continue
        changed = dict(values, **{seq.name: _perturb(values[seq.name], seq, later, plan.high,
                                                     plan.pad_id)})
        inputs = feed(model, plan, changed, plan.valid, plan.sizes, conventions)
        again = _as_bl(_run(model, inputs, f"changing {seq.name} after position {t}"), seq,
                       length, plan.batch)
        earlier = (positions <= t)[None, :] & real
        yield _move(again, base, earlier, tol), t
        if first_only:
            return


def _content_move(model, plan: Plan, seq: Seq, values, conventions, output, tol) -> Move:
    padded = ~plan.valid[seq.letter]
    changed = dict(values, **{seq.name: _perturb(values[seq.name], seq, padded, plan.high,
                                                 plan.pad_id)})
    inputs = feed(model, plan, changed, plan.valid, plan.sizes, conventions)
    again = _run(model, inputs, f"changing {seq.name}'s padded content")
    reals = _real_outputs(plan, output)
    if not reals:  # positions line up with no sequence: all of it
        return _move(again, output, torch.ones(output.shape, dtype=torch.bool), tol)
    move = Move()
    for other, base, real in reals:
        length = plan.sizes[other.letter]
        move |= _move(_as_bl(again, other, length, plan.batch), base, real,
                      _as_bl(tol, other, length, plan.batch))
    return move


def check(model: nn.Module, plan: Plan, say: Callable[[str], None] = lambda _: None) -> Verdict:
    """Run every check of the module docstring on ``plan`` (conventions settled or probed)."""
    model.eval()
    settle_conventions(model, plan, say)
    verdict = Verdict(masks=plan.masks, notes=list(plan.notes))
    values = plan.values(model)
    inputs = feed(model, plan, values, plan.valid, plan.sizes)
    say("running the model")
    output = _run(model, inputs, "the plain run")
    tol = tolerance(output)

    # Comparing runs means something only if one input gives one output. Each run starts
    # from the same random state; a model that still varies cannot be judged by comparison,
    # and one that draws random numbers (dropout left on) draws others at another length.
    unsteady = _differs(_run(model, inputs, "a second plain run"), output, tol)
    random = not unsteady and _differs(
        _run(model, inputs, "a run from another random state", seed=SEED + 1), output, tol)
    if random:
        verdict.notes.append("the model draws random numbers in eval mode (dropout left on, "
                             "noise in forward): every run starts from the same random state")

    # The observed run: the same inputs, with every attention call's weights kept.
    seen = _observe(model, inputs)
    verdict.seen = seen.calls
    if _differs(seen.output, output, tol):
        verdict.notes.append(
            "observing the model changed its output (a fast path that turns off while it is "
            "observed, such as nn.Transformer's in eval mode): the output checks judge the "
            "plain run; the attention lines come from the observed run")

    nan = output.isnan()
    verdict.checks.append(Check(
        "no NaN", "failed" if bool(nan.any()) else "passed",
        f"{int(nan.sum())} of {nan.numel()} output values are NaN" if bool(nan.any())
        else "every output is a number"))
    infinite = output.isinf()
    if bool(infinite.any()):  # listed only when it fails: a model's outputs are finite
        verdict.checks.append(Check(
            "no infinity", "failed",
            f"{int(infinite.sum())} of {infinite.numel()} output values are ±inf; a change "
            f"there cannot be seen, so no check can vouch for those positions"))
    attention = _attention_checks(plan, seen.calls)
    if not plan.causal and not any(not bool(v.all()) for v in plan.valid.values()) \
            and not any((c.asserted or "").startswith(UNBLOCKED) for c in attention):
        verdict.checks.append(Check("what to check", "not checked", (
            "nothing was asserted: name a causal input with --causal NAME, or padding with "
            "--lengths NAME=N,N")))

    steady = ("the model's output differs between two runs on the same inputs from the same "
              "random state, so changing an input proves nothing")
    for seq in plan.seqs.values():
        if seq.letter in plan.causal:
            name = f"causality of {seq.name}"
            verdict.checks.append(Check(name, "not checked", steady) if unsteady else
                                  _causality(model, plan, seq, values, output, tol, say))
    for seq in plan.seqs.values():
        if seq.letter in plan.valid and not bool(plan.valid[seq.letter].all()):
            if unsteady:
                verdict.checks.append(Check(f"padding of {seq.name}", "not checked", steady))
                continue
            verdict.checks.extend(_padding_checks(model, plan, seq, values, output, tol, say,
                                                  random))

    if _differs(_run(model, inputs, "a last plain run"), output, tol):  # it changed over time
        for c in verdict.checks:
            if c.name.startswith(("causality of", "padding of")):
                c.status, c.detail = "not checked", (
                    "the model's output on the same inputs changed over the check's runs (it "
                    "depends on how often it was called), so comparing runs proves nothing")
    verdict.checks.extend(attention)
    return verdict


def _differs(a: Tensor, b: Tensor, tol: Tensor) -> bool:
    if a.shape != b.shape:
        return True
    return _move(a, b, torch.ones(b.shape, dtype=torch.bool), tol).leaks


def _causality(model, plan: Plan, seq: Seq, values, output, tol, say) -> Check:
    name = f"causality of {seq.name}"
    if _as_bl(output, seq, plan.sizes[seq.letter], plan.batch) is None:
        return Check(name, "not checked", f"the output {list(output.shape)} has no axis of "
                                          f"{seq.name}'s positions ({plan.sizes[seq.letter]})")
    say(f"checking causality of {seq.name} at every position")
    moves = list(_causal_moves(model, plan, seq, values, None, output, tol))
    if not moves:
        return Check(name, "not checked", f"no split point: no real token of {seq.name} has "
                                          f"one after it")
    leaks = [(m, t) for m, t in moves if m.leaks]
    if leaks:
        m, t = leaks[0]
        return Check(name, "failed", (
            f"output at or before position {t} moved by {m.size:.3g} when {seq.name}'s tokens "
            f"after {t} changed; leaks at {len(leaks)} of {len(moves)} split points "
            f"(t = {', '.join(str(t) for _, t in leaks[:8])}{', …' if len(leaks) > 8 else ''})"))
    largest = max(m.size for m, _ in moves)
    return Check(name, "passed", (
        f"at each of {len(moves)} split points t, changing {seq.name}'s tokens after t moved no "
        f"output at or before t beyond rounding (largest move {largest:.3g})"))


def _padding_checks(model, plan: Plan, seq: Seq, values, output, tol, say,
                    random: bool = False) -> list[Check]:
    out: list[Check] = []
    masks = [a.name for a in plan.masks if a.key == seq.letter and a.per_sequence]
    say(f"checking padding of {seq.name}")
    reals = _real_outputs(plan, output)
    if reals and not any(bool(real.any()) for _, _, real in reals):
        return [Check(f"padding of {seq.name}", "not checked",
                      "no output position is real (every sequence is all padding)")]
    if masks or values[seq.name].is_floating_point():
        move = _content_move(model, plan, seq, values, None, output, tol)
        told = f"masked by {', '.join(masks)}" if masks else "no mask argument says where it is"
        out.append(_judged(f"padding of {seq.name}: content", move,
                           f"changed every padded position of {seq.name} ({told}); real "
                           f"outputs moved by at most {move.size:.3g}"))
    grow = GROW
    if random:
        return out + [Check(f"padding of {seq.name}: length", "not checked",
                            "the model draws random numbers, and a longer input draws others")]
    sizes = dict(plan.sizes, **{seq.letter: plan.sizes[seq.letter] + grow})
    valid = dict(plan.valid, **{seq.letter: torch.cat(
        [plan.valid[seq.letter], torch.zeros(plan.batch, grow, dtype=torch.bool)], 1)})
    others = [s for s in plan.seqs.values() if s.letter == seq.letter]
    grown = dict(values, **{s.name: _grow(values[s.name], s, grow, plan.pad_id) for s in others})
    name = f"padding of {seq.name}: length"
    try:
        longer = _run(model, feed(model, plan, grown, valid, sizes), "growing the padding")
    except RunFailed as failed:  # e.g. a position table no longer than the input
        return out + [Check(name, "not checked",
                            f"the model does not take {sizes[seq.letter]} positions of "
                            f"{seq.name}: {failed}")]
    move = Move()
    for other, base, real in _real_outputs(plan, output):
        now = _as_bl(longer, other, sizes[other.letter], plan.batch)
        if now is None:
            return out + [Check(name, "not checked", "the output's positions do not line up "
                                                     "with the longer input")]
        length = plan.sizes[other.letter]
        move |= _move(now[:, :length], base, real, _as_bl(tol, other, length, plan.batch))
    out.append(_judged(name, move, f"{grow} more padded positions of {seq.name}; real outputs "
                                   f"moved by at most {move.size:.3g}"))
    return out


# --- attention calls --------------------------------------------------------------------------


@dataclass
class Seen:
    output: Tensor
    calls: list  # (path, how, weights [..., Q, K], blocked by the model or None)


def _observe(model: nn.Module, inputs: Inputs) -> Seen:
    from tfcli.inspection.ops import OpObserver

    calls: list = []
    stack: list[str] = []
    names = {id(m): path for path, m in model.named_modules()}
    hows = {"softmax": "softmax of Q·Kᵀ", "sdpa": "scaled_dot_product_attention",
            "mha": "nn.MultiheadAttention"}

    def on_op(op) -> None:
        if op.kind in hows and op.weights is not None and op.weights.dim() >= 2:
            calls.append((stack[-1] if stack else "", hows[op.kind], op))

    def enter(module, args) -> None:
        stack.append(names.get(id(module), "?"))

    def leave(module, args, output) -> None:  # returns None: a value would replace the output
        stack.pop()

    handles = [m.register_forward_pre_hook(enter) for m in model.modules()]
    handles += [m.register_forward_hook(leave) for m in model.modules()]
    try:
        output = _run(model, inputs, "observing attention",
                      watch=OpObserver(on_op, keep_values=True))
    finally:
        for h in handles:
            h.remove()
    # Read after the run: the observer replaces a softmax's weights with the ones the model
    # applied to V (masked or renormalised after the softmax).
    return Seen(output, [(path, how, op.weights, op.blocked) for path, how, op in calls])


def observe_plan(model: nn.Module, plan: Plan, say: Callable[[str], None]) -> list:
    """The attention calls of one observed run on the plan's inputs (no checks)."""
    model.eval()
    settle_conventions(model, plan, say)
    values = plan.values(model)
    say("running the model")
    return _observe(model, feed(model, plan, values, plan.valid, plan.sizes)).calls


@dataclass
class Drawn:
    """One attention call as drawn: the mask the model itself applied, head 0."""
    path: str
    how: str
    scores: list[int]
    allowed: Tensor | None  # [B, Q, K]; None when the model blocked nothing
    nan: bool

    def to_dict(self) -> dict:
        return {"path": self.path, "how": self.how, "scores": self.scores, "nan": self.nan,
                "allowed": self.allowed.tolist() if self.allowed is not None else None}


def drawn(calls: list) -> list[Drawn]:
    out = []
    for path, how, weights, blocked in calls:
        allowed = None
        if blocked is not None and bool(blocked.any()):
            full = ~blocked.expand(weights.shape)
            allowed = full.reshape(full.size(0), -1, *full.shape[-2:])[:, 0] if full.dim() > 2 \
                else full[None]
        out.append(Drawn(path, how, list(weights.shape), allowed, bool(weights.isnan().any())))
    return out


def _letter_of(size: int, plan: Plan) -> list[str]:
    return [letter for letter, n in plan.sizes.items() if n == size] + \
        [letter for letter, (n, _, _) in plan.unmasked.items() if n == size]


def _attention_checks(plan: Plan, calls: list) -> list[Check]:
    if not calls:
        return [Check("attention weights", "not checked",
                      "no attention call was seen (a softmax over a product of activations, "
                      "F.scaled_dot_product_attention or nn.MultiheadAttention), so no weights "
                      "could be compared with the asserted pattern")]
    out: list[Check] = []
    counts: dict[str, int] = {}
    for path, how, weights, blocked in calls:
        counts[path] = counts.get(path, 0) + 1
        label = f"attention {path or '(model)'}" + (f" (call {counts[path]})"
                                                    if counts[path] > 1 else "")
        judged = _judge_call(plan, label, how, weights)
        if judged is not None:
            out.append(judged)
    return out


def _judge_call(plan: Plan, label: str, how: str, weights: Tensor) -> Check | None:
    q_len, k_len = weights.shape[-2:]
    ql, kl = _letter_of(q_len, plan), _letter_of(k_len, plan)
    if len(ql) != 1 or len(kl) != 1:
        why = ("its query and key lengths match no sequence input" if not ql or not kl
               else f"its lengths match more than one sequence ({', '.join(ql + kl)})")
        return Check(label, "not checked", f"{how}, scores {list(weights.shape)}: {why}")
    q, k = ql[0], kl[0]
    alike = [n for i, n in enumerate(weights.shape[:-2])
             if n == q_len and not (i == 0 and n == plan.batch)]
    if alike:  # e.g. heads between queries and keys, [B, Q, h, K], with h = Q
        return Check(label, "not checked", f"{how}, scores {list(weights.shape)}: its query "
                                           f"length {q_len} is also the size of another axis, "
                                           f"so the query axis is not known; choose another "
                                           f"length (--dim, --lengths)")
    expected = torch.ones(plan.batch, q_len, k_len, dtype=torch.bool)
    parts = []
    rows = weights.reshape(-1, q_len, k_len).float()
    per = rows.size(0) // plan.batch if rows.size(0) % plan.batch == 0 else None
    if k in plan.valid and per is not None:
        expected &= plan.valid[k][:, None, :]
        parts.append(f"padding of {k}")
    if q == k and k in plan.causal:
        expected &= torch.ones(q_len, k_len, dtype=torch.bool).tril()
        parts.append("causal")
    if q == k and k in plan.windows:
        expected &= maskargs.band(q_len, k_len, *plan.windows[k])
        parts.append(f"window {plan.windows[k][0]}")
    if not parts and (k in plan.unmasked or q in plan.unmasked):
        return _judge_unblocked(plan, label, how, weights, q, k)
    if not parts:  # nothing asserted along its axes: no check to list (nor to pass)
        return None
    real = plan.valid.get(q, torch.ones(plan.batch, q_len, dtype=torch.bool))
    if per is None:  # leading axes not batch-major: judge every row against the causal part
        expected, real, per = expected[:1], torch.ones(1, q_len, dtype=torch.bool), rows.size(0)
    expected = expected.repeat_interleave(per, 0)
    judged = real.repeat_interleave(per, 0) & expected.any(-1)  # real queries with a key left
    on_blocked = rows.masked_fill(expected | ~judged[..., None], 0.0).abs()
    worst = float(on_blocked.nan_to_num(float("inf")).amax()) if on_blocked.numel() else 0.0
    nan = bool(rows[judged].isnan().any())
    pattern = " AND ".join(parts)
    detail = (f"{how}, queries {q} × keys {k}, pattern {pattern}: largest weight a real query "
              f"put on a blocked key = {worst:.3g}" + (", NaN in its weights" if nan else ""))
    empty = ~expected.any(-1)  # rows the pattern leaves no key (e.g. an empty sequence)
    if bool(empty.any()):
        got = rows[empty]
        state = ("NaN" if bool(got.isnan().any()) else "zeros" if not bool(got.any())
                 else "spread over blocked keys")
        detail += (f"; {int(empty.sum()) // per} query row(s) with no allowed key, weights "
                   f"there: {state} (not judged here; NaN reaching the output fails 'no NaN')")
    if worst > WEIGHT_TOLERANCE:
        where = (on_blocked > WEIGHT_TOLERANCE).nonzero()[0].tolist()
        detail += f" (e.g. query {where[1]} on key {where[2]})"
    return Check(label, "failed" if worst > WEIGHT_TOLERANCE or nan else "passed", detail,
                 asserted=pattern)


def _judge_unblocked(plan: Plan, label: str, how: str, weights: Tensor, q: str,
                     k: str) -> Check:
    """A call along a length no mask reaches (an image's patches, audio frames), keys or
    queries: every real query must give every key a weight. A key counts as blocked below
    WEIGHT_TOLERANCE of the even share 1/K: a mask leaves exactly 0 (exp(-inf), exp(-1e9)),
    while unmasked scores of a model built from its configuration differ by a few units."""
    q_len, k_len = weights.shape[-2:]
    where, _ = next((plan.unmasked[x][1:] for x in (k, q) if x in plan.unmasked))
    pattern = f"{UNBLOCKED}: {where}, no mask asked"
    rows = weights.reshape(-1, q_len, k_len).float()
    per = rows.size(0) // plan.batch if rows.size(0) % plan.batch == 0 else None
    judged = torch.ones(rows.size(0), q_len, dtype=torch.bool)
    if q in plan.valid and per is not None:  # padded queries (a decoder's) are not judged
        judged = plan.valid[q].repeat_interleave(per, 0)
    got = rows.masked_fill(~judged[..., None], math.inf)
    floor = WEIGHT_TOLERANCE / k_len
    blocked = got.nan_to_num(0.0) <= floor
    nan = bool(rows[judged].isnan().any())
    smallest = float(got.nan_to_num(0.0).amin()) if bool(judged.any()) else math.nan
    lengths = "; ".join(f"{x}: {plan.unmasked[x][2]}" for x in dict.fromkeys((q, k))
                        if x in plan.unmasked)
    detail = (f"{how}, queries {q} × keys {k} ({lengths}), pattern {pattern}; smallest weight "
              f"a real query put on a key = {smallest:.3g}" + (", NaN in its weights" if nan
                                                               else ""))
    if bool(blocked.any()):
        first = blocked.nonzero()[0].tolist()
        rows_hit = int(blocked.any(-1).sum())
        detail += (f" (e.g. query {first[1]} on key {first[2]}; {rows_hit} of "
                   f"{int(judged.sum())} real query rows, heads counted apart, blocked a key)")
    return Check(label, "failed" if bool(blocked.any()) or nan else "passed", detail,
                 asserted=pattern)


# --- what the check is asked ------------------------------------------------------------------


def make_plan(subject, model: nn.Module, inputs: Inputs, lengths: dict[str, list[int] | Tensor],
              causal_names: list[str], mask_options: dict[str, str], pad_id: int | None,
              high: int, windows: dict[str, int] | None = None,
              unmasked: dict[str, tuple[int, str, str]] | None = None) -> Plan:
    """The plan for ``inputs``: sequences (the inputs with a length axis), mask arguments with
    their axes and known conventions, padding per length letter and the causal letters.
    ``lengths``: input name -> real length per sequence, or [B, L] bool (True = real);
    ``unmasked``: the subject's lengths no mask reaches (Subject.unmasked_lengths)."""
    named = {k: v for k, v in inputs.named(model).items() if isinstance(v, Tensor)}
    known = subject.mask_conventions()
    def one_length(name: str) -> bool:  # [B, L, …]: a sequence, whatever its name
        dims = subject.input_dims(name) or ()
        return "B" in dims and len([d for d in dims if isinstance(d, str) and d != "B"]) == 1

    is_mask = {n for n in named if n in mask_options or n in known
               or ("mask" in n.lower() and n not in lengths
                   and not (n in causal_names and one_length(n)))}
    for name in mask_options:
        if name not in named:
            raise TfcliError(f"--mask {name}: the model's inputs are {', '.join(named) or 'none'}"
                             f"; name one of them")
        if name in lengths:
            raise TfcliError(f"--mask {name}: {name} is a sequence (--lengths names it), not a "
                             f"mask argument")
    batch = next(iter(named.values())).size(0) if named else 1

    seqs: dict[str, Seq] = {}
    for name, x in named.items():
        if name in is_mask or x.dim() < 2:
            continue
        dims = subject.input_dims(name)
        declared = name in lengths or name in causal_names
        if dims is not None and "B" in dims:
            letters = [i for i, d in enumerate(dims) if isinstance(d, str) and d != "B"]
            if not letters:
                continue
            b, l = dims.index("B"), letters[0]
            seqs[name] = Seq(name, dims[l], b, l)
        elif declared:
            seqs[name] = Seq(name, name, 0, 1)  # [B, L, …] when nothing says otherwise
        if name in seqs:
            batch = x.size(seqs[name].batch_axis)
    sizes: dict[str, int] = {}
    for seq in seqs.values():
        n = named[seq.name].size(seq.length_axis)
        if sizes.setdefault(seq.letter, n) != n:
            raise TfcliError(f"inputs of length {seq.letter} differ in size ({sizes[seq.letter]}"
                             f" and {n}); bind it once with --dim {seq.letter}=N")
    same = [letter for letter, n in sizes.items() if n == batch and batch > 1]
    if same:  # the output's batch and position axes are told apart by their sizes
        raise TfcliError(f"the batch and {same[0]} are both {batch}: tfcli tells an output's "
                         f"batch and position axes apart by size; choose sizes that differ "
                         f"(--dim, --lengths)")

    causal: set[str] = set()
    masks: list[MaskArg] = []
    module = type(model).__module__
    for name in [n for n in named if n in is_mask]:
        x = named[name]
        convention = mask_options.get(name)
        if convention is not None and not maskargs.fits(convention, x.dtype):
            fit = ", ".join(maskargs.CANDIDATES[maskargs.dtype_kind(x.dtype)])
            raise TfcliError(f"--mask {name}={convention}: {name} is {str(x.dtype)[6:]}; "
                             f"a mask of that dtype is {fit}")
        try:
            axes = maskargs.axes_of(name, subject.input_dims(name), list(x.shape), sizes, batch)
        except TfcliError as error:
            hint = (f" (--mask makes {name} a mask argument; if it is a sequence, leave it out "
                    f"of --mask)" if name in mask_options else "")
            raise TfcliError(f"{error}{hint}") from None
        arg = MaskArg(name, x.dtype, axes)
        if convention is not None:
            arg.convention, arg.how = convention, "given with --mask"
        elif name in known:
            arg.convention, arg.how = known[name]
        else:
            doc = maskargs.documented(name, x.dtype, module, subject.kind)
            if doc is not None:
                arg.convention, arg.how = doc
        masks.append(arg)
    valid: dict[str, Tensor] = {}
    values = dict(named)
    for name, given in lengths.items():
        if name not in seqs:
            have = ", ".join(n for n in named if n not in is_mask)
            raise TfcliError(f"--lengths {name}: not a sequence input [B, L, …] of this model "
                             f"(its inputs: {have})")
        seq = seqs[name]
        v = given if isinstance(given, Tensor) else _valid(given, sizes[seq.letter], name, batch)
        if v.shape != (batch, sizes[seq.letter]):
            raise TfcliError(f"--lengths {name}: {batch} sequences of at most "
                             f"{sizes[seq.letter]} positions here")
        if seq.letter in valid and not bool((valid[seq.letter] == v).all()):
            raise TfcliError(f"--lengths: inputs of length {seq.letter} are given different "
                             f"lengths; give them once")
        valid[seq.letter] = v
        x = values[name]
        told = any(a.key == seq.letter and a.per_sequence for a in masks)
        if not x.is_floating_point() and pad_id is None and not told:
            raise TfcliError(f"--lengths {name}: say which token id is padding with --pad-id")
        spec = next((sp for sp in getattr(subject, "input_specs", None) or []
                     if sp.name == name and sp.high), None)
        ids = spec.high if spec else max([high, *(m.num_embeddings for m in model.modules()
                                                 if isinstance(m, nn.Embedding))])
        if not x.is_floating_point() and pad_id is not None and not 0 <= pad_id < ids:
            raise TfcliError(f"--pad-id {pad_id}: token ids of {name} are 0..{ids - 1} here "
                             f"({'its --input bound' if spec else 'the largest embedding table'})")
        view = x.movedim((seq.batch_axis, seq.length_axis), (0, 1)).clone()
        view[~v] = 0 if x.is_floating_point() or pad_id is None else pad_id
        values[name] = view.movedim((0, 1), (seq.batch_axis, seq.length_axis))

    for name in [*causal_names, *subject.causal_inputs()]:
        if name in seqs:
            causal.add(seqs[name].letter)
        elif (arg := next((a for a in masks if a.name == name), None)) is not None:
            if arg.query != arg.key:
                raise TfcliError(f"--causal {name}: a causal mask has queries and keys of one "
                                 f"sequence, {name} is {arg.layout()}")
            causal.add(arg.key)
        else:
            have = ", ".join(named)
            raise TfcliError(f"--causal {name}: not an input of this model (its inputs: {have})")
    declared = dict(subject.windows())
    for name, width in (windows or {}).items():
        if name not in seqs:
            raise TfcliError(f"--window {name}: not a sequence input of this model (its "
                             f"sequences: {', '.join(seqs) or 'none'})")
        declared[seqs[name].letter] = (width, seqs[name].letter in causal)
    plan = Plan(Inputs(inputs.args, inputs.kwargs), seqs, masks, valid, causal, sizes, batch,
                pad_id, high, windows=declared,
                unmasked={k: v for k, v in (unmasked or {}).items() if k not in sizes})
    for name, value in values.items():
        if name in seqs:
            plan.base = plan.base.replace(model, name, value)
    every = {**sizes, **{k: n for k, (n, _, _) in plan.unmasked.items()}}
    clashes = sorted({n for n in every.values() if list(every.values()).count(n) > 1})
    if clashes:
        plan.notes.append(f"lengths {', '.join(k for k, v in every.items() if v in clashes)} "
                          f"are equal ({clashes[0]}): attention calls between them cannot be "
                          f"told apart by their lengths")
    return plan


def _valid(lens: list[int], length: int, name: str, batch: int) -> Tensor:
    if len(lens) != batch or max(lens) > length:
        raise TfcliError(f"--lengths {name}: {batch} sequences of at most {length} positions "
                         f"here")
    return torch.arange(length)[None, :] < torch.tensor(lens)[:, None]
