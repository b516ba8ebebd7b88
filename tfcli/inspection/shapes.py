"""Trace the shape of every tensor through every module call, in execution order.

Forward hooks record each call's input and output shapes; an :class:`OpObserver` sees the
operations inside each call (in any code: tfcli's, a tutorial's, Hugging Face's), which gives
the attention scores ``[B, h, T, S]``, the mask as it reaches them, the weights, and the FLOPs
of every matrix product. Hooks are removed and the model's mode restored in ``finally``, also
when the forward pass fails, and the failure names the last module entered and the shapes that
went into it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from tfcli.errors import TfcliError
from tfcli.inspection.moe import routing_of
from tfcli.inspection.ops import Op, OpObserver
from tfcli.subjects.contain import release


def shapes_of(value) -> list[list[int] | None]:
    """Shapes of the tensors in ``value`` (None for a None argument, e.g. no mask)."""
    leaves, _ = tree_flatten(value)
    return [list(t.shape) if isinstance(t, Tensor) else None for t in leaves
            if isinstance(t, Tensor) or t is None]


@dataclass
class Detail:
    """A tensor inside a module call that is not a module's input or output."""
    label: str
    shape: list[int] | None
    note: str = ""
    after: int | None = None  # order of the last module call begun before it (for the tree)


@dataclass
class ShapeEvent:
    order: int
    path: str
    type: str
    depth: int  # module path components, not counting ModuleList containers
    parent: int | None  # order of the enclosing call
    inputs: list[list[int] | None]
    outputs: list[list[int] | None] = field(default_factory=list)
    flops: int = 0  # forward, this call and everything inside it
    attention_flops: int = 0  # of which the attention core (Q·Kᵀ, weights·V)
    backward_torch: int = 0  # backward as autograd runs it (no gradient for inputs that need none)
    details: list[Detail] = field(default_factory=list)
    routing: dict | None = None  # an experts call: tokens per expert, recorded or assumed
    # forward FLOPs by what made them ("linear", "attention", "conv", an aten op counted by
    # torch's formula), this call and everything inside it
    flops_by_op: dict[str, int] = field(default_factory=dict)
    uncounted: list[str] = field(default_factory=list)  # aten products no formula covers
    # backward FLOPs FlopCounterMode counts beyond the work done: a grouped convolution's
    # weight gradient, counted as if it were not grouped
    counter_excess: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Reuse:
    """One module object called more than once in a forward pass. Each call's role is who
    called it (the enclosing module) and with what input shapes: several roles (decoder
    self- and cross-attention, two layers) share weights that were likely meant to be
    separate; one role repeated (a block applied N times, ALBERT-style) is deliberate."""
    path: str
    type: str
    calls: int
    roles: list[str]

    @property
    def kind(self) -> str:
        return "roles" if len(self.roles) > 1 else "repeated"

    def to_dict(self) -> dict:
        return {"path": self.path, "type": self.type, "calls": self.calls, "kind": self.kind,
                "roles": self.roles}


def reused_calls(events: list[ShapeEvent], model: nn.Module) -> list[Reuse]:
    """Modules holding parameters that were called more than once, outermost only (a reused
    block's children are called again because it is). A module without parameters (dropout,
    a positional table) shares nothing to train, wherever it is called."""
    weighted = {path for path, m in model.named_modules()
                if next(m.parameters(), None) is not None}
    by_path: dict[str, list[ShapeEvent]] = {}
    for event in events:
        by_path.setdefault(event.path, []).append(event)
    out: list[Reuse] = []
    for path, calls in by_path.items():
        if len(calls) < 2 or path not in weighted or any(path.startswith(r.path + ".")
                                                         for r in out):
            continue
        roles = []
        for e in calls:
            caller = events[e.parent].path if e.parent is not None else None
            role = (f"called by {caller or '(model)'} with inputs "
                    f"{', '.join(str(x) for x in e.inputs)}")
            if role not in roles:
                roles.append(role)
        out.append(Reuse(path, calls[0].type, len(calls), roles))
    return out


class ForwardFailed(TfcliError):
    """The forward pass raised; carries the partial trace and where it stopped."""

    def __init__(self, events: list[ShapeEvent], last: ShapeEvent | None, error: BaseException):
        where = (f"{last.path or '(model)'} ({last.type}) with inputs "
                 f"{', '.join(str(s) for s in last.inputs)}") if last else "before any module"
        super().__init__(f"forward pass failed in {where}: {type(error).__name__}: {error}")
        self.events, self.last, self.error = events, last, error


def _details(ops: list[Op]) -> list[Detail]:
    """What happened inside one call, as the reader of the paper names it."""
    out: list[Detail] = []
    for op in ops:
        start = len(out)
        if op.kind == "scores":
            out.append(Detail("scores Q·Kᵀ/√d_k", op.shape))
        elif op.kind == "mask":
            out.append(Detail("mask", op.shape, f"{op.note}, broadcast onto them"))
        elif op.kind == "softmax":
            out.append(Detail("weights softmax", op.shape))
        elif op.kind == "weights·V":
            out.append(Detail("weights·V", op.shape))
        elif op.kind == "sdpa":
            x = op.extra
            if x["k"][-3:-2] != x["q"][-3:-2]:
                out.append(Detail("K, V heads", x["k"], "fewer key/value heads, each shared "
                                                         "by a group of query heads"))
            out.append(Detail("scores Q·Kᵀ/√d_k", op.shape))
            if x["mask"] is not None:
                out.append(Detail("mask", x["mask"], "broadcast onto the scores"))
            elif x["is_causal"]:
                out.append(Detail("mask", None, "is_causal=True: the kernel applies it"))
            out.append(Detail("weights softmax", op.shape, "fused kernel: not materialised"))
            out.append(Detail("weights·V", x["out"]))
        for detail in out[start:]:
            detail.after = op.extra.get("after")
    return out


def _mha(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> tuple[int, int, int, list]:
    """nn.MultiheadAttention runs inside one torch function (no ops to observe): its FLOPs
    and score shape from its own sizes. Returns (flops, attention flops, backward as autograd
    runs it, details)."""
    query = args[0] if args else kwargs["query"]
    key = args[1] if len(args) > 1 else kwargs.get("key", query)
    value = args[2] if len(args) > 2 else kwargs.get("value", key)
    seq_dim = 1 if module.batch_first or query.dim() == 2 else 0
    batch = query.size(1 - seq_dim) if query.dim() == 3 else 1
    t, s, e, h = query.size(seq_dim), key.size(seq_dim), module.embed_dim, module.num_heads
    q_proj, out_proj = 2 * batch * t * e * e, 2 * batch * t * e * e
    k_proj, v_proj = 2 * batch * s * module.kdim * e, 2 * batch * s * module.vdim * e
    core = 4 * batch * t * s * e
    # weight gradients of all four projections; the core and out_proj's input always need
    # theirs; an input's own gradient only when it requires one
    backward = (q_proj + k_proj + v_proj + 2 * out_proj + 2 * core
                + q_proj * query.requires_grad + k_proj * key.requires_grad
                + v_proj * value.requires_grad)
    scores = [batch, h, t, s]
    return q_proj + k_proj + v_proj + out_proj + core, core, backward, [
        Detail("scores Q·Kᵀ/√d_k", scores), Detail("weights softmax", scores),
        Detail("weights·V", [batch, h, t, e // h])]


def trace(model: nn.Module, inputs, causal_half: bool = False,
          is_causal_scope: Callable[[str], bool] | None = None) -> list[ShapeEvent]:
    """Run the model once on ``inputs`` (a dict of keyword arguments, or an ``Inputs``) and
    return one event per module call. ``causal_half`` halves the attention FLOPs of calls
    with ``is_causal=True`` and of attention inside modules ``is_causal_scope`` names."""
    from tfcli.subjects.base import Inputs, check_rows, positions_known
    from tfcli.subjects.hf_moe import counting_products

    call = inputs if isinstance(inputs, Inputs) else Inputs((), dict(inputs))
    containers = (nn.ModuleList, nn.ModuleDict)
    events: list[ShapeEvent] = []
    ops: dict[int, list[Op]] = {}  # event order -> the operations directly inside it
    stack: list[ShapeEvent] = []  # calls under way
    depth_of: dict[str, int] = {}
    for path, _module in model.named_modules():
        parts = path.split(".") if path else []
        depth_of[path] = len(parts) - sum(
            isinstance(model.get_submodule(".".join(parts[:i])), containers)
            for i in range(1, len(parts)))

    def pre(path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        event = ShapeEvent(len(events), path, type(module).__name__, depth_of.get(path, 0),
                           stack[-1].order if stack else None,
                           shapes_of(args) + shapes_of(kwargs))
        if isinstance(module, nn.Embedding):  # an index past its rows: torch's error
            check_rows(module, args[0] if args else kwargs.get("input"))
        if isinstance(module, nn.MultiheadAttention):
            event.flops, event.attention_flops, event.backward_torch, event.details = _mha(
                module, args, kwargs)
            event.flops_by_op = {"linear": event.flops - event.attention_flops,
                                 "attention": event.attention_flops}
        routing = routing_of(module, args, kwargs)
        if routing is not None:
            event.routing = asdict(routing)
            event.details.append(Detail("tokens per expert", [len(routing.per_expert)],
                                        routing.text(), after=event.order))
        events.append(event)
        stack.append(event)

    def post(path: str, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        stack.pop().outputs = shapes_of(output)

    def on_op(op: Op) -> None:
        if stack:
            op.extra["after"] = len(events) - 1
            ops.setdefault(stack[-1].order, []).append(op)

    handles = []
    was_training = model.training
    try:
        for path, module in model.named_modules():
            if isinstance(module, containers):
                continue
            handles.append(module.register_forward_pre_hook(
                lambda m, a, kw, path=path: pre(path, m, a, kw), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, a, kw, out, path=path: post(path, m, a, kw, out), with_kwargs=True))
        try:
            # experts without values as the eager loop, whose products the counters see
            with OpObserver(on_op, every_formula=True), positions_known(), \
                    counting_products():
                output = [call(model)]
            release(output, "as its forward pass's output was freed")
        except TfcliError:
            raise  # bad input the model itself explains
        except Exception as error:  # the model's own failure: say where it happened
            _settle(events, ops, causal_half, is_causal_scope)
            raise ForwardFailed(events, stack[-1] if stack else None, error) from error
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    _settle(events, ops, causal_half, is_causal_scope)
    return events


def _settle(events: list[ShapeEvent], ops: dict[int, list[Op]], causal_half: bool,
            is_causal_scope: Callable[[str], bool] | None) -> None:
    """Details and FLOPs from the observed operations, summed up the call tree."""
    for event in events:
        mine = ops.get(event.order, [])
        causal_scope = causal_half and is_causal_scope is not None and is_causal_scope(event.path)
        for op in mine:
            flops = op.flops
            if op.attention and causal_half and (causal_scope or op.extra.get("is_causal")):
                flops //= 2
            event.flops += flops
            event.attention_flops += flops if op.attention else 0
            event.backward_torch += op.backward
            if flops:
                label = "attention" if op.attention else op.kind
                event.flops_by_op[label] = event.flops_by_op.get(label, 0) + flops
            event.counter_excess += op.extra.get("counter_excess", 0)
            if op.kind == "uncounted" and op.note not in event.uncounted:
                event.uncounted.append(op.note)
        event.details += _details(mine)
    for event in reversed(events):  # children come after their parent
        if event.parent is not None:
            parent = events[event.parent]
            parent.flops += event.flops
            parent.attention_flops += event.attention_flops
            parent.backward_torch += event.backward_torch
            parent.counter_excess += event.counter_excess
            for label, flops in event.flops_by_op.items():
                parent.flops_by_op[label] = parent.flops_by_op.get(label, 0) + flops
            parent.uncounted += [u for u in event.uncounted if u not in parent.uncounted]


# --- symbolic dimensions ---------------------------------------------------------------------


def infer_dims(model: nn.Module, events: list[ShapeEvent]) -> dict[str, int]:
    """Names for a model tfcli did not build, only where what it is made of and what it did
    support them: V from its token embedding; h, h_kv and d_k from its attention calls;
    d_model from the embedding, or h·d_k when the embedding is projected to that width (the
    embedding's own width is then d_embed); d_ff from the widest linear layer fed by d_model
    that another maps back; a d_model -> 3·d_model layer nothing maps back is a fused
    Q, K, V projection, named 3·d_model."""
    names: dict[str, int] = {}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    # Token tables are looked up with batched ids [B, L]; a position table with [L].
    batched = {e.path for e in events if e.type == "Embedding" and e.inputs and e.inputs[0]
               and len(e.inputs[0]) >= 2}
    tokens = [m for path, m in model.named_modules() if path in batched
              and isinstance(m, nn.Embedding)]
    embeddings = tokens or embeddings
    for event in events:
        for d in event.details:
            if d.label.startswith("scores") and d.shape and len(d.shape) == 4:
                names.setdefault("h", d.shape[1])
            if d.label == "K, V heads" and d.shape and len(d.shape) == 4:
                names.setdefault("h_kv", d.shape[1])
                names.setdefault("d_k", d.shape[3])
            if d.label == "weights·V" and d.shape and len(d.shape) == 4:
                names.setdefault("d_k", d.shape[3])
    width = None
    if embeddings:
        width = max(embeddings, key=lambda m: m.num_embeddings).embedding_dim
    elif linears:
        width = linears[0].in_features
    attention_width = names["h"] * names["d_k"] if "h" in names and "d_k" in names else None
    if width is not None and attention_width not in (None, width) and any(
            m.in_features == width and m.out_features == attention_width for m in linears):
        names["d_embed"], width = width, attention_width  # an embedding projected up or down
    if width is not None:
        names["d_model"] = width
        vocab = max((m.num_embeddings for m in embeddings), default=None)
        back = {m.in_features for m in linears if m.out_features == width}
        wide = [m.out_features for m in linears if m.in_features == width
                and m.out_features > width and m.out_features != vocab]
        if 3 * width in wide and 3 * width not in back:
            names["3·d_model"] = 3 * width  # q, k and v in one product
        wide = [w for w in wide if w in back]
        if wide:
            names["d_ff"] = max(set(wide), key=wide.count)
    if embeddings:
        names["V"] = max(m.num_embeddings for m in embeddings)
    return names


def attention_length(events: list[ShapeEvent], names: dict[str, int]) -> int | None:
    """The length a model's self-attention runs over where no input gives it (an image's
    patches and the tokens the model adds to them): the first square score matrix
    [B, h, L, L] whose L no name has."""
    for event in events:
        for d in event.details:
            if d.label.startswith("scores") and d.shape and len(d.shape) == 4 \
                    and d.shape[2] == d.shape[3] and d.shape[3] not in names.values():
                return d.shape[3]
    return None


def ambiguous(names: dict[str, int]) -> dict[int, list[str]]:
    """Sizes that two names share: their symbolic form cannot tell them apart."""
    by_value: dict[int, list[str]] = {}
    for name, value in names.items():
        by_value.setdefault(value, []).append(name)
    return {v: n for v, n in by_value.items() if len(n) > 1}


def symbolic(shape: list[int] | None, names: dict[str, int]) -> str:
    if shape is None:
        return "none"
    by_value: dict[int, list[str]] = {}
    for name, value in names.items():
        by_value.setdefault(value, []).append(name)

    def name(axis: int, size: int) -> str:
        # Size 1 off the first axis is a broadcast (a mask's head axis), not the batch.
        letters = [n for n in by_value.get(size, []) if not (size == 1 and n == "B" and axis)]
        return "|".join(letters) if letters else str(size)

    return "[" + ", ".join(name(i, d) for i, d in enumerate(shape)) + "]"
