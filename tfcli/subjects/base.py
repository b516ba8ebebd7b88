"""A Subject: everything an inspection needs to know about one model, whoever wrote it.

How to build it (meta, fake or a real device), how to make its inputs for given dimension
sizes, the names of its dimensions, which lengths a sweep may vary, and the loss a training
step would use. tfcli's own Transformer, a user's ``nn.Module`` and a Hugging Face
configuration are the three kinds; inspection code sees only this interface.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from tfcli.errors import InputError, TfcliError
from tfcli.subjects.contain import OsExitCalled, contained, signal_came

# What the letters mean wherever a shape is printed.
LEGEND = {"B": "batch", "S": "source length", "T": "target length", "L": "sequence length",
          "h": "query heads", "h_kv": "key/value heads", "d_k": "head dimension",
          "d_model": "model width", "d_ff": "FFN hidden width", "V": "vocabulary",
          "d_embed": "embedding width, projected to d_model",
          "3·d_model": "fused Q, K, V projection width", "E": "experts in an MoE layer",
          "k": "experts each token is routed to", "B·L": "tokens (batch × length)",
          "C": "image channels", "H": "image height", "W": "image width",
          "P": "image patches (H/p · W/p, p the patch size)", "F": "mel bins",
          "N": "audio frames"}
# The letters of images and speech, whose meaning the shapes legend spells out (the text
# letters above are the paper's, explained once in the README).
MODALITY_LETTERS = ("C", "H", "W", "P", "F", "N")
LENGTH_LETTERS = ("S", "T", "L")

DTYPES = {"int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int64,
          "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float64": torch.float64, "bool": torch.bool}


@contextlib.contextmanager
def model_prints_to_stderr():
    """stdout holds tfcli's answer (tables, JSON): what a model prints while it is imported,
    built or run goes to stderr instead — print() and sys.stdout, and also sys.__stdout__ and
    file descriptor 1, which the model may write to directly. A working directory the model
    changes is changed back after it, so tfcli's relative output paths (--csv, --png) stay
    the user's."""
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under us: nothing to return to
        cwd = None
    saved = None
    try:
        if sys.__stdout__ is not None:
            sys.__stdout__.flush()  # what tfcli wrote before stays on stdout
        saved = os.dup(1)
        os.dup2(2, 1)
    except (OSError, ValueError):  # no descriptor 1 or 2 (closed): print() is still caught
        if saved is not None:
            os.close(saved)
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            try:
                if sys.__stdout__ is not None:
                    sys.__stdout__.flush()  # the model's buffered writes go to stderr too
            except (OSError, ValueError):
                pass
            os.dup2(saved, 1)
            os.close(saved)
        if cwd is not None:
            try:
                if os.getcwd() != cwd:
                    os.chdir(cwd)
            except OSError:  # the model removed the directory it moved to: return from there
                try:
                    os.chdir(cwd)
                except OSError:  # ours is gone too: relative outputs fail and say where
                    pass


@contextlib.contextmanager
def model_code(stage: str):
    """Where tfcli calls code it did not write (``stage``: "in its forward pass", "while it
    was built"): what it prints goes to stderr, the directory is kept, and os._exit() or a
    crash is reported in one line instead of ending tfcli silently (tfcli.subjects.contain)."""
    with contained(stage), model_prints_to_stderr():
        yield


@dataclass
class Inputs:
    """Positional and keyword arguments of one forward call."""
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, model: nn.Module):
        with model_code("in its forward pass"):
            return self.call(model)

    def call(self, model: nn.Module):
        """The call alone, for a timed loop that runs inside one model_code() (redirecting
        stdout costs system calls, which a timing must not include). What would end tfcli
        (sys.exit, os._exit, a BaseException, a KeyboardInterrupt no signal sent) becomes
        ModelExited, an error like any other the model raises."""
        try:
            return model(*self.args, **self.kwargs)
        except Exception:
            raise
        except BaseException as error:
            what = model_ending(error)
            if what is None:  # Ctrl-C or SIGTERM: tfcli stops as usual
                raise
            raise ModelExited(f"the model {what}") from None

    def tensors(self) -> list[Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, Tensor)]

    def to(self, device: str | torch.device) -> Inputs:
        move = lambda t: t.to(device) if isinstance(t, Tensor) else t  # noqa: E731
        return Inputs(tree_map(move, self.args), tree_map(move, self.kwargs))

    def named(self, model: nn.Module) -> dict[str, Any]:
        """Every argument by the name ``forward`` gives it (positional ones bound by signature)."""
        try:
            bound = inspect.signature(model.forward).bind_partial(*self.args, **self.kwargs)
            return dict(bound.arguments)
        except (TypeError, ValueError):
            return {**{f"arg{i}": a for i, a in enumerate(self.args)}, **self.kwargs}

    def replace(self, model: nn.Module, name: str, value: Any) -> Inputs:
        """The same call with argument ``name`` (as ``forward`` names it) replaced."""
        if name in self.kwargs:
            return Inputs(self.args, {**self.kwargs, name: value})
        params = list(inspect.signature(model.forward).parameters)
        index = params.index(name)
        args = list(self.args)
        args[index] = value
        return Inputs(tuple(args), self.kwargs)


MAX_DIM = 2**40  # one size of --input or --dim, far above any real one (products: check_bytes)
MAX_TENSOR_BYTES = 2**63 - 1  # torch counts a tensor's bytes in an int64, even on meta


def _size_in(text: str, high: int) -> int | None:
    """``text`` as an integer from 1 to ``high``, else None. ASCII digits only: ``isdigit()``
    is also true of "²", which int() refuses, and int() refuses more than 4,300 digits."""
    text = text.strip()
    if not re.fullmatch(r"[0-9]+", text) or len(text.lstrip("0")) > len(str(high)):
        return None
    value = int(text)
    return value if 1 <= value <= high else None


@dataclass(frozen=True)
class InputSpec:
    """One ``--input NAME=DTYPE[DIMS]<HIGH``: a tensor made for the model."""
    name: str
    dtype: str
    dims: tuple[str | int, ...]
    high: int | None = None  # integer inputs: ids drawn in [0, high)

    def shape(self, sizes: dict[str, int]) -> list[int]:
        missing = [d for d in self.dims if isinstance(d, str) and d not in sizes]
        if missing:
            raise TfcliError(f"--input {self.name}: no size for {', '.join(missing)}; bind it "
                             f"with --dim {missing[0]}=SIZE")
        shape = [sizes[d] if isinstance(d, str) else d for d in self.dims]
        self.check_bytes(shape)
        return shape

    def check_bytes(self, shape: list[int]) -> None:
        """Each size is within MAX_DIM, but their product need not fit a tensor: torch would
        fail with "Storage size calculation overflowed"."""
        from math import prod

        elements, itemsize = prod(shape), DTYPES[self.dtype].itemsize
        if elements * itemsize > MAX_TENSOR_BYTES:
            axes = ", ".join(f"{d}={n}" if isinstance(d, str) else str(n)
                             for d, n in zip(self.dims, shape))
            raise TfcliError(f"--input {self.name}: [{axes}] is {elements:.3g} elements of "
                             f"{itemsize} bytes ({self.dtype}), more than a tensor can hold "
                             f"(2**63 bytes); use smaller sizes")


_SPEC = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*([A-Za-z0-9]+)\s*\[([^\]]*)\]\s*"
                   r"(?:<\s*([0-9]+))?\s*$")


def parse_input(text: str) -> InputSpec:
    match = _SPEC.match(text)
    example = "e.g. --input src=int64[B,S] or --input x=float32[B,L,512] or ids=int64[B,T]<1000"
    if not match:
        raise TfcliError(f"--input {text!r}: expected NAME=DTYPE[DIMS], {example}")
    name, dtype, dims_text, high = match.groups()
    if dtype not in DTYPES:
        raise TfcliError(f"--input {text!r}: dtype {dtype!r} is not one of "
                         f"{', '.join(sorted(set(DTYPES)))}")
    dims: list[str | int] = []
    for part in (p.strip() for p in dims_text.split(",")):
        size = _size_in(part, MAX_DIM)
        if size is not None:
            dims.append(size)
        elif re.fullmatch(r"[A-Za-z_]\w*", part or "-"):
            dims.append(part)
        else:
            raise TfcliError(f"--input {text!r}: each dimension is a letter bound by --dim "
                             f"(B, S, T, L, ...) or a positive integer up to 2**40, got "
                             f"{part[:40]!r}")
    if high is not None and (DTYPES[dtype].is_floating_point or DTYPES[dtype] == torch.bool):
        raise TfcliError(f"--input {text!r}: '<{high}' bounds the ids of an integer input "
                         f"(int64, int32); a {dtype} input takes no bound, e.g. "
                         f"{name}=int64[{dims_text.strip()}]<{high}, or drop '<{high}'")
    high_value = None
    if high is not None:
        largest = torch.iinfo(DTYPES[dtype]).max  # ids are drawn below N, in the input's dtype
        high_value = _size_in(high, largest)
        if high_value is None:
            shown = high if len(high) <= 40 else f"a {len(high)}-digit number"
            raise TfcliError(f"--input {name}: '<{shown}' draws ids from 0 to N-1, so N must "
                             f"be at least 1 and at most {largest:,} (the largest {dtype})")
    spec = InputSpec(name, dtype, tuple(dims), high_value)
    if all(isinstance(d, int) for d in dims):  # fixed sizes: refused before the model is built
        spec.check_bytes(list(dims))
    return spec


def parse_dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    size = _size_in(value, MAX_DIM) if sep else None
    if size is None or not re.fullmatch(r"[A-Za-z_]\w*", name.strip()):
        raise TfcliError(f"--dim {text[:100]!r}: expected NAME=SIZE with a positive size up to "
                         f"2**40, e.g. --dim S=128")
    return name.strip(), size


def make_tensors(specs: list[InputSpec], sizes: dict[str, int], device: str | torch.device,
                 default_high: int, seed: int = 0) -> dict[str, Tensor]:
    """Tensors for ``specs``: ids below ``high`` (or ``default_high``), bools all True, floats
    normal. On meta nothing is drawn, so no size costs memory."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in specs:
        shape, dtype = spec.shape(sizes), DTYPES[spec.dtype]
        if str(device) == "meta":
            out[spec.name] = torch.empty(shape, dtype=dtype, device="meta")
        elif dtype == torch.bool:
            out[spec.name] = torch.ones(shape, dtype=dtype, device=device)
        elif dtype.is_floating_point:
            out[spec.name] = torch.randn(shape, generator=g).to(device, dtype)
        else:
            high = spec.high or default_high
            out[spec.name] = torch.randint(0, high, shape, generator=g).to(device, dtype)
    return out


def signature_text(model: nn.Module) -> str:
    try:
        return f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward(...)"


def check_inputs_fit(model: nn.Module, names: list[str]) -> None:
    """Every input name must be a parameter of ``forward`` (unless it takes **kwargs), and
    every parameter without a default must be given."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    kinds = inspect.Parameter
    if not any(p.kind is kinds.VAR_KEYWORD for p in params.values()):
        for name in names:
            if name not in params:
                raise InputError(f"--input {name}: {type(model).__name__}.forward has no "
                                 f"parameter {name!r}; it is {signature_text(model)}")
    missing = [n for n, p in params.items() if p.default is kinds.empty and n not in names
               and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    if missing:
        raise InputError(f"--input: nothing given for {', '.join(missing)}; "
                         f"{signature_text(model)} needs it (e.g. --input {missing[0]}=int64[B,L])")


def primary_output(output) -> Tensor:
    """The tensor a loss or a comparison uses: the output itself, ``.logits``, or the first
    floating tensor in whatever structure the model returned."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    for leaf in tree_flatten(output if not hasattr(output, "to_tuple") else output.to_tuple())[0]:
        if isinstance(leaf, Tensor) and leaf.is_floating_point():
            return leaf
    raise TfcliError(f"the model returned {type(output).__name__}, which holds no floating "
                     f"tensor to inspect", exit_code=1)  # the model's doing: a failed run


def own_loss(output) -> Tensor | None:
    """The loss the model computed itself, where it returned one: a Transformers output's
    ``loss`` (given labels), or a 0-dim floating tensor among the items it returned (nanoGPT's
    ``logits, loss = model(x, targets)``)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor) and loss.ndim == 0 and loss.is_floating_point():
        return loss
    if isinstance(output, (tuple, list)):
        return next((t for t in output if isinstance(t, Tensor) and t.ndim == 0
                     and t.is_floating_point()), None)
    return None


def default_loss(output) -> Tensor:
    """The model's own loss where it returned one, else the mean square of the primary output:
    a stand-in loss whose backward reaches every layer."""
    own = own_loss(output)
    return own if own is not None else primary_output(output).float().square().mean()


class Subject:
    """One model to inspect. Subclasses fill in build and make_inputs; the rest has defaults."""

    kind = "module"  # "tfcli", "module" or "hf"
    label = "model"
    kernels: tuple[str, ...] = ("model",)  # attention implementations bench may compare
    default_sizes: dict[str, int] = {"B": 2, "S": 9, "T": 7, "L": 9}

    def build(self, device: str | torch.device = "meta", dtype: torch.dtype | None = None,
              kernel: str | None = None) -> nn.Module:
        raise NotImplementedError

    def make_inputs(self, model: nn.Module, sizes: dict[str, int],
                    device: str | torch.device = "meta", seed: int = 0) -> Inputs:
        raise NotImplementedError

    def length_dims(self) -> list[str]:
        """The length letters the inputs use (what bench sweeps)."""
        return []

    def dims_used(self) -> list[str]:
        """The letters of B, S, T, L the inputs use, for the legend."""
        return ["B", *self.length_dims()]

    def sizes_used(self, sizes: dict[str, int] | None) -> dict[str, int] | None:
        """``sizes`` less the letters no input uses (what a record says it was sized at)."""
        if sizes is None:
            return None
        used = self.dims_used()
        return {d: n for d, n in sizes.items() if d in used}

    def refuse_search(self, fit_what: str | None) -> None:
        """Refuse a --fit search for a size the inputs do not have."""
        if fit_what == "seq-len" and not self.has_sequence():
            raise TfcliError(f"--fit seq-len: the model's inputs have no sequence length to "
                             f"search ({self.why_no_sequence()})"
                             + ("; use --fit batch" if "B" in self.dims_used() else ""))
        if fit_what == "batch" and "B" not in self.dims_used():
            raise TfcliError("--fit batch: the model's inputs have no batch dimension to "
                             "search (no --input names one: example inputs its callable "
                             "returns keep their sizes); describe them, e.g. --input "
                             "NAME=DTYPE[B,L,...]")

    def has_sequence(self) -> bool:
        """Whether the inputs have a token sequence (S, T or L) that --seq-len sizes."""
        return any(d in ("S", "T", "L") for d in self.length_dims())

    def why_no_sequence(self) -> str:
        """What the inputs have instead of a sequence, in words (for has_sequence() False)."""
        lengths = self.length_dims()
        if lengths:
            return f"{' and '.join(lengths)} are an image's sides"
        return ("the batch B is their one size" if "B" in self.dims_used()
                else "their sizes are fixed")

    def fixed_dims(self) -> dict[str, tuple[int, str]]:
        """Letters the model allows one size for: letter -> (size, why), for --dim."""
        return {}

    def derived_dims(self, sizes: dict[str, int]) -> dict[str, int]:
        """Sizes that follow from the inputs' (an image's patches P), for the legend."""
        return {}

    def tokens(self, sizes: dict[str, int]) -> int:
        """Positions one batch holds, for throughput: B × the (last) length."""
        lengths = [sizes[d] for d in self.length_dims()] or [1]
        return sizes["B"] * lengths[-1]

    def step_inputs(self, model: nn.Module, sizes: dict[str, int],
                    device: str | torch.device = "meta", seed: int = 0) -> Inputs:
        """The inputs of one training step: make_inputs's, and whatever the model's own loss
        needs beside them (a Transformers language model's labels)."""
        return self.make_inputs(model, sizes, device, seed)

    def loss(self, output) -> Tensor:
        self._returned_loss = own_loss(output) is not None  # for loss_name, after a run
        return default_loss(output)

    def loss_name(self) -> str:
        """The loss the last replayed step used."""
        if getattr(self, "_returned_loss", False):
            return "the loss the model returned"
        return "mean-square loss on the output (a stand-in)"

    def model_dims(self, model: nn.Module) -> dict[str, int]:
        """Sizes the model itself defines (d_model, h, d_k, d_ff, V), where known up front."""
        return {}

    def is_causal_scope(self, path: str) -> bool:
        """Whether attention inside module ``path`` is causal (for --causal-flops)."""
        return False

    def describe(self) -> dict:
        return {"kind": self.kind, "label": self.label}

    # Mixture of experts (tfcli.inspection.moe finds the experts in any model).
    def experts_per_token(self) -> int | None:
        """k, where the model's experts do not say it themselves (a configuration does)."""
        return None

    def assumptions(self, sizes: dict[str, int] | None = None) -> list[str]:
        """What a replay on meta or fake tensors (at ``sizes``) had to assume or choose, for
        the figures' "how"."""
        return []

    def count_natively(self) -> None:
        """Before a real run whose FLOPs torch's FlopCounterMode is to check: run the
        implementations whose every matrix product it counts with its own formulas."""

    # What the mask check may take as known (tfcli.inspection.verdict); a user's model knows
    # nothing up front, so these are empty unless the subject can vouch for them.
    def input_dims(self, name: str) -> tuple | None:
        """The letters of input ``name``'s axes, as its --input spec writes them."""
        return next((s.dims for s in getattr(self, "input_specs", None) or [] if s.name == name),
                    None)

    def mask_conventions(self) -> dict[str, tuple[str, str]]:
        """Mask arguments whose convention the subject knows: name -> (convention, how)."""
        return {}

    def causal_inputs(self) -> list[str]:
        """Inputs the model is built to treat causally."""
        return []

    def windows(self) -> dict[str, tuple[int, bool]]:
        """Length letter -> (sliding window W, causal?) the model's attention keeps to."""
        return {}

    def unmasked_lengths(self, sizes: dict[str, int]) -> dict[str, tuple[int, str, str]]:
        """Lengths no mask argument reaches, attended over in full by the model's design (an
        image's patches, audio frames after an encoder's convolutions): letter -> (size, the
        part of the model that attends over them, what they are). Attention along them must
        block no key."""
        return {}

    # Code that reads values in its forward (Transformers' mask preparation calls .item())
    # cannot run on meta; fake tensors run it, and such code treats them as tracing.
    runs_on_meta = True

    def abstract_run(self, device: str):
        """(device to build and run on, context to do it in) for ``device``; "meta" becomes
        CPU under FakeTensorMode for a model that cannot run on meta. Either way no weights
        are allocated and no arithmetic is done."""
        import contextlib

        if str(device) != "meta" or self.runs_on_meta:
            return device, contextlib.nullcontext()
        from torch._subclasses.fake_tensor import FakeTensorMode

        return "cpu", FakeTensorMode(allow_non_fake_inputs=True)


# --- a model someone else wrote, run by tfcli ---------------------------------------------------


class RunFailed(TfcliError):
    """The model's own code raised (or exited) while tfcli ran it: the input was fine, the run
    failed (exit 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=1)


class ModelExited(RuntimeError):
    """The model's forward pass called ``sys.exit()`` or ``os._exit()``, or raised what is not
    an Exception (GeneratorExit, a BaseException of its own, a KeyboardInterrupt that no signal
    sent). Left as it was it would end tfcli silently with the model's exit code, as a
    traceback, or as Ctrl-C; as an ordinary error it is reported like any other."""


def exit_call(exit_: SystemExit) -> str:
    """How the code that raised ``exit_`` called it: ``sys.exit(5)``, ``sys.exit()``,
    ``os._exit(3)``."""
    if isinstance(exit_, OsExitCalled):
        return f"os._exit({exit_.code!r:.100})"
    return "sys.exit()" if exit_.code is None else f"sys.exit({exit_.code!r:.100})"


def model_ending(error: BaseException) -> str | None:
    """What the model did, in words, when its code ended with ``error`` where an Exception was
    expected: "called os._exit(3)", "raised GeneratorExit: bye". None for Ctrl-C or SIGTERM
    reaching tfcli (a KeyboardInterrupt a signal sent), which must stop the command as usual."""
    if isinstance(error, SystemExit):
        return f"called {exit_call(error)}"
    if isinstance(error, KeyboardInterrupt):
        if signal_came():
            return None
        return "raised KeyboardInterrupt itself (no Ctrl-C or signal came)"
    return f"raised {error_text(error)}"


def error_text(error: BaseException, limit: int = 300, whole: bool = False) -> str:
    """``Type: message`` on one line: the message's first line, or with ``whole`` all its
    lines joined (for libraries that put the reason on the lines after a heading)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines) if whole else (lines[0] if lines else "")
    if len(text) > limit:
        text = text[:limit - 1] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _shape_text(t) -> list[int] | str | None:
    """A tensor's shape for a message; a nested tensor (nn.Transformer's fast path) has none."""
    if not isinstance(t, Tensor):
        return None
    return "nested" if t.is_nested else list(t.shape)


# Integer tensors torch.arange made on fake or meta tensors, whose values are known where no
# other tensor's are: id -> (the tensor, weakly; its largest value). See positions_known.
_ARANGED: dict[int, tuple] = {}
_ARANGE = {"depth": 0, "original": None}
_ARANGE_LOCK = threading.Lock()  # models may run in several threads at once


def _arange_bounds(args: tuple, kwargs: dict, out: Tensor) -> int | None:
    """The largest value of ``torch.arange(*args, **kwargs)`` (``out``), where its start and
    step are plain numbers."""
    given = dict(zip(("start", "end", "step") if len(args) > 1 else ("end",), args))
    given.update(kwargs)
    start, step = given.get("start", 0), given.get("step", 1)
    if not all(isinstance(x, (int, float)) for x in (start, step)):
        return None
    return int(max(start, start + (out.numel() - 1) * step))


@contextlib.contextmanager
def positions_known():
    """On fake and meta tensors an index has no value, so an nn.Embedding read beyond its
    rows (a learned position table of 64 rows given 128 positions) would run where torch
    raises "index out of range in self". The positions a model makes with torch.arange are
    the exception, their values known from its arguments: while a model runs, torch.arange's
    integer outputs on fake or meta tensors are remembered with their largest value, and
    running()'s hooks check each nn.Embedding's index (or the tensor it is a view of)."""
    import weakref

    with _ARANGE_LOCK:
        if _ARANGE["depth"] == 0:
            original = _ARANGE["original"] = torch.arange

            def arange(*args, **kwargs):
                out = original(*args, **kwargs)
                if isinstance(out, Tensor) and out.numel() and not out.is_floating_point() \
                        and (out.is_meta or type(out).__name__ == "FakeTensor"):
                    top = _arange_bounds(args, kwargs, out)
                    if top is not None:
                        _ARANGED[id(out)] = (weakref.ref(out), top)
                return out

            torch.arange = arange
        _ARANGE["depth"] += 1
    try:
        yield
    finally:
        with _ARANGE_LOCK:
            _ARANGE["depth"] -= 1
            if _ARANGE["depth"] == 0:
                torch.arange = _ARANGE["original"]
                _ARANGED.clear()


def check_rows(module: nn.Embedding, index) -> None:
    """Raise as torch does for an index of known values beyond ``module``'s rows."""
    if not isinstance(index, Tensor):
        return
    base = index if index._base is None else index._base
    known = _ARANGED.get(id(base))
    if known is not None and known[0]() is base and known[1] >= module.num_embeddings:
        raise IndexError(f"index out of range in self (torch.arange's positions up to "
                         f"{known[1]:,} into {module.num_embeddings:,} rows; torch raises this "
                         f"on real tensors, which fake tensors would not)")


@contextlib.contextmanager
def running(model: nn.Module, what: str = "forward pass", during: str = ""):
    """Run ``model`` inside this block as tfcli runs code it did not write: an exception of
    the model's own becomes :class:`RunFailed`, one line naming the module call under way and
    its input shapes, as ``shapes`` reports a failed forward pass; so does what would end
    tfcli (model_ending). tfcli's own errors, running out of memory and Ctrl-C pass through
    unchanged. Hooks are removed in ``finally``."""
    names = {id(m): path for path, m in model.named_modules()}
    calls: list[str] = []  # the module calls under way, innermost last

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        shapes = [_shape_text(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, Tensor) or t is None]
        calls.append(f"{names.get(id(module)) or '(model)'} ({type(module).__name__}) with "
                     f"inputs {', '.join(str(s) for s in shapes)}")
        if isinstance(module, nn.Embedding):
            check_rows(module, args[0] if args else kwargs.get("input"))

    def leave(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        calls.pop()  # returns None: a hook's value would replace the output

    handles = [h for m in model.modules() for h in (
        m.register_forward_pre_hook(enter, with_kwargs=True),
        m.register_forward_hook(leave, with_kwargs=True))]
    try:
        with model_code(f"in its {what}"), positions_known():
            yield
    except (TfcliError, MemoryError, torch.OutOfMemoryError):
        raise
    except BaseException as error:
        if not isinstance(error, Exception):  # its backward pass (a forward pass: Inputs.call)
            ending = model_ending(error)
            if ending is None:
                raise
            error = ModelExited(f"the model {ending}")
        where = f" in {calls[-1]}" if calls else f" in (model) ({type(model).__name__})"
        fake = type(error).__module__.startswith(("torch._subclasses", "torch.fx"))
        hint = "; the replay runs the model on fake tensors, which hold no values" if fake else ""
        raise RunFailed(f"{what} failed{where}: {error_text(error)}"
                        + (f" ({during})" if during else "") + hint) from error
    finally:
        for handle in handles:
            handle.remove()


def backward(loss: Tensor, model: nn.Module) -> None:
    """``loss.backward()`` of a training step tfcli replays; refused in one line where the
    loss needs no gradient (the model has no trainable parameter, or none reaches its
    output), where torch's own backward would raise: such a model has no training step."""
    if not loss.requires_grad:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        why = (f"none of its {trainable:,} trainable parameter elements reaches it"
               if trainable else "the model has no trainable parameters")
        raise TfcliError(f"the model's loss needs no gradient ({why}): a training step has "
                         f"no backward pass to size; --inference sizes its forward")
    loss.backward()


@contextlib.contextmanager
def building(device, dtype: torch.dtype | None):
    """Where a model someone else wrote is constructed: on ``device``, with ``dtype`` as the
    default dtype, and their library's advice to the model's author (warnings) kept quiet.
    On meta and under fake tensors its initialisers leave the weights alone
    (fake_initialisers)."""
    previous = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        with torch.device(device), warnings.catch_warnings(), model_code("while it was built"), \
                fake_initialisers(str(device) == "meta"):
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_default_dtype(previous)


def fake_mode_active() -> bool:
    """Whether tensors made now are fake (torch's FakeTensorMode is on the dispatch stack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def fake_initialisers(on_meta: bool = False):
    """Under fake tensors (and, with ``on_meta``, for a build on meta), torch.nn.init's
    initialisers return a fake or meta tensor unchanged: there is no value to set, and some
    read values (trunc_normal_ draws again until every value lies within its bounds), which a
    fake tensor cannot give. On meta they only cost time: torch runs their decompositions,
    about two thirds of building a deep Transformers model there. Elsewhere nothing
    changes."""
    if not (on_meta or fake_mode_active()):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import is_fake

    from tfcli.model.transformer import initialisers_skipping

    return initialisers_skipping(
        lambda tensor: is_fake(tensor) or getattr(tensor, "is_meta", False))


def embedding_limit(model: nn.Module) -> int:
    """Token ids must stay below the smallest embedding table (2 when there is none)."""
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    return min(sizes) if sizes else 2
