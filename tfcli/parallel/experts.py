"""Expert parallelism (``--parallel ep=E``) for any built model with experts
(:func:`tfcli.inspection.moe.find_experts`: stacked ``[E, ...]`` parameters or a ModuleList of
expert modules).

The layout is DeepSpeed-MoE's and Megatron-LM's: the ep ranks are a split of the dp
data-parallel ranks, not more ranks. Each rank holds E/ep of every MoE layer's E experts; an
expert's parameters are replicated over the dp/ep ranks that hold the same experts (the
expert-data-parallel group), so ZeRO/FSDP shards them dp/ep ways, and everything outside the
experts (attention, embeddings, routers, shared experts) dp ways as under plain dp.

Each MoE layer moves its token slots twice: dispatch sends each token's hidden state to the
ranks of its k experts, combine sends the experts' outputs back. Routing is assumed uniform
(meta and fake tensors hold no values to route on, as the replay assumes): each rank then
receives as many (token, expert) slots as it sends, B·L·k, and its E/ep experts process
exactly those, so the replay's expert activations are one rank's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tfcli.errors import TfcliError
from tfcli.parallel.units import Group, Units, shard_numel


@dataclass(frozen=True)
class Holding:
    """Parameters a rank holds before sharding, and how many ranks shard them."""
    what: str
    numel: int
    trainable: int
    shapes: tuple
    trainable_shapes: tuple
    shard_over: int


@dataclass(frozen=True)
class Layer:
    """One MoE layer: its path, E, k, d_model of the tokens it receives, and one expert's
    parameters (shape, trainable) — for stacked experts each ``[E, ...]`` parameter's slice."""
    path: str
    experts: int
    top_k: int | None
    width: int | None
    stacked: bool
    expert_params: tuple  # ((shape, requires_grad), ...) of one expert


def _width(module, stacked: bool, hint: int | None) -> int | None:
    """The width of the token vectors the experts receive (d_model)."""
    from torch import nn

    if not stacked:
        linear = next((m for m in module[0].modules() if isinstance(m, nn.Linear)), None)
        return linear.in_features if linear is not None else hint
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
    # gate_up [E, 2·d_ff, d_model] and down [E, d_model, d_ff] share only d_model
    common = set(own[0].shape[1:]).intersection(*(set(p.shape[1:]) for p in own[1:]))
    if hint in common or (hint is not None and not common):
        return hint
    return common.pop() if len(common) == 1 else None


class ExpertLayout:
    """The experts of one built model, and what a rank holds of it under ``ep``."""

    def __init__(self, model, units: Units, top_k: int | None, d_model: int | None) -> None:
        from tfcli.inspection.moe import find_experts

        modules = dict(model.named_modules())
        self.layers: list[Layer] = []
        expert_ids: set[int] = set()
        for found in find_experts(model, top_k):
            module = modules[found.path]
            stacked = found.layout == "stacked"
            one = module if stacked else module[0]
            params = tuple((tuple(p.shape[1:]) if stacked else tuple(p.shape), p.requires_grad)
                           for p in one.parameters())
            expert_ids.update(id(p) for p in module.parameters())
            self.layers.append(Layer(found.path, found.experts, found.top_k,
                                     _width(module, stacked, d_model), stacked, params))
        self.units = units
        dense = [p for p in _unique(model) if id(p) not in expert_ids]
        self.dense = Holding("outside the experts", sum(p.numel() for p in dense),
                             sum(p.numel() for p in dense if p.requires_grad),
                             tuple(tuple(p.shape) for p in dense),
                             tuple(tuple(p.shape) for p in dense if p.requires_grad), 1)
        # DeepSpeed ZeRO-3 gathers module by module: (own parameters, stacked experts?)
        self.module_sizes = [(sum(p.numel() for p in m.parameters(recurse=False)),
                              any(m is modules[x.path] for x in self.layers if x.stacked))
                             for m in modules.values()]

    @classmethod
    def of(cls, model, units: Units, subject) -> ExpertLayout | None:
        hint = subject.model_dims(model).get("d_model")
        layout = cls(model, units, subject.experts_per_token(), hint)
        return layout if layout.layers else None

    def check(self, ep: int) -> None:
        for layer in self.layers:
            if layer.experts % ep:
                counts = sorted({x.experts for x in self.layers})
                raise TfcliError(f"--parallel ep={ep}: {layer.path} has {layer.experts} experts, "
                                 f"not divisible by {ep}; ep must divide every MoE layer's "
                                 f"expert count ({', '.join(map(str, counts))})")

    # --- what one rank holds ----------------------------------------------------------------

    def _rank_params(self, layer: Layer, ep: int) -> list[tuple[tuple, bool]]:
        """The parameters of the rank's E/ep experts of ``layer``."""
        local = layer.experts // ep
        if layer.stacked:
            return [((local, *shape), grad) for shape, grad in layer.expert_params]
        return [param for _ in range(local) for param in layer.expert_params]

    def holdings(self, n: int, ep: int) -> list[Holding]:
        """Dense parameters sharded over the n data-parallel ranks; the rank's experts over
        the n/ep ranks that hold the same experts."""
        params = [p for layer in self.layers for p in self._rank_params(layer, ep)]
        experts = Holding("the rank's experts", sum(_numel(s) for s, _ in params),
                          sum(_numel(s) for s, g in params if g), tuple(s for s, _ in params),
                          tuple(s for s, g in params if g), n // ep)
        return [Holding(**{**self.dense.__dict__, "shard_over": n}), experts]

    def _in(self, layer: Layer, group: Group) -> bool:
        """Whether ``layer``'s experts belong to wrap unit ``group`` (root: to none)."""
        if group.name != "root":
            return layer.path.startswith(group.name + ".")
        return not any(layer.path.startswith(g.name + ".") for g in self.units.groups)

    def rank_units(self, ep: int) -> Units:
        """The wrap units as one rank holds them (E/ep experts per layer), for the gathered
        unit, the reduce-scatter buffer and the unit's sharded gradients."""
        def less(group: Group) -> Group:
            shapes, trainable_shapes = Counter(group.shapes), Counter(group.trainable_shapes)
            for layer in (x for x in self.layers if self._in(x, group)):
                for full, kept in ((self._rank_params(layer, 1), False),
                                   (self._rank_params(layer, ep), True)):
                    for shape, grad in full:
                        for counter, counts in ((shapes, True), (trainable_shapes, grad)):
                            if counts:
                                counter[shape] += 1 if kept else -1
            assert min([*shapes.values(), *trainable_shapes.values(), 0]) >= 0
            shapes, trainable_shapes = tuple(shapes.elements()), tuple(trainable_shapes.elements())
            return Group(group.name, sum(map(_numel, shapes)),
                         sum(map(_numel, trainable_shapes)), shapes, trainable_shapes)
        return Units(self.units.modules, [less(g) for g in self.units.groups],
                     less(self.units.root), self.units.how)

    def unit_shard(self, group: Group, n: int, ep: int) -> int:
        """Elements of a rank-view unit's trainable parameters rank 0 keeps after the
        reduce-scatter: the dense ones split n ways, its experts' n/ep ways."""
        experts = Counter(s for layer in self.layers if self._in(layer, group)
                          for s, g in self._rank_params(layer, ep) if g)
        dense = Counter(group.trainable_shapes) - experts
        return shard_numel(tuple(dense.elements()), n) + \
            shard_numel(tuple(experts.elements()), n // ep)

    def largest_module(self, ep: int) -> int:
        return max(numel // ep if stacked else numel for numel, stacked in self.module_sizes)

    def all_to_all(self, tokens: int, ep: int, per: int, tag: str):
        """The line for one MoE layer's dispatch and combine buffers at ``tokens`` = B·L."""
        from tfcli.parallel.layout import Line

        if any(layer.top_k is None for layer in self.layers):
            raise TfcliError(f"--parallel ep={ep}: the model does not say how many experts "
                             f"each token is routed to (k: a top_k on the router or the "
                             f"block, or num_experts_per_tok in the configuration), so the "
                             f"all-to-all buffers cannot be sized")
        if any(layer.width is None for layer in self.layers):
            raise TfcliError(f"--parallel ep={ep}: cannot tell the width of the token vectors "
                             f"{self.layers[0].path} receives (its parameters share more than "
                             f"one size); the all-to-all buffers cannot be sized")
        layer = max(self.layers, key=lambda x: x.top_k * x.width)
        slots = tokens * layer.top_k
        return Line("all-to-all buffers", 2 * slots * layer.width * per,
                    f"{tag} one MoE layer at a time: dispatch receives the B·L·k = {tokens:,} × "
                    f"{layer.top_k} token slots its {layer.experts // ep} of {layer.experts} "
                    f"experts process, combine receives their outputs back: 2 × {slots:,} × "
                    f"d_model {layer.width:,} × {per} B (routing assumed uniform: each rank "
                    f"receives as many slots as it sends)", "communication")


def _numel(shape) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _unique(model):
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p
