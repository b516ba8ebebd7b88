"""FSDP wrap units of any built model: the repeated blocks of its largest ``ModuleList`` (what
torchtitan and Transformers' FSDP plans wrap: ``model.layers``, ``transformer.h``), or every
outermost module of a class the user names (``--wrap CLASS``). The parameters outside every
unit form the root unit. Each parameter is counted once (tied weights belong to the first unit
that holds them), as the single-device table counts them."""

from __future__ import annotations

from dataclasses import dataclass

from tfcli.errors import TfcliError, did_you_mean


@dataclass(frozen=True)
class Group:
    """The parameters of one unit (or the root): elements, trainable elements, and each
    parameter's shape (FSDP2 shards a parameter by its first dimension); of a model split by
    tensor parallelism, one rank's local shards."""
    name: str
    numel: int
    trainable: int
    shapes: tuple[tuple[int, ...], ...]
    trainable_shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Units:
    modules: list  # the unit modules, in the model's order (not the root)
    groups: list[Group]  # one per unit, in the same order
    root: Group  # parameters outside every unit
    how: str  # how the units were chosen, in words

    @property
    def largest(self) -> Group | None:
        """The unit with the most parameters (what a gathered unit holds)."""
        return max(self.groups, key=lambda g: g.numel, default=None)

    @property
    def most_trained(self) -> Group | None:
        """The unit with the most trainable parameters (what a unit's gradients hold): not the
        largest where a frozen weight sits in it."""
        return max(self.groups, key=lambda g: g.trainable, default=None)


def _unique_numel(module, seen: set[int] | None = None) -> int:
    seen = set() if seen is None else seen
    total = 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _largest_module_list(model):
    """(path, ModuleList) holding the most parameters; None when the model has none that
    holds any."""
    from torch import nn

    best, best_numel = None, 0
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            numel = _unique_numel(module)
            if numel > best_numel:
                best, best_numel = (path, module), numel
    return best


def _classes(model) -> list[str]:
    """Class names of the modules that hold parameters of their own or below and run a
    forward of their own (FSDP2 wraps no container), the root's first."""
    from torch import nn

    names: dict[str, None] = {}
    for _, module in model.named_modules():
        if any(True for _ in module.parameters()) and \
                type(module).forward is not nn.Module.forward:
            names.setdefault(type(module).__name__)
    return list(names)


def find_units(model, wrap: str | None = None) -> Units:
    """The wrap units of ``model`` (see the module's docstring)."""
    from torch import nn

    if wrap is not None:
        modules, inside = [], set()
        for path, module in model.named_modules():
            if not path or any(path.startswith(p + ".") for p in inside):
                continue
            if type(module).__name__ == wrap:
                modules.append((path, module))
                inside.add(path)
        if modules and type(modules[0][1]).forward is nn.Module.forward:
            raise TfcliError(f"--wrap {wrap}: a container without a forward of its own, "
                             f"which FSDP2's fully_shard refuses (\"does not support "
                             f"containers that do not implement forward\"); name the class of "
                             f"its modules: {', '.join(_classes(model)[:12])}")
        if modules and not any(True for _, m in modules for _ in m.parameters()):
            classes = _classes(model)
            raise TfcliError(f"--wrap {wrap}: its {len(modules)} module(s) hold no parameters: "
                             f"as units they would shard, place and checkpoint nothing; its "
                             f"classes with parameters and a forward: "
                             f"{', '.join(classes[:12])}{', ...' if len(classes) > 12 else ''}")
        if not modules and type(model).__name__ == wrap:
            # fully_shard(model) alone: the root is the one unit, as FSDP2 makes it
            how = (f"--wrap {wrap}: the model itself; the whole model is one unit (the "
                   f"root)")
        elif not modules:
            classes = _classes(model)
            raise TfcliError(f"--wrap {wrap!r}: the model has no module of that class"
                             f"{did_you_mean(wrap, classes)}; its classes with parameters and "
                             f"a forward: "
                             f"{', '.join(classes[:12])}{', ...' if len(classes) > 12 else ''}")
        else:
            how = (f"--wrap {wrap}: {len(modules)} module(s) ({modules[0][0]}"
                   + (f" ... {modules[-1][0]}" if len(modules) > 1 else "") + ")")
    else:
        found = _largest_module_list(model)
        if found is None:
            modules = []
            how = "no ModuleList holds parameters: the whole model is one unit (the root)"
        else:
            path, mlist = found
            modules = [(f"{path}.{i}" if path else str(i), m) for i, m in enumerate(mlist)
                       if any(True for _ in m.parameters())]
            kinds = sorted({type(m).__name__ for _, m in modules})
            how = (f"the largest ModuleList, {path or 'the model'}: {len(modules)} × "
                   f"{'/'.join(kinds)}")
    seen: set[int] = set()
    groups = [group(path, module.parameters(), seen) for path, module in modules]
    root = group("root", model.parameters(), seen)
    return Units([m for _, m in modules], groups, root, how)


def group(name: str, parameters, seen: set[int]) -> Group:
    """The Group of ``parameters`` not in ``seen`` (their ids), which it adds them to."""
    shapes, trainable_shapes, numel, trainable = [], [], 0, 0
    for p in parameters:
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = getattr(p, "_local_tensor", p)  # a tensor-parallel DTensor: this rank's share
        shapes.append(tuple(local.shape))
        numel += local.numel()
        if p.requires_grad:
            trainable_shapes.append(tuple(local.shape))
            trainable += local.numel()
    return Group(name, numel, trainable, tuple(shapes), tuple(trainable_shapes))


def shard_numel(shapes, n: int) -> int:
    """Elements rank 0 holds when FSDP2 shards each parameter by its first dimension over
    ``n`` ranks: ceil(rows / n) rows each (the last ranks' shards padded to that size)."""
    total = 0
    for shape in shapes:
        if not shape:
            total += 1
            continue
        rows = -(-shape[0] // n)
        rest = 1
        for size in shape[1:]:
            rest *= size
        total += rows * rest
    return total
