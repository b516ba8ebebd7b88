"""Where the parameters are: one record per module, tied weights counted once, buffers apart.

Works on any ``nn.Module`` (built on the meta device, so nothing is allocated). Each unique
parameter is owned by the first name ``named_parameters()`` gives it; its other names are
aliases (``output.weight ≡ src_embed.token.weight``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import asdict, dataclass, field

from torch import Tensor, nn

from tfcli.errors import TfcliError
from tfcli.inspection.moe import active_params, find_experts

KINDS = ("embedding", "attention", "ffn", "norm", "output", "other")


@dataclass
class LayerRow:
    path: str  # "" is the model itself
    type: str
    depth: int  # path components, not counting ModuleList containers
    params: int  # unique parameters in this module's subtree, counted at their owner
    own_params: int  # parameters registered directly on this module
    shape: dict[str, list[int]] = field(default_factory=dict)  # direct parameter -> shape
    trainable: bool | None = True  # None: some frozen, some not
    shared_with: list[str] = field(default_factory=list)  # other names of its direct parameters
    tied_to: dict[str, str] = field(default_factory=dict)  # direct parameter -> owner elsewhere
    container: bool = False  # a ModuleList/ModuleDict: grouping only (torch's
    # parametrizations hold their original tensors on one: weight_norm's original0/original1)
    own_trainable: bool | None = True  # of the parameters registered directly on it
    inactive: int = 0  # of params, those a token does not use: experts its router skips


@dataclass
class BufferRow:
    path: str
    shape: list[int]
    numel: int
    dtype: str
    persistent: bool


@dataclass
class ParamReport:
    layers: list[LayerRow]
    total_params: int
    trainable_params: int
    buffers: list[BufferRow]
    aliases: list[list[str]]  # each: owner name first, then its other names
    reused_modules: list[list[str]]  # one module object reachable under several paths
    by_component: dict[str, int]
    by_kind: dict[str, int]
    check_total: int  # sum(p.numel() for p in model.parameters()), for the reconciliation line
    # one module called in several roles, when params ran the model (see shapes.reused_calls)
    reused_calls: list[dict] = field(default_factory=list)
    experts: list[dict] = field(default_factory=list)  # mixture of experts: one per MoE layer
    active_params: int | None = None  # per token; None without experts (or k unknown)

    @property
    def non_trainable_params(self) -> int:
        return self.total_params - self.trainable_params

    @property
    def buffer_numel(self) -> int:
        return sum(b.numel for b in self.buffers)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["non_trainable_params"] = self.non_trainable_params
        return data


def freeze(model: nn.Module, patterns: list[str]) -> None:
    """Mark parameters frozen whose name, or any enclosing module path, matches a glob."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    def hit(name: str, pattern: str) -> bool:
        parts = name.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern)
                   for i in range(1, len(parts) + 1))

    for pattern in patterns:
        matched = [n for n in names if hit(n, pattern)]
        if not matched:
            tops = ", ".join(n for n, _ in model.named_children())
            raise TfcliError(f"--freeze {pattern!r} matches no parameter; paths look like "
                             f"'encoder.layers.0.self_attn' (top-level modules: {tops})")
        for name in matched:
            model.get_parameter(name).requires_grad_(False)


OUTPUT_NAMES = {"output", "lm_head", "generator", "fc_out", "head", "classifier", "proj_out"}


def _kind_of(module: nn.Module, name: str) -> str | None:
    """What a module is, from its type and its name, for any model (tfcli's, a tutorial's,
    Transformers'): those name their classes and attributes after the paper's parts."""
    cls = type(module).__name__.lower()
    name = name.lower()
    if isinstance(module, nn.MultiheadAttention) or "attention" in cls or "attn" in cls \
            or name in ("attn", "attention", "self_attn", "cross_attn", "src_attn"):
        return "attention"
    if any(w in cls for w in ("feedforward", "mlp", "ffn")) or name in (
            "ffn", "mlp", "feed_forward", "feedforward"):
        return "ffn"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "norm" in cls:
        return "norm"
    if isinstance(module, nn.Embedding) or "embedding" in cls:
        return "embedding"
    return None


def _outermost(groups: list[list[str]]) -> list[list[str]]:
    """A reused module's children are reused with it: report the module, not each child."""
    def inside(paths: list[str], other: list[str]) -> bool:
        return paths is not other and all(any(p.startswith(o + ".") for o in other)
                                           for p in paths)
    return [g for g in groups if not any(inside(g, other) for other in groups)]


def param_report(model: nn.Module, top_k: int | None = None) -> ParamReport:
    """``top_k``: experts per token, where a mixture of experts' modules do not say."""
    owner: dict[int, str] = {}  # id(parameter) -> owning name
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner.setdefault(id(p), name)
        names.setdefault(id(p), []).append(name)
    unique = {id(p): p for p in model.parameters()}

    module_paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        module_paths.setdefault(id(module), []).append(path)

    # Each parameter counts in its owning module and in every module above it: walking up
    # from the owners costs parameters × depth, where asking every module which names start
    # with its path would cost modules × parameters (minutes at 20,000 modules).
    modules = dict(model.named_modules())
    owned_by: dict[str, list[Tensor]] = {}
    for pid, p in unique.items():
        parts = owner[pid].split(".")[:-1]
        for i in range(len(parts) + 1):
            owned_by.setdefault(".".join(parts[:i]), []).append(p)

    rows: list[LayerRow] = []
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    by_component: dict[str, int] = {}
    by_kind: dict[str, int] = dict.fromkeys(KINDS, 0)
    # Per module, from its parent's (named_modules lists parents first): the containers above
    # it, and the kind of its parameters: that of the innermost module, itself or above, that
    # says what it is (_kind_of); else "output" under an output head's name, else "other".
    containers_above: dict[str, int] = {}
    kind_above: dict[str, str | None] = {}
    for path, module in modules.items():
        prefix = f"{path}." if path else ""
        owned = owned_by.get(path, [])
        direct = [(n, p) for n, p in module._parameters.items() if p is not None]
        own = [(n, p) for n, p in direct if owner[id(p)] == prefix + n]
        flags = {p.requires_grad for p in owned}
        own_flags = {p.requires_grad for _, p in own}
        parts = path.split(".") if path else []
        parent = path.rpartition(".")[0]
        if path:
            containers_above[path] = containers_above[parent] + (
                parent != "" and isinstance(modules[parent], containers))
        else:
            containers_above[path] = 0
        kind_above[path] = _kind_of(module, parts[-1] if parts else "") or (
            kind_above[parent] if path else None)
        n_containers = containers_above[path]
        rows.append(LayerRow(
            path=path, type=type(module).__name__, depth=len(parts) - n_containers,
            params=sum(p.numel() for p in owned), own_params=sum(p.numel() for _, p in own),
            shape={n: list(p.shape) for n, p in direct},
            trainable=flags.pop() if len(flags) == 1 else (True if not flags else None),
            shared_with=sorted({a for n, p in direct for a in names[id(p)] if a != prefix + n}),
            tied_to={n: owner[id(p)] for n, p in direct if owner[id(p)] != prefix + n},
            container=isinstance(module, containers),
            own_trainable=own_flags.pop() if len(own_flags) == 1 else (True if not own_flags
                                                                        else None)))
        kind = kind_above[path] or ("output" if parts and parts[0] in OUTPUT_NAMES
                                    else "other")
        for _, p in own:
            by_kind[kind] += p.numel()
            top = parts[0] if parts else "(model)"
            by_component[top] = by_component.get(top, 0) + p.numel()

    buffers = []
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        buffers.append(BufferRow(name, list(b.shape), b.numel(), str(b.dtype).replace("torch.", ""),
                                 name in persistent))
    total = sum(p.numel() for p in unique.values())
    experts = find_experts(model, top_k)
    by_path = {row.path: row for row in rows}
    for layer in experts:  # the experts' unused share counts against them and every parent
        parts = layer.path.split(".")
        for i in range(len(parts) + 1):
            by_path[".".join(parts[:i])].inactive += layer.inactive
    return ParamReport(
        layers=rows, total_params=total,
        trainable_params=sum(p.numel() for p in unique.values() if p.requires_grad),
        buffers=buffers,
        aliases=[names[pid] for pid in unique if len(names[pid]) > 1],
        reused_modules=_outermost([paths for paths in module_paths.values() if len(paths) > 1]),
        by_component=by_component, by_kind={k: v for k, v in by_kind.items() if v},
        check_total=sum(p.numel() for p in model.parameters()),
        experts=[layer.to_dict() for layer in experts],
        active_params=active_params(total, experts) if experts else None,
    )

