"""Transformers' mixture-of-experts layers, run where routing has no values.

Transformers 5 stores a layer's experts stacked (``gate_up_proj [E, 2·d_ff, d_model]``) and
picks how they run by name, ``config._experts_implementation``, at every call: ``grouped_mm``
(its default: one grouped product whose meta kernel takes bfloat16 only, and which torch's
FlopCounterMode counts as 0), ``batched_mm`` (gathers a weight copy per token: memory no real
run spends), or ``eager`` (a loop over the experts that the routing picked: it reads values).
None of them runs as it is on meta and fake tensors (grouped_mm's products do, through
the fallback kernel Transformers registers beside it).

tfcli registers one implementation per real one, ``tfcli|NAME``; on real tensors it runs NAME
itself. On tensors without values:

- for ``grouped_mm``, the memory replays run Transformers' own grouped_mm forward, its products
  through the fallback kernel Transformers ships beside it (``transformers::grouped_mm_fallback``,
  whose fake kernel runs on meta and fake tensors of any dtype): the same tensors as torch's
  grouped product, one output per product forward, one input gradient and one gradient of the
  stacked weights backward. Its memory does not depend on the routing: a real CPU step of
  Mixtral, Qwen2-MoE or DeepSeek-V3 under the profiler peaks within 64 B of the replay
  (tests/test_moe.py; Qwen3-MoE, OLMoE, GPT-OSS, GraniteMoE and PhiMoE too, measured), where
  the eager loop below, run for memory, was 20-36 % over it at 2 x 32 to 2 x 96 (a gradient
  of every stacked weight, full size, per expert in backward; Mixtral at 4 x 128 0.4 %
  under), and a forward without grad 28 % under it;
- otherwise, and wherever FLOPs and shapes are traced (:func:`counting_products`), the experts
  replay under uniform routing (:mod:`tfcli.inspection.moe`) as eager runs them — per expert,
  its share of the token slots through its own slice of the weights with ``F.linear``, gated,
  and back — so shapes, FLOPs (every token still meets k experts) and the activations saved
  for backward are those of a real run (the eager loop's backward working set depends on the
  routing, which a replay cannot know).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def is_stacked_experts(module: nn.Module) -> bool:
    """A layer of experts as Transformers 5 stores them (and tfcli finds them in any model):
    an integer ``num_experts`` and every parameter of its own stacked, one slice per expert
    on the first axis."""
    n = getattr(module, "num_experts", None)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return False
    own = list(module.parameters(recurse=False))  # a router's [E, d_model] is not stacked
    return any(p.dim() >= 3 for p in own) and all(p.shape[0] == n for p in own)


def uniform_counts(slots: int, experts: int) -> list[int]:
    """``slots`` (token, expert) pairs over ``experts`` experts, as evenly as integers allow."""
    return [slots // experts + (e < slots % experts) for e in range(experts)]


def has_values(t: Tensor) -> bool:
    """Whether ``t`` holds numbers that can be read (not meta, not a fake tensor)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type != "meta" and not is_fake(t)


PREFIX = "tfcli|"
REPLAY = "eager loop under uniform routing (tfcli's replay: meta and fake tensors hold no values)"
GROUPED_REPLAY = ("Transformers' grouped_mm forward, its products through Transformers' "
                  "grouped_mm_fallback kernel (one grouped product over the B·L·k token slots: "
                  "its memory does not depend on the routing); FLOPs and shapes traced by the "
                  + REPLAY.split(" (")[0])
_COUNTING = contextvars.ContextVar("tfcli_counting_products", default=False)


@contextlib.contextmanager
def counting_products():
    """Inside: experts without values replay as the eager loop, whose per-expert ``F.linear``
    calls the FLOP tracer and torch's FlopCounterMode both see (a grouped product is opaque
    to FlopCounterMode, which counts it as 0)."""
    token = _COUNTING.set(True)
    try:
        yield
    finally:
        _COUNTING.reset(token)


def grouped_replay_available() -> bool:
    """Whether Transformers has the grouped_mm forward and its fallback kernel to replay it
    with (Transformers 5; the fallback appeared beside grouped_mm)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    return (callable(getattr(moe, "_can_use_grouped_mm", None))
            and hasattr(torch.ops, "transformers")
            and hasattr(torch.ops.transformers, "grouped_mm_fallback"))


def _fallback_without_values() -> None:
    """Route Transformers' grouped products on tensors without values to its fallback kernel
    (torch's grouped_mm has a meta kernel for bfloat16 only, and asks a CUDA device it cannot
    see for its capability); on real tensors Transformers chooses as before."""
    from transformers.integrations import moe

    chooses = moe._can_use_grouped_mm
    if getattr(chooses, "tfcli_wrapped", False):
        return

    def can_use_grouped_mm(input: Tensor, weight: Tensor, offs: Tensor) -> bool:
        if not has_values(weight):
            return False
        return chooses(input, weight, offs)

    can_use_grouped_mm.tfcli_wrapped = True
    moe._can_use_grouped_mm = can_use_grouped_mm


def replays_grouped(real: str | None) -> bool:
    """Whether the memory replays of ``real``'s experts run the grouped product."""
    return real_name(real) == "grouped_mm" and grouped_replay_available()


def _expert_linear(x: Tensor, stacked: Tensor, bias: Tensor | None, e: int,
                   transposed: bool) -> Tensor:
    weight = stacked[e].transpose(0, 1) if transposed else stacked[e]  # [out, in]
    return F.linear(x, weight, None if bias is None else bias[e])


def uniform_replay(experts: nn.Module, hidden: Tensor, top_k_index: Tensor,
                   top_k_weights: Tensor) -> Tensor:
    """The experts' forward with the ``tokens·k`` slots split evenly over the experts, in the
    order the slots come (token-major). hidden [tokens, d_model] → [tokens, d_model]."""
    tokens, k = top_k_index.shape
    slots = hidden.repeat_interleave(k, dim=0)  # [tokens·k, d_model]
    has_bias, transposed = getattr(experts, "has_bias", False), experts.is_transposed
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    up = getattr(experts, up_name)
    up_bias = getattr(experts, f"{up_name}_bias") if has_bias else None
    down_bias = experts.down_proj_bias if has_bias else None
    outputs, start = [], 0
    for e, n in enumerate(uniform_counts(tokens * k, experts.num_experts)):
        x = slots[start:start + n]  # [n, d_model]
        start += n
        h = _expert_linear(x, up, up_bias, e, transposed)  # [n, 2·d_ff] or [n, d_ff]
        h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)  # [n, d_ff]
        h = _expert_linear(h, experts.down_proj, down_bias, e, transposed)  # [n, d_model]
        if getattr(experts, "has_post_expert_norm", False):
            h = experts.post_expert_norm(h)
        outputs.append(h)
    weighted = torch.cat(outputs) * top_k_weights.reshape(-1, 1).to(hidden.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _with_replay(real: str):
    grouped = replays_grouped(real)
    if grouped:
        _fallback_without_values()

    def forward(experts: nn.Module, hidden: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        if not has_values(hidden):
            if grouped and not _COUNTING.get():
                from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

                return ALL_EXPERTS_FUNCTIONS["grouped_mm"](experts, hidden, top_k_index,
                                                           top_k_weights)
            return uniform_replay(experts, hidden, top_k_index, top_k_weights)
        if real == "eager":  # the class's own loop, which the decorator wrapped
            return type(experts).forward.__wrapped__(experts, hidden, top_k_index,
                                                     top_k_weights)
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        return ALL_EXPERTS_FUNCTIONS[real](experts, hidden, top_k_index, top_k_weights)
    return forward


def install(real: str) -> str | None:
    """Register ``tfcli|real`` with Transformers' experts interface and return its name; None
    for a name Transformers does not know (it says so itself when the model is built)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    except ImportError:  # Transformers 4: experts are modules of their own, no such switch
        return None
    if real != "eager" and real not in ALL_EXPERTS_FUNCTIONS:
        return None
    name = PREFIX + real
    if name not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(name, _with_replay(real))
    return name


def real_name(name: str | None) -> str | None:
    return name[len(PREFIX):] if isinstance(name, str) and name.startswith(PREFIX) else name
