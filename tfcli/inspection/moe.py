"""Mixture of experts: which modules hold the experts, how many a token uses, and how tokens are
dispatched to them.

Experts are recognised by what they are made of, in any model: a module with an integer
``num_experts`` whose parameters are stacked, one matrix per expert on the first axis (the
layout Transformers' MoE models share: ``gate_up_proj [E, 2·d_ff, d_model]``,
``down_proj [E, d_model, d_ff]``). Each token is sent to ``k`` of the ``E`` experts, named by
a sibling router with ``top_k`` (or the block's own ``top_k``, or the configuration).
Experts kept as modules of their own (Transformers 4, most hand-written MoE layers) are found
too: an ``nn.ModuleList`` named ``*experts*`` of two or more modules of one class with the
same parameter shapes; k from a sibling router or the block (``top_k``,
``num_experts_per_tok``).

Routing reads values; meta and fake tensors hold none. Where it cannot be read, tfcli assumes
it uniform: the ``B·L·k`` (token, expert) slots are split as evenly as integers allow, each
expert getting ``B·L·k/E``. FLOPs and activation bytes of the experts do not depend on the
assumption (every token still goes to exactly ``k`` experts); only the tokens per expert do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

# Below inspection in the layers: the subjects use them to build and run an MoE model.
from tfcli.subjects.hf_moe import has_values, is_stacked_experts, uniform_counts  # noqa: F401

UNIFORM = "uniform"  # the routing assumed where values cannot be read
RECORDED = "recorded"  # the routing this run's router chose


@dataclass
class Experts:
    """One layer's experts: E stacked experts, k of them active per token."""
    path: str
    type: str
    experts: int  # E
    top_k: int | None  # k; None when neither the model nor its configuration says
    params: int  # all E experts
    router: str | None = None  # the sibling that picks the experts
    shared: list[str] = field(default_factory=list)  # siblings every token goes through
    layout: str = "stacked"  # stacked: [E, ...] parameters; list: a ModuleList of E modules

    @property
    def per_expert(self) -> int:
        return self.params // self.experts

    @property
    def inactive(self) -> int:
        """Parameters of this layer's experts a token does not use: (E − k) experts."""
        return 0 if self.top_k is None else (self.experts - self.top_k) * self.per_expert

    def to_dict(self) -> dict:
        return {**asdict(self), "params_per_expert": self.per_expert,
                "inactive_per_token": self.inactive}


SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
TOP_K_NAMES = ("top_k", "num_experts_per_tok", "topk")


def _top_k(module) -> int | None:
    for name in TOP_K_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def is_expert_list(name: str, module: nn.Module) -> bool:
    """Experts as modules of their own: a ModuleList named ``*experts*`` (not a shared
    expert) of two or more modules of one class with the same parameter shapes."""
    if not isinstance(module, nn.ModuleList) or len(module) < 2 or "expert" not in name.lower() \
            or "shared" in name.lower():
        return False
    shapes = [[tuple(p.shape) for p in m.parameters()] for m in module]
    return bool(shapes[0]) and all(type(m) is type(module[0]) for m in module) \
        and all(s == shapes[0] for s in shapes)


def find_experts(model: nn.Module, default_top_k: int | None = None) -> list[Experts]:
    """Every layer of experts in ``model`` (stacked, or a ModuleList of expert modules), with
    its router and shared experts."""
    modules = dict(model.named_modules())
    out = []
    for path, module in modules.items():
        name = path.rpartition(".")[2]
        stacked = is_stacked_experts(module)
        if not stacked and not is_expert_list(name, module):
            continue
        count = module.num_experts if stacked else len(module)
        parent_path = path.rpartition(".")[0]
        parent = modules.get(parent_path)
        siblings = dict(parent.named_children()) if parent is not None else {}
        router = next((sibling for sibling, m in siblings.items() if m is not module
                       and _top_k(m) is not None
                       and getattr(m, "num_experts", count) == count), None)
        top_k = _top_k(siblings[router]) if router else _top_k(parent)
        if top_k is None:
            top_k = default_top_k
        prefix = f"{parent_path}." if parent_path else ""
        out.append(Experts(
            path, type(module).__name__ if stacked else
            f"ModuleList of {type(module[0]).__name__}", count, top_k,
            sum(p.numel() for p in module.parameters()),
            router=prefix + router if router else None,
            shared=[prefix + s for s in siblings if s in SHARED_NAMES],
            layout="stacked" if stacked else "list"))
    return out


def active_params(total: int, experts: list[Experts]) -> int | None:
    """Parameters one token uses: everything outside the experts (embeddings, attention,
    norms, routers, shared experts, dense layers) and k of each layer's E experts. None when
    a layer's k is unknown."""
    if any(e.top_k is None for e in experts):
        return None
    return total - sum(e.inactive for e in experts)


@dataclass
class Routing:
    """How one experts call's tokens were dispatched."""
    how: str  # UNIFORM or RECORDED
    tokens: int  # B·L
    top_k: int
    per_expert: list[int]

    def text(self) -> str:
        slots = self.tokens * self.top_k
        if self.how == UNIFORM:
            return (f"routing assumed uniform (no values to route on): {slots} token slots "
                    f"(B·L·k) over E={len(self.per_expert)} experts, "
                    f"{_spread(self.per_expert)} each")
        return (f"routing recorded on this run: {slots} token slots (B·L·k) over "
                f"E={len(self.per_expert)} experts: {', '.join(map(str, self.per_expert))}")


def _spread(counts: list[int]) -> str:
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}–{high}"


def routing_of(module: nn.Module, args: tuple, kwargs: dict) -> Routing | None:
    """The routing an experts call receives: its integer argument ``[tokens, k]`` holds each
    token's experts; read where it holds values, assumed uniform where not."""
    from torch.utils._pytree import tree_flatten

    if not is_stacked_experts(module):
        return None
    index = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)
                  and t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool),
                 None)
    if index is None:
        return None
    tokens, k = index.shape
    if not has_values(index):
        return Routing(UNIFORM, tokens, k, uniform_counts(tokens * k, module.num_experts))
    with torch.no_grad():
        flat = index.flatten()
        counts = torch.bincount(flat[(flat >= 0) & (flat < module.num_experts)].cpu(),
                                minlength=module.num_experts)
    return Routing(RECORDED, tokens, k, [int(n) for n in counts])


def dim_names(experts: list[Experts]) -> dict[str, int]:
    """E and k for the shape legend, where every MoE layer has the same."""
    names = {}
    if len({e.experts for e in experts}) == 1:
        names["E"] = experts[0].experts
    if len({e.top_k for e in experts}) == 1 and experts[0].top_k is not None:
        names["k"] = experts[0].top_k
    return names


def flops_summary(experts: list[Experts], events) -> dict | None:
    """The experts' share of a traced forward (``events`` from tfcli.inspection.shapes.trace)
    and the forward FLOPs per token: only the k experts each token meets did any work."""
    if not experts:
        return None
    calls = [e for e in events if e.routing is not None]
    tokens = calls[0].routing["tokens"] if calls else None
    return {"layers": [x.to_dict() for x in experts],
            "experts_forward_flops": sum(e.flops for e in calls),
            "tokens": tokens,
            "forward_flops_per_token": events[0].flops / tokens if tokens else None,
            "routing": [{"path": e.path, **e.routing} for e in calls]}
