"""Tensor parallelism for any subject (a user's module, a Transformers model): one rank's share
as torch runs it, not from formulas on a configuration.

- The plan: Transformers' own where the model has one (the built model's ``tp_plan``: the
  config's ``base_model_tp_plan`` under the base model's prefix, the class's own — ``lm_head``
  — and the vocabulary-parallel input embeddings Transformers adds), or ``--tp-plan
  GLOB=STYLE,...``, which wins when given. Globs are fnmatch patterns on module paths
  (``*`` crosses dots); a module takes the first rule that matches it.
- Each style becomes torch's ParallelStyle (:data:`STYLES`), applied with
  ``parallelize_module`` on torch.distributed's fake process group of t ranks in this process
  (this one rank 0), the model built on fake tensors: its parameters become DTensors whose
  local shards are what one rank holds.
- The lines then follow :class:`tfcli.parallel.traced.TracedModel` on those shards: weights and
  optimizer state from the shards' shapes, gradients from the ones torch's backward makes (a
  vocabulary-parallel ``nn.Embedding`` gets a whole, replicated gradient in torch's DTensor:
  it has no vocabulary-sharded rule for the embedding's backward), activations from a
  fake-tensor replay of the parallelized model, each DTensor counted by its local shard.

- Beside pipeline parallelism (``pp``), the split model is placed on stages as
  :mod:`tfcli.parallel.pipeline` places a whole one, and each stage's lines count its local
  shards; a gradient torch makes whole is counted on the stage whose modules make it (each
  stage's own copy of a tied weight measured untied: the embedding's copy gets its whole
  gradient alone).

- With sequence parallelism (``sp=1``, asked for in so many words: the plans Transformers
  ships leave the norms and the residual stream whole on every rank), the residual stream is
  split along the sequence as torchtitan splits its Llama: the input embedding's output and
  each row-split projection's are reduce-scattered to a sequence shard (``Shard(1)``, kept a
  DTensor so the model's own code between the layers sees the whole shape), the norms on that
  stream run on their shard (torch's ``SequenceParallel``), each module that holds
  column-split projections (attention, the MLP) all-gathers its input once, and the head
  all-gathers the final norm's output; a block holding its norms and the residual sums
  besides (a user's) gathers at its projections instead (:func:`sequence_split`), and one
  tensor given to several modules is gathered once (:class:`_GatherStream`). A model whose
  code does not fit that split is refused in one line by the run. Beside pipeline stages,
  the stages hand on the hidden state's sequence shard (the replay's block inputs are those
  DTensors, counted by their local shards).

Not computed (refused in one line): styles torch's ParallelStyle cannot express (packed, expert
and MLA weights), tp with ep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import weakref
from fnmatch import fnmatchcase

from tfcli.errors import TfcliError, did_you_mean
from tfcli.parallel.layout import Line, Parallel
from tfcli.parallel.traced import TracedModel, refuse_model_splits

# Transformers' style names that torch's ParallelStyle expresses: (torch's style, in words).
# "rowwise" on an nn.Embedding takes its token ids whole (torch's default input layout for
# rowwise, Shard(-1), is a Linear's); None: the module stays whole on every rank.
STYLES = {
    "colwise": ("ColwiseParallel()", "output features split, output left split"),
    "rowwise": ("RowwiseParallel()", "input features split, outputs summed (all-reduce)"),
    "colwise_gather_output": ("ColwiseParallel(output_layouts=Replicate())",
                              "output features split, output gathered"),
    "colwise_rep": ("ColwiseParallel(output_layouts=Replicate())",
                    "output features split, output gathered"),
    "rowwise_split_input": ("RowwiseParallel(input_layouts=Replicate())",
                            "input features split from a whole input, outputs summed"),
    "rowwise_rep": ("RowwiseParallel(input_layouts=Replicate())",
                    "input features split from a whole input, outputs summed"),
    "embedding_rowwise": ("RowwiseParallel(input_layouts=Replicate())",
                          "vocabulary rows split, lookups summed"),
    "embedding_colwise": ("ColwiseParallel(output_layouts=Replicate())",
                          "embedding columns split, output gathered"),
    "replicated_with_grad_allreduce": (None, "whole on every rank, gradients all-reduced"),
    "replicate": (None, "whole on every rank"),
}
# Transformers' styles torch's ParallelStyle cannot express (or tfcli does not compute yet)
UNEXPRESSED = ("packed_colwise", "packed_rowwise", "moe_tp_experts", "moe_identity_expert",
               "ep_dispatch_experts", "grouped_gemm", "mla_kv_a_proj", "all_reduce",
               "local_params", "sequence_parallel", "local_colwise", "local_rowwise", "local",
               "gather", "isolated")
ALLOWED = "colwise, rowwise (and Transformers' " + ", ".join(
    s for s in STYLES if s not in ("colwise", "rowwise")) + ")"


@contextlib.contextmanager
def fake_world(t: int):
    """torch.distributed's fake process group of ``t`` ranks (this process rank 0) and its
    mesh, with FakeTensorMode: nothing is allocated, collectives move nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tfcli.parallel.measure import _fake_world

    with _fake_world(t) as mesh, FakeTensorMode(allow_non_fake_inputs=True):
        yield mesh


# --- the plan ---------------------------------------------------------------------------------


def sequence_parallel_asked(text: str | None) -> bool:
    """sp=1 given (as --parallel's parser reads it: ``sp=01`` too): for --model sequence
    parallelism is off unless asked for (on by default with tp for tfcli's own configuration,
    as Megatron-LM pairs them; the plans Transformers ships leave the residual stream
    whole)."""
    for item in (text or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "sp":
            try:
                return int(value) == 1
            except ValueError:  # the parser refuses it first
                return False
    return False


def parse_tp_plan(text: str) -> dict[str, str]:
    """``--tp-plan 'blocks.*.fc1=colwise,blocks.*.fc2=rowwise'``: {glob: style}, in order."""
    rules: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        glob, sep, style = (s.strip() for s in item.partition("="))
        if not sep or not glob or not style:
            raise TfcliError(f"--tp-plan {text!r}: expected GLOB=STYLE items, e.g. --tp-plan "
                             f"'blocks.*.fc1=colwise,blocks.*.fc2=rowwise'")
        if glob in rules:
            raise TfcliError(f"--tp-plan: {glob!r} is given twice")
        check_style(style, f"--tp-plan {glob}={style}")
        rules[glob] = style
    if not rules:
        raise TfcliError(f"--tp-plan {text!r}: give GLOB=STYLE items, e.g. --tp-plan "
                         f"'blocks.*.fc1=colwise,blocks.*.fc2=rowwise'")
    return rules


def check_style(style: str, where: str) -> None:
    if style in STYLES:
        return
    if style in UNEXPRESSED:
        raise TfcliError(f"{where}: the style {style!r} is not one torch's ParallelStyle "
                         f"(ColwiseParallel, RowwiseParallel) expresses, or tfcli computes; "
                         f"allowed: {ALLOWED}")
    raise TfcliError(f"{where}: unknown style {style!r}{did_you_mean(style, STYLES)}; "
                     f"allowed: {ALLOWED}")


def model_rules(subject, model, text: str | None, t: int) -> tuple[dict[str, str], str]:
    """The rules and where they come from: ``--tp-plan`` when given, else the Transformers
    model's own plan; refused without either, or when the model's plan uses styles torch's
    ParallelStyle cannot express."""
    if text is not None:
        return parse_tp_plan(text), "--tp-plan"
    own = getattr(model, "tp_plan", None) if getattr(subject, "kind", "") == "hf" else None
    if not own:
        raise TfcliError(f"--parallel tp={t}: the model has no tensor-parallel plan of its own "
                         f"(Transformers' base_model_tp_plan); give one with --tp-plan "
                         f"GLOB=colwise|rowwise,..., e.g. 'blocks.*.fc1=colwise,"
                         f"blocks.*.fc2=rowwise'")
    odd = {}
    for glob, style in own.items():
        if style not in STYLES:
            odd.setdefault(style, glob)
    name = type(model).__name__
    if odd:
        listed = ", ".join(f"{style} ({glob})" for style, glob in odd.items())
        raise TfcliError(f"--parallel tp={t}: Transformers' tensor-parallel plan of {name} "
                         f"uses {listed}, which torch's ParallelStyle (ColwiseParallel, "
                         f"RowwiseParallel) cannot express; give the plan with --tp-plan "
                         f"GLOB=colwise|rowwise,...")
    return dict(own), f"Transformers' plan of {name} (the config's base_model_tp_plan)"


def _wildcard(path: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", path)


def _splittable(model) -> list[str]:
    """The paths of the modules torch's Colwise/RowwiseParallel split, layer numbers as *."""
    from torch import nn

    return list(dict.fromkeys(_wildcard(path) for path, m in model.named_modules()
                              if isinstance(m, (nn.Linear, nn.Embedding))))


def resolve(model, rules: dict[str, str], t: int, origin: str) -> dict[str, str]:
    """{module path: style} for every module a rule matches (the first rule that does),
    checked: each rule matches a module, each module is one torch splits, each split width
    divisible by t."""
    from torch import nn

    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, str]] = {}
    for glob, style in rules.items():
        hits = [path for path in modules if path and fnmatchcase(path, glob)]
        if not hits:
            names = _splittable(model)
            param = next((n for n, _ in model.named_parameters() if fnmatchcase(n, glob)),
                         None)
            raise TfcliError(
                f"{origin}: {glob!r} " + (f"names a parameter ({param}), not a module: torch's "
                                          f"ParallelStyle splits modules" if param else
                                          f"matches no module{did_you_mean(glob, names)}")
                + (f"; modules it can split: {', '.join(names[:10])}"
                   + (", ..." if len(names) > 10 else "") if names else
                   "; it has no module torch's Colwise/RowwiseParallel split (no nn.Linear, "
                   "no nn.Embedding): there is nothing to split over tensor-parallel ranks"))
        for path in hits:
            chosen.setdefault(path, (glob, style))
    out = {}
    for path, (glob, style) in chosen.items():
        module = modules[path]
        if STYLES[style][0] is None:
            out[path] = style
            continue
        kind = type(module).__name__
        if isinstance(module, nn.Linear):
            dim, name, size = ((0, "out_features", module.out_features) if style.startswith(
                "colwise") else (1, "in_features", module.in_features))
        elif isinstance(module, nn.Embedding):
            dim, name, size = ((1, "embedding_dim", module.embedding_dim) if "colwise" in style
                               else (0, "num_embeddings", module.num_embeddings))
        else:
            raise TfcliError(f"{origin}: {glob}={style} matches {path}, a {kind}: torch's "
                             f"ColwiseParallel and RowwiseParallel split nn.Linear and "
                             f"nn.Embedding only; "
                             + ("narrow the glob to those modules" if _splittable(model) else
                                "the model has neither: there is nothing to split over "
                                "tensor-parallel ranks"))
        if size % t:
            raise TfcliError(f"--parallel tp={t}: {path} ({kind}, {style}) has {name}={size}, "
                             f"not divisible by {t}; tensor parallelism splits it evenly, so "
                             f"tp must divide it")
        out[path] = style
    if out and all(STYLES[style][0] is None for style in out.values()):
        kept = "/".join(sorted(set(out.values())))
        raise TfcliError(f"{origin}: every module it matches is {kept} (whole on every rank): "
                         f"nothing is split over tp={t}, so each rank would be the whole "
                         f"model; split some with colwise or rowwise, or drop tp")
    return out


def check_heads(subject, styles: dict[str, str], t: int) -> None:
    """A Transformers model whose projections are split with their output left split runs
    its attention on each rank's own heads: tp must divide the query and key/value heads.
    Only where the plan splits a module inside an attention module (a plan of the MLPs alone
    leaves every head whole)."""
    def in_attention(path: str) -> bool:
        return any("attn" in part or "attention" in part for part in path.split(".")[:-1])

    if getattr(subject, "kind", "") != "hf" or not any(
            style == "colwise" and in_attention(path) for path, style in styles.items()):
        return
    config = subject.config.get_text_config() if hasattr(subject.config, "get_text_config") \
        else subject.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(value, int) and value % t:
            raise TfcliError(f"--parallel tp={t}: {name}={value} is not divisible by {t}; "
                             f"each rank runs attention on its own heads (q, k, v split by "
                             f"columns), so tp must divide the query and key/value heads")


def _torch_style(style: str, module, sequence: bool = False, gathered: bool = False):
    """torch's ParallelStyle for ``style`` on ``module``; with ``sequence`` (sequence
    parallelism) the residual stream is a sequence-split DTensor: what enters it from a
    row-split module (or an embedding) is reduce-scattered to ``Shard(1)``, and a column-split
    module not inside a ``gathered`` module (one whose input is all-gathered once, as the
    head) all-gathers its own."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    whole, stream = Replicate(), Shard(1)
    into_stream = {"output_layouts": stream, "use_local_output": False} if sequence else {}
    from_stream = {"input_layouts": stream} if sequence and not gathered else {}
    if style == "colwise":
        return ColwiseParallel(**from_stream)
    if style == "rowwise" and not isinstance(module, nn.Embedding):
        return RowwiseParallel(**into_stream)
    if style == "embedding_colwise":  # refused with sequence (TensorParallelModel._split)
        return ColwiseParallel(output_layouts=whole)
    if style.startswith("colwise"):  # colwise_gather_output, colwise_rep: the head
        return ColwiseParallel(output_layouts=whole, **from_stream)
    # an embedding split by rows, rowwise_split_input, _rep, embedding_rowwise
    return RowwiseParallel(input_layouts=whole, **into_stream)


def _is_norm(module) -> bool:
    from torch import nn

    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or \
        type(module).__name__.endswith("Norm")


def _width(module) -> int | None:
    """The features a norm normalises, or a projection reads (its last weight dimension)."""
    shape = getattr(module, "normalized_shape", None)
    if shape:
        return int(shape[-1])
    weight = getattr(module, "weight", None)
    return int(weight.shape[-1]) if getattr(weight, "ndim", 0) else None


def sequence_split(model, styles: dict[str, str]) -> tuple[list[str], list[str]]:
    """Where sequence parallelism changes a tensor-parallel split: the modules that gather
    their input once and the norms on the residual stream. A module holding column-split
    projections (an attention, an MLP; not the model itself) gathers its input, and the norms
    inside it stay on a rank's own heads (a per-head q/k norm). A block that also holds a norm
    as wide as its projections' input (a user's block, norm, q, k, v and the residual sum in
    one ``forward``) holds the stream itself: its column-split projections gather their input
    instead (those given one tensor sharing one gather), and its norms of that width are on
    the stream."""
    modules = dict(model.named_modules())
    by_parent: dict[str, list[str]] = {}
    for path, style in styles.items():
        if style.startswith("colwise") and "." in path:
            by_parent.setdefault(path.rpartition(".")[0], []).append(path)
    gathered, streams = [], {}
    for parent, projections in sorted(by_parent.items()):
        widths = {_width(modules[path]) for path in projections}
        # with every output left split (plain colwise), a norm that wide cannot be on one
        # (OLMo 2's whole-q norm follows colwise_gather_output): it is on the block's input
        wide = {path for path, module in modules[parent].named_children()
                if _is_norm(module) and _width(module) in widths} \
            if all(styles[path] == "colwise" for path in projections) else set()
        if wide:
            gathered += sorted(projections)
            streams[parent + "."] = {f"{parent}.{name}" for name in wide}
        else:
            gathered.append(parent)
    inside = tuple(path + "." for path in gathered if path not in styles)
    norms = [path for path, module in modules.items()
             if path and _is_norm(module) and not path.startswith(inside)
             and path not in gathered
             and all(path in names for block, names in streams.items()
                     if path.startswith(block))]
    return gathered, norms


class _GatherStream:
    """A forward pre-hook for the modules that gather their input: each sequence-split DTensor
    the module is called with is all-gathered and handed on as a whole local tensor (what
    torch's PrepareModuleInput does with desired layout Replicate, for positional and keyword
    inputs alike), once per tensor: a second module called with the same DTensor (a parallel
    block, Phi's, feeds attention and the MLP from one norm) gets the whole tensor
    the first one's gather made, while that is alive, where PrepareModuleInput on both would
    gather it twice and each projection keep its own copy for backward. That is torch's
    PrepareModuleOutput on the norm (its output made Replicate once; tested). Tensors are
    held weakly: the hook keeps nothing alive."""

    def __init__(self) -> None:
        self._whole: dict[int, tuple[weakref.ref, weakref.ref]] = {}

    def __call__(self, module, args, kwargs):
        return tuple(self._gathered(a) for a in args), \
            {k: self._gathered(v) for k, v in kwargs.items()}

    def _gathered(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not (isinstance(x, DTensor) and any(isinstance(p, Shard) for p in x.placements)):
            return x
        seen = self._whole.get(id(x))
        if seen is not None and seen[0]() is x and seen[1]() is not None:
            return seen[1]()
        whole = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim).to_local()
        self._whole = {key: refs for key, refs in self._whole.items()
                       if refs[0]() is not None and refs[1]() is not None}
        self._whole[id(x)] = (weakref.ref(x), weakref.ref(whole))
        return whole


def parallelize(model, mesh, styles: dict[str, str], t: int,
                sequence: bool = False) -> tuple[list[str], list[str], dict[str, str]]:
    """torch's ``parallelize_module`` with each module's style (``sequence``: with sequence
    parallelism, :func:`sequence_split`); tied parameters split the same way are tied again
    (each module's split replaces its parameter), and refused when the plan splits them
    differently. Returns sequence_split's answer and, for each style, the torch
    ParallelStyle(s) it was applied as (their repr, which gives every layout)."""
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    modules = dict(model.named_modules())
    ties: dict[int, list[tuple[str, str]]] = {}
    for path, module in modules.items():
        for name, p in module.named_parameters(recurse=False):
            ties.setdefault(id(p), []).append((path, name))
    gathered, norms = sequence_split(model, styles) if sequence else ([], [])
    inside = tuple(path + "." for path in gathered)
    plan = {path: _torch_style(style, modules[path], sequence,
                               path in gathered or path.startswith(inside))
            for path, style in styles.items() if STYLES[style][0] is not None}
    applied: dict[str, list[str]] = {}
    for path, style in styles.items():
        text = repr(plan[path]) if path in plan else "(not split)"
        if text not in applied.setdefault(style, []):
            applied[style].append(text)
    plan.update((path, SequenceParallel()) for path in norms)
    parallelize_module(model, mesh, plan)
    gather = _GatherStream()  # one for the model: modules share what it gathered
    for path in gathered:  # before a projection's own input hook, which expects it whole
        modules[path].register_forward_pre_hook(gather, with_kwargs=True, prepend=True)
    for group in (g for g in ties.values() if len(g) > 1):
        params = [modules[path]._parameters[name] for path, name in group]
        layouts = [getattr(p, "placements", None) for p in params]
        if any(layout != layouts[0] for layout in layouts):
            (a, a_name), (b, b_name) = group[0], group[1]
            raise TfcliError(
                f"--parallel tp={t}: {b}.{b_name} is tied to {a}.{a_name}, and the plan splits "
                f"them differently ({a}: {styles.get(a, 'not split')}; {b}: "
                f"{styles.get(b, 'not split')}); split both by vocabulary rows "
                f"(embedding_rowwise on the embedding, colwise on the head) or neither")
        for path, name in group[1:]:
            modules[path]._parameters[name] = params[0]
    return gathered, norms, {style: " / ".join(texts) for style, texts in applied.items()}


def _row_split_stream_readers(model, styles: dict[str, str]) -> list[str]:
    """Watch the modules split by rows (``rowwise`` Linears, whose input is split by
    features): the paths of those called with the sequence-split stream (a DTensor sharded
    along the sequence) are added to the list returned, as the model runs."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    modules, readers = dict(model.named_modules()), []

    def watch(path: str):
        def hook(module, args, kwargs):
            given = [*args, *kwargs.values()]
            if path not in readers and any(
                    isinstance(a, DTensor) and any(isinstance(p, Shard) and p.dim == 1
                                                   for p in a.placements) for a in given):
                readers.append(path)
        return hook

    for path, style in styles.items():
        if style == "rowwise" and not isinstance(modules[path], nn.Embedding):
            modules[path].register_forward_pre_hook(watch(path), with_kwargs=True,
                                                    prepend=True)
    return readers


def _local(t):
    return getattr(t, "_local_tensor", t)


def _untie(model) -> None:
    """Each module that shares a parameter with an earlier one gets a copy of its own (same
    shape and placements, same requires_grad), as a manual pipeline split leaves tied
    embeddings: a copy on each stage that holds one of the modules."""
    from torch import nn

    seen: set[int] = set()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:
                module._parameters[name] = nn.Parameter(p.detach().clone(),
                                                        requires_grad=p.requires_grad)
            seen.add(id(p))


# --- the plan of one rank ----------------------------------------------------------------------


class TensorParallelModel(TracedModel):
    """A subject split by tensor parallelism over ``par.tp`` ranks: the TracedModel of one
    rank's share (its units and parameter groups hold local shards), replayed as torch runs
    it. ``tp_plan``: --tp-plan's text (None: the Transformers model's own plan); ``probe``:
    the sizes the split is first run at (the asked ones, at B = 1: a model that takes one
    length only runs there; default the subject's small default sizes)."""

    def __init__(self, subject, wrap: str | None, par: Parallel,
                 tp_plan: str | None = None, sequence: bool = False,
                 probe: dict[str, int] | None = None) -> None:
        refuse_model_splits(par, tensor=True)
        if par.ep > 1:
            raise TfcliError(f"--parallel tp={par.tp},ep={par.ep}: expert parallelism beside "
                             f"tensor parallelism is not computed yet for --model; drop one")
        self.subject, self.wrap, self.t, self.sequence = subject, wrap, par.tp, sequence
        # the sizes the split is probed at: lengths the t ranks share evenly
        self.probe = {**subject.default_sizes, **(probe or {}), "B": 1}
        if sequence:
            self.probe.update((d, -(-self.probe[d] // self.t) * self.t)
                              for d in subject.length_dims() if d in self.probe)
        self._stages = {}
        self.tp_plan_text = tp_plan
        with fake_world(self.t) as mesh:
            model = self._split(mesh)
            readers = _row_split_stream_readers(model, self.styles) if sequence else []
            self._survey(model)
            self.whole = sum(p.numel() for p in model.parameters())  # the global shapes
            self.split = sum(1 for style in self.styles.values() if STYLES[style][0])
            try:
                self.grad_numel, self.grad_notes, self.grad_excess = self._gradients(model)
            finally:  # the probe ran (or failed) with the readers watched
                self._refuse_stream_readers(readers)

    def _split(self, mesh, dtype=None):
        """The subject built on fake tensors and split; the first time, its plan is
        resolved and checked."""
        from torch import nn

        model = self.subject.build("cpu", dtype)
        if not hasattr(self, "styles"):
            rules, self.plan_from = model_rules(self.subject, model, self.tp_plan_text, self.t)
            origin = "--tp-plan" if self.tp_plan_text is not None else \
                f"--parallel tp={self.t} ({self.plan_from})"
            self.rules = rules
            self.styles = resolve(model, rules, self.t, origin)
            modules = dict(model.named_modules())
            # what starts the stream: a module split by rows from a whole input (an embedding
            # by its vocabulary, a first Linear by its input features), as _torch_style has it
            self.stream_starts = [
                path for path, style in self.styles.items()
                if style in ("rowwise_split_input", "rowwise_rep", "embedding_rowwise")
                or (style == "rowwise" and isinstance(modules[path], nn.Embedding))]
            check_heads(self.subject, self.styles, self.t)
            colwise = [path for path, style in self.styles.items()
                       if style == "embedding_colwise"]
            if self.sequence and colwise:
                raise TfcliError(
                    f"--parallel tp={self.t},sp=1: {colwise[0]} is split by embedding "
                    f"columns (embedding_colwise), whose output would reach the sequence-split "
                    f"residual stream through an all-to-all, which torch's CPU process group "
                    f"replaces with an all-gather; split it by vocabulary rows "
                    f"(embedding_rowwise) or drop sp=1")
            if self.sequence and not self.stream_starts:
                raise TfcliError(
                    f"--parallel tp={self.t},sp=1: nothing in the plan starts the "
                    f"sequence-split residual stream, so the model's input would reach the "
                    f"first split module whole and be taken for one rank's shard of the "
                    f"sequence; split the module the input enters by rows from a whole input "
                    f"(rowwise_split_input for a Linear, embedding_rowwise for an embedding) "
                    f"or drop sp=1")
        *self.sequence_modules, self.applied = parallelize(model, mesh, self.styles, self.t,
                                                           self.sequence)
        return model

    def check_lengths(self, sizes: dict[str, int]) -> None:
        """Sequence parallelism splits each length evenly over the t ranks."""
        if not self.sequence:
            return
        for d in self.subject.length_dims():
            if sizes.get(d, 0) % self.t:
                raise TfcliError(f"--parallel tp={self.t},sp=1: sequence parallelism splits "
                                 f"the sequence {self.t} ways; {d}={sizes[d]} is not "
                                 f"divisible by {self.t}")

    def _gradients(self, model) -> tuple[int, list[str], dict[str, tuple[int, str]]]:
        """The trainable parameters' gradients as torch's backward makes them on one rank
        (elements), a note for each that is larger than its parameter's shard, and for each
        such parameter (by its first name) the elements beyond its shard and its note: one
        small fake forward and backward of the split ``model``."""
        from tfcli.inspection.memory import _sizes_text
        from tfcli.subjects.base import RunFailed, backward, running

        sizes = self.probe
        inputs = self.subject.step_inputs(model, sizes, "cpu")
        try:
            with running(model, "forward and backward pass"):
                loss = self.subject.loss(inputs(model))
                backward(loss, model)
        except RunFailed as error:
            self._runs_whole(sizes)  # the model's own failure is said as the model's
            where = "--tp-plan" if self.tp_plan_text is not None else "its plan"
            raise TfcliError(
                f"--parallel tp={self.t}{',sp=1' if self.sequence else ''} with {where}: "
                f"one rank's share cannot run ({_sizes_text(self.subject, sizes)}, fake "
                f"tensors): {error}; each split module hands on 1/{self.t} of its features, "
                f"so the code after it must work on a share (heads divisible by tp, no sizes "
                f"fixed in the code)" + (
                    "; with sp=1 the residual stream is a sequence-split DTensor from the "
                    "input embedding's (or first projection's) output to the head, so every "
                    "module that reads it must be in the plan (a first Linear as "
                    "rowwise_split_input, the head as colwise_rep, each projection that "
                    "reads a norm's output)"
                    if self.sequence else "")) from None
        total, notes, excess, seen = 0, [], {}, set()
        for name, p in model.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            grad = _local(p.grad) if p.grad is not None else _local(p)
            total += grad.numel()
            if grad.numel() > _local(p).numel():
                notes.append(f"{name}: {'×'.join(map(str, grad.shape))} (its shard "
                             f"{'×'.join(map(str, _local(p).shape))})")
                excess[name] = (grad.numel() - _local(p).numel(), notes[-1])
        return total, notes, excess

    def _refuse_stream_readers(self, readers: list[str]) -> None:
        if readers:
            raise TfcliError(
                f"--parallel tp={self.t},sp=1: {readers[0]} is split by rows (rowwise) and "
                f"reads the sequence-split residual stream: its feature shards would come "
                f"from an all-to-all (Shard(1) to Shard(-1)), which torch's CPU process "
                f"group cannot run on fake tensors; split it by columns (colwise_rep for a "
                f"head, colwise inside a block) or drop sp=1")

    def _runs_whole(self, sizes: dict[str, int]) -> None:
        """Raise the model's own failure (exit 1, as without tensor parallelism) when the
        whole model, unsplit, cannot run at ``sizes`` either: then the plan is not to blame."""
        from tfcli.inspection.memory import REPLAY
        from tfcli.subjects.base import RunFailed, backward, running

        model = self.subject.build("cpu")
        inputs = self.subject.step_inputs(model, sizes, "cpu")
        try:
            with running(model, "forward and backward pass"):
                backward(self.subject.loss(inputs(model)), model)
        except RunFailed as error:
            raise RunFailed(f"{error} ({REPLAY}, the model whole: before any split)") from None

    def plan(self, par: Parallel, *args, **kwargs):
        result = super().plan(par, *args, **kwargs)
        result.parallel = dataclasses.replace(par, sp=self.sequence)  # as computed
        result.conditions["tensor_parallel"] = self.conditions()
        stage = ""
        if par.pp > 1:
            worst = self.stages(par.pp)[result.stage]
            stage = (f"; stage {worst.index} of pp={par.pp} holds "
                     f"{sum(g.numel for g in worst.groups):,} of its {worst.whole:,}")
        result.conditions["model_states_from"] = (
            f"the built model split by torch's parallelize_module over tp={self.t}: "
            f"{self.numel:,} of its {self.whole:,} parameters on this rank "
            f"({self.trainable:,} trainable){stage}")
        return result

    def _check_splits(self, par: Parallel) -> None:
        refuse_model_splits(par, tensor=True)
        if par.tp != self.t:
            raise TfcliError(f"--parallel tp={par.tp}: this model is split {self.t} ways")

    def stages(self, pp: int, sizes: dict[str, int] | None = None) -> list:
        """One rank's share over ``pp`` pipeline stages: the split model placed on stages as
        tfcli.parallel.pipeline.split places a whole one, each stage's groups its local
        shards."""
        from tfcli.parallel.pipeline import split

        if pp not in self._stages:
            with fake_world(self.t) as mesh:
                self._stages[pp] = split(self.subject, self.wrap, sizes or self.probe, pp,
                                         build=lambda: self._split(mesh))
                if not hasattr(self, "stage_grad_excess"):
                    # each stage holds its own copy of a tied parameter (the first stage the
                    # embedding's, the last the head's), whose gradient only its own modules
                    # make: a vocabulary-parallel embedding's alone is whole even where the
                    # tied sum is a shard
                    model = self._split(mesh)
                    _untie(model)
                    self.stage_grad_excess = self._gradients(model)[2]
        return self._stages[pp]

    def stage_view(self, stage):
        """The share as if it were the pipeline stage ``stage``: its parameters before the
        split, the modules split in it and the gradients torch's backward makes there."""
        view = super().stage_view(stage)
        view.whole = stage.whole
        view.split = sum(1 for path, style in self.styles.items() if STYLES[style][0] and any(
            name.startswith(path + ".") for name in stage.parameter_names))
        mine = [excess for name, excess in self.stage_grad_excess.items()
                if name in stage.parameter_names]
        view.grad_numel = view.trainable + sum(extra for extra, _ in mine)
        view.grad_notes = [note for _, note in mine]
        return view

    @functools.lru_cache(maxsize=64)
    def replay(self, sizes: tuple, dtype: str, mixed: str | None, kernel: str,
               loop: str = "loss-only", device: str = "cpu"):
        from tfcli.inspection.memory import (DTYPES, LOOP_WORDS, _sizes_text,
                                             simulate_training_step)

        subject, t = self.subject, self.t
        self.check_lengths(dict(sizes))
        with fake_world(t) as mesh:
            estimate = simulate_training_step(
                lambda: self._split(mesh, DTYPES[dtype] if dtype != "fp32" else None),
                lambda model: subject.step_inputs(model, dict(sizes), "cpu"), subject.loss,
                autocast_dtype=DTYPES[mixed] if mixed else None, device=device, kernel=kernel,
                units=self._units_of, loop=loop)
        how = ("fake-tensor replay of forward+backward of one rank's share under tensor "
               + ("and sequence " if self.sequence else "")
               + f"parallelism (torch's parallelize_module on a fake world of {t} ranks), "
               f"{_sizes_text(subject, dict(sizes))}, {subject.loss_name()}"
               + (f", autocast {mixed}" if mixed else "") + f"; {LOOP_WORDS[loop]}"
               + "".join(f"; {line}" for line in subject.assumptions(dict(sizes))))
        return estimate, how

    def _state_lines(self, n: int, zero: int, sb, ep: int = 1) -> list[Line]:
        lines = super()._state_lines(n, zero, sb, ep)
        share = (f"one rank's share of tp={self.t}: {self.numel:,} of {self.whole:,} "
                 f"parameters, {self.split} module(s) split by torch's parallelize_module")
        for line in lines:
            if line.name == "weights":
                line.how = f"{share}; {line.how}"
            # gradients the rank keeps whole (not sharded by ZeRO): as torch's backward made
            # them, which may be larger than the parameter's shard
            if line.name == "gradients" and sb.grads and zero < sb.grads_sharded_at \
                    and self.grad_notes:
                line.bytes = self.grad_numel * sb.grads
                line.how = (f"{sb.tag()} {sb.grads} B × {self.grad_numel:,} gradient "
                            f"elements, as torch's backward makes them on this rank; larger "
                            f"than their parameters' shards: {'; '.join(self.grad_notes)} "
                            f"(torch's DTensor has no vocabulary-sharded rule for an "
                            f"embedding's backward: the gradient is whole)")
        return lines

    def conditions(self) -> dict:
        return {"tp": self.t, "plan_from": self.plan_from, "rules": self.rules,
                "modules_split": self.split,
                "styles": {style: self.applied[style]
                           for style in dict.fromkeys(self.styles.values())},
                "sequence_parallel": self._sequence_words(),
                "how": f"torch's parallelize_module on a fake process group of {self.t} "
                       f"ranks in one process, fake tensors: each parameter a DTensor, this "
                       f"rank's local shard counted"}

    def _sequence_words(self) -> str:
        if not self.sequence:
            return ("not applied (ask with sp=1): the norms and the residual stream stay whole "
                    "on every rank, as the plan leaves them")
        gathered, norms = self.sequence_modules
        return (f"applied: the residual stream split along the sequence over the {self.t} ranks "
                f"(Shard(1)): {len(norms)} norm(s) on their shard (SequenceParallel), "
                f"{len(gathered)} module(s) all-gathering their input once ("
                + ", ".join(dict.fromkeys(_wildcard(p) for p in gathered))
                + "; any tensor given to two of them gathered once), the outputs of "
                + ", ".join(self.stream_starts) + " and of the row-split projections "
                "reduce-scattered to the shard")
