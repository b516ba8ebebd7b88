"""Trace the shape of every tensor through every module call, in execution order.

Forward hooks record each call's input and output shapes; they are removed and the model's
mode restored in ``finally``, also when the forward pass fails, and the failure names the last
module entered and the shapes that went into it. Inside attention the :class:`Attend` call
also yields the score matrix, the mask as broadcast onto the scores and the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from tfcli.model.attention import Attend
from tfcli.errors import TfcliError
from tfcli.inspection.flops import module_flops


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
    details: list[Detail] = field(default_factory=list)


class ForwardFailed(TfcliError):
    """The forward pass raised; carries the partial trace and where it stopped."""

    def __init__(self, events: list[ShapeEvent], last: ShapeEvent | None, error: BaseException):
        where = (f"{last.path or '(model)'} ({last.type}) with inputs "
                 f"{', '.join(str(s) for s in last.inputs)}") if last else "before any module"
        super().__init__(f"forward pass failed in {where}: {type(error).__name__}: {error}")
        self.events, self.last, self.error = events, last, error


def _attention_details(args: tuple, outputs) -> list[Detail]:
    q, k = args[0], args[1]
    mask = args[3] if len(args) > 3 else None
    scores = [*q.shape[:-1], k.size(-2)]  # [B, h, T, S]
    out, weights = outputs
    details = [Detail("scores Q·Kᵀ/√d_k", scores)]
    if mask is not None:
        details.append(Detail("mask", list(mask.shape), "broadcast onto the scores"))
    details.append(Detail("weights softmax", list(weights.shape) if weights is not None
                          else scores, "" if weights is not None else
                          "fused kernel: not materialised"))
    details.append(Detail("weights·V", list(out.shape)))
    return details


def trace(model: nn.Module, inputs: dict, causal_half: bool = False) -> list[ShapeEvent]:
    """Run ``model(**inputs)`` once and return one event per module call."""
    containers = (nn.ModuleList, nn.ModuleDict)
    events: list[ShapeEvent] = []
    stack: list[tuple[ShapeEvent, tuple]] = []  # calls under way, with their arguments
    depth_of: dict[str, int] = {}
    for path, _module in model.named_modules():
        parts = path.split(".") if path else []
        depth_of[path] = len(parts) - sum(
            isinstance(model.get_submodule(".".join(parts[:i])), containers)
            for i in range(1, len(parts)))

    def pre(path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        event = ShapeEvent(len(events), path, type(module).__name__, depth_of[path],
                           stack[-1][0].order if stack else None,
                           shapes_of(args) + shapes_of(kwargs))
        event.flops = module_flops(module, args, causal_half and _is_causal(path))
        events.append(event)
        stack.append((event, args))

    def post(path: str, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        event, call_args = stack.pop()
        event.outputs = shapes_of(output)
        if isinstance(module, Attend):
            event.details = _attention_details(call_args, output)
        if stack:
            stack[-1][0].flops += event.flops

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
            model(**inputs)
        except TfcliError:
            raise  # bad input the model itself explains
        except Exception as error:  # the model's own failure: say where it happened
            raise ForwardFailed(events, stack[-1][0] if stack else None, error) from error
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return events


def _is_causal(path: str) -> bool:
    """Decoder self-attention in tfcli's model is the causal one."""
    return path.startswith("decoder.") and ".self_attn" in path


# --- symbolic dimensions ---------------------------------------------------------------------


def dimension_names(cfg, batch: int, src_len: int, tgt_len: int) -> dict[str, int]:
    """The paper's names for the sizes in play: B, S, T, h, d_k, d_model, d_ff, V."""
    names = {"B": batch}
    if cfg.has_encoder:
        names["S"] = src_len
    if cfg.has_decoder:
        names["T"] = tgt_len
    names.update(h=cfg.n_heads, d_k=cfg.d_k, d_model=cfg.d_model, d_ff=cfg.d_ff)
    if cfg.embed_dim != cfg.d_model:
        names["d_embed"] = cfg.embed_dim
    vocab = {"V_src": cfg.src_vocab_size, "V_tgt": cfg.tgt_vocab_size}
    vocab = {k: v for k, v in vocab.items() if v}
    if len(set(vocab.values())) == 1:  # one shared vocabulary: just V
        vocab = {"V": next(iter(vocab.values()))}
    names.update(vocab)
    return names


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
    return "[" + ", ".join("|".join(by_value[d]) if d in by_value else str(d) for d in shape) + "]"
