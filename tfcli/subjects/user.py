"""The user's own ``nn.Module`` as a Subject: ``--model FILE.py:NAME`` or ``package.module:NAME``.

NAME is an ``nn.Module`` subclass or a callable returning a module, or ``(module, inputs)``
with inputs a dict of keyword arguments or a tuple of positional ones. Importing the file runs
the user's code — that is the explicit opt-in; nothing else is imported or executed, values of
``--model-arg`` are Python literals read with ``ast.literal_eval`` and no pickle is loaded.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import importlib.util
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from torch import nn

from tfcli.errors import TfcliError, did_you_mean
from tfcli.subjects.base import (InputSpec, Inputs, RunFailed, Subject, building,
                                 check_inputs_fit, embedding_limit, error_text, make_tensors,
                                 model_code, model_ending, running, signature_text)


def parse_model_args(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; a value is a Python literal if it reads as one, else a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise TfcliError(f"--model-arg {item!r}: expected KEY=VALUE with KEY a Python "
                             f"identifier, e.g. --model-arg d_model=256")
        if key.strip() in out:
            raise TfcliError(f"--model-arg {key.strip()} is given twice; give it once")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            out[key.strip()] = value
    return out


_TFCLI = str(Path(__file__).resolve().parent.parent) + os.sep  # the package's own files


def _where(error: BaseException, near: str | None = None) -> str:
    """file:line of the frame that raised, preferring frames in the user's file, else frames
    outside tfcli (os._exit's stand-in raises in tfcli's code, for the model)."""
    frames = traceback.extract_tb(error.__traceback__)
    if near:
        mine = [f for f in frames if Path(f.filename).resolve() == Path(near).resolve()]
        if mine:  # named as the user gave it (the module is loaded by its absolute path)
            return f" ({near}:{mine[-1].lineno})"
    frames = [f for f in frames if not f.filename.startswith(_TFCLI)] or frames
    if not frames:
        return ""
    return f" ({frames[-1].filename}:{frames[-1].lineno})"


class _Siblings:
    """Modules lying in the model's folder, found for the model's own code only: the module
    ``--model`` names, and an import the model's code makes (going out from the import, a frame
    of a file in that folder comes before any of tfcli's: the model's module importing its
    neighbours, its forward importing one late, its build function unpickling a class of
    theirs). Asked last, after the standard library and installed packages, as `python FILE.py`
    would find them, but never for tfcli or torch importing on their own account: a json.py
    shadows nothing, and a triton.py lying beside the model is not what torch's probe for the
    triton package finds, even while the model's forward runs under tfcli's dispatch modes.
    (On ``sys.path`` the folder served every import in the process.)"""

    _installed: dict[str, "_Siblings"] = {}

    def __init__(self, folder: str) -> None:
        self.folder, self.prefix = folder, folder.rstrip(os.sep) + os.sep
        self.named: set[str] = set()

    @classmethod
    def serve(cls, folder: str, named: set[str] = frozenset()) -> None:
        finder = cls._installed.get(folder)
        if finder is None or finder not in sys.meta_path:
            finder = cls._installed[folder] = cls(folder)
            sys.meta_path.append(finder)
        finder.named |= set(named)

    def find_spec(self, fullname: str, path=None, target=None):
        if path is not None:  # a submodule: found through its package's __path__
            return None
        if fullname not in self.named and not self._from_model():
            return None
        from importlib.machinery import PathFinder

        return PathFinder.find_spec(fullname, [self.folder])

    def _from_model(self) -> bool:
        """Whether the model's code asked: going out from the import, a frame of the model's
        folder comes before any of tfcli's (torch importing within tfcli's dispatch modes or
        hooks, while the model's forward runs further out, is on tfcli's account)."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith("<"):
                if os.path.abspath(name).startswith(self.prefix):
                    return True
                if name.startswith(_TFCLI):
                    return False
            frame = frame.f_back
        return False


def import_object(ref: str):
    """Resolve ``file.py:NAME`` or ``package.module:NAME`` (NAME may be dotted)."""
    module_part, sep, attr = ref.rpartition(":")
    if not sep or not module_part or not re.fullmatch(r"[A-Za-z_][\w.]*", attr):
        raise TfcliError(f"--model {ref!r}: expected FILE.py:NAME or package.module:NAME, "
                         f"e.g. --model my_model.py:build")
    path = None
    if module_part.endswith(".py") or "/" in module_part or "\\" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise TfcliError(f"--model {ref!r}: no such file {module_part!r}")
        name = f"tfcli_user_{path.stem}"
        # by its absolute path: its frames say which folder they are from, whatever directory
        # the model moves to (the sibling finder below tells the model's code by them)
        spec = importlib.util.spec_from_file_location(name, path.resolve())
        if spec is None or spec.loader is None:
            raise TfcliError(f"--model {ref!r}: {module_part!r} cannot be imported as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickle-free typing need it registered
        _Siblings.serve(str(path.resolve().parent))
        try:
            with model_code(f"while {module_part} was imported"):
                spec.loader.exec_module(module)
        except Exception as error:
            sys.modules.pop(name, None)
            raise TfcliError(f"--model {ref!r}: importing {module_part} raised "
                             f"{error_text(error)}{_where(error, str(path))}") from None
        except BaseException as error:
            sys.modules.pop(name, None)
            raise _ended(ref, f"while {module_part} was imported", error, str(path)) from None
    else:
        # as `python -m`, the named package from the current directory (where it is not
        # installed), and its neighbours there for the model's own code
        _Siblings.serve(os.getcwd(), named={module_part.split(".")[0]})
        try:
            with model_code(f"while {module_part} was imported"):
                module = importlib.import_module(module_part)
        except ModuleNotFoundError as error:
            raise TfcliError(f"--model {ref!r}: no module named {error.name!r}") from None
        except Exception as error:
            raise TfcliError(f"--model {ref!r}: importing {module_part} raised "
                             f"{error_text(error)}{_where(error)}") from None
        except BaseException as error:
            raise _ended(ref, f"while {module_part} was imported", error) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = sorted(n for n, v in vars(module).items() if not n.startswith("_") and (
                (isinstance(v, type) and issubclass(v, nn.Module)) or
                (callable(v) and getattr(v, "__module__", None) == module.__name__)))
            hint = f"; it defines {', '.join(found[:8])}" if found else ""
            raise TfcliError(f"--model {ref!r}: {module_part} has no {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TfcliError(f"--model {ref!r}: {attr} is a {type(obj).__name__}, not an nn.Module "
                         f"subclass or a callable returning one")
    return obj, (str(path) if path else None)


class UserSubject(Subject):
    kind = "module"

    def __init__(self, ref: str, model_args: dict[str, Any] | None = None,
                 input_specs: list[InputSpec] | None = None) -> None:
        self.ref = ref
        self.label = ref
        self.model_args = model_args or {}
        self.input_specs = input_specs or []
        self._factory, self._file = import_object(ref)
        self._given: Inputs | None = None  # inputs the factory returned with the model

    def build(self, device="meta", dtype=None, kernel=None) -> nn.Module:
        self._check_arguments()
        try:
            with building(device, dtype):
                result = self._factory(**self.model_args)
        except TfcliError:
            raise
        except Exception as error:
            raise self._build_failed(error, device) from None
        except BaseException as error:
            raise _ended(self.ref, "while it was built", error, self._file) from None
        model, given = result, None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
            model, given = result
            if isinstance(given, dict):
                given = Inputs((), dict(given))
            elif isinstance(given, (tuple, list)):
                given = Inputs(tuple(given), {})
            else:
                raise TfcliError(f"--model {self.ref}: the example inputs it returned are a "
                                 f"{type(given).__name__}; return a dict of keyword arguments "
                                 f"or a tuple of positional ones")
        if not isinstance(model, nn.Module):
            raise TfcliError(f"--model {self.ref}: it returned {type(result).__name__}, not an "
                             f"nn.Module or (module, example_inputs)")
        if type(model).forward is nn.Module.forward:
            raise TfcliError(f"--model {self.ref}: {type(model).__name__} defines no forward() "
                             f"(nn.Module's own only raises NotImplementedError); define "
                             f"forward(self, ...) in it")
        check_module_tree(model, f"--model {self.ref}")
        self._initialise_lazy(model, given, device, dtype)
        if str(device) != "meta":
            _materialise(model, device)
        self._given = given
        return model

    def _initialise_lazy(self, model: nn.Module, given: Inputs | None, device, dtype) -> None:
        """Lazy modules (nn.LazyLinear, ...) make their parameters in the model's first
        forward, from the shapes it is given: that forward is run here on the example inputs
        the factory returned (as torch advises, "a dummy batch"); without them the counts
        cannot be known, and that is said in one line."""
        from torch.nn.modules.lazy import LazyModuleMixin

        lazy = [(path or "(model)", type(m).__name__) for path, m in model.named_modules()
                if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]
        if not lazy:
            return
        if given is None:
            raise TfcliError(
                f"--model {self.ref}: {lazy[0][0]} ({lazy[0][1]}) is a lazy module, whose "
                f"parameters the model's first forward makes from the shapes it is given; "
                f"return (model, example_inputs) from the factory (tfcli runs that forward on "
                f"them), or call the model once in it")
        import torch

        with building(device, dtype), torch.no_grad(), \
                running(model, "first forward pass (it makes the lazy modules' parameters)"):
            given(model)

    def _signature(self) -> inspect.Signature | None:
        try:
            return inspect.signature(self._factory)
        except (TypeError, ValueError):  # some builtins and C extensions have none
            return None

    def _takes(self) -> str:
        """``Linear(in_features: int, ...)``: what NAME takes, for a message."""
        sig = self._signature()
        name = getattr(self._factory, "__name__", self.ref.rpartition(":")[2])
        text = (f"{name}{sig.replace(return_annotation=inspect.Signature.empty)}"
                if sig is not None else f"{name}(...)")
        return text if len(text) <= 200 else text[:197] + "..."

    def _check_arguments(self) -> None:
        """--model-arg values that do not fit NAME's signature are bad input, said before
        anything runs: which parameters are missing or unknown, and how to give them."""
        sig = self._signature()
        if sig is None:
            return
        try:
            sig.bind(**self.model_args)
            return
        except TypeError:
            pass
        kind = inspect.Parameter
        params = sig.parameters
        if not any(p.kind is kind.VAR_KEYWORD for p in params.values()):
            for key in self.model_args:
                if key not in params or params[key].kind is kind.POSITIONAL_ONLY:
                    choices = [n for n, p in params.items()
                               if p.kind in (kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY)]
                    raise TfcliError(f"--model-arg {key}: {self.ref} takes no parameter "
                                     f"{key!r}{did_you_mean(key, choices)}; it is "
                                     f"{self._takes()}")
        required = [n for n, p in params.items() if p.default is kind.empty
                    and p.kind not in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD)
                    and n not in self.model_args]
        if any(params[n].kind is kind.POSITIONAL_ONLY for n in required):
            raise TfcliError(f"--model {self.ref}: {self._takes()} needs positional-only "
                             f"arguments, which --model-arg (keywords) cannot give; wrap it in "
                             f"a function of keyword arguments")
        if required:
            raise TfcliError(f"--model {self.ref}: give {', '.join(required)} with --model-arg "
                             f"NAME=VALUE (e.g. --model-arg {required[0]}=VALUE); it is "
                             f"{self._takes()}")

    def _build_failed(self, error: Exception, device) -> TfcliError:
        """Why NAME(**model_args) raised, and what to change: the device, the --model-arg
        values (exit 2), or nothing tfcli can say: the model's own code failed (exit 1)."""
        where = _where(error, self._file)
        own_frames = [f for f in traceback.extract_tb(error.__traceback__)
                      if Path(f.filename).resolve() != Path(__file__).resolve()]
        if str(device) == "meta" and "meta" in str(error):
            return TfcliError(f"--model {self.ref}: building it on the meta device raised "
                              f"{error_text(error)}{where}; build it for real (shapes: "
                              f"--device cpu, params: --build-on cpu)")
        if "UninitializedParameter" in str(error) and "FakeTensor" in str(error):
            return TfcliError(f"--model {self.ref}: its lazy modules (nn.LazyLinear, ...) "
                              f"cannot be built on fake tensors, on which tfcli replays a "
                              f"step (torch makes their UninitializedParameter from a real "
                              f"tensor){where}; give them their input sizes (nn.Linear(IN, "
                              f"OUT)) to size a step; counts and shapes work as they are")
        if isinstance(error, TypeError) and not own_frames:  # the call itself did not bind
            return TfcliError(f"--model {self.ref}: calling it raised {error_text(error)}; "
                              f"give its arguments with --model-arg NAME=VALUE")
        if self.model_args and isinstance(error, (TypeError, ValueError)):
            given = ", ".join(f"{k}={v!r:.40}" for k, v in self.model_args.items())
            return TfcliError(f"--model {self.ref}: calling it with {given} raised "
                              f"{error_text(error)}{where}; check the --model-arg values: it "
                              f"is {self._takes()}")
        return RunFailed(f"--model {self.ref}: building it failed: {error_text(error)}{where}")

    def make_inputs(self, model, sizes, device="meta", seed=0) -> Inputs:
        if self.input_specs:
            check_inputs_fit(model, [s.name for s in self.input_specs])
            return Inputs((), make_tensors(self.input_specs, sizes, device,
                                           embedding_limit(model), seed))
        if self._given is not None:
            return self._given.to(device)
        raise TfcliError(f"--model {self.ref}: say what to feed it with --input NAME=DTYPE[DIMS] "
                         f"(e.g. --input src=int64[B,S]); it is {signature_text(model)}")

    def length_dims(self) -> list[str]:
        letters = [d for s in self.input_specs for d in s.dims if d in ("S", "T", "L")]
        return list(dict.fromkeys(letters))

    def dims_used(self) -> list[str]:
        letters = [d for s in self.input_specs for d in s.dims if isinstance(d, str)]
        return list(dict.fromkeys(letters))

    def describe(self) -> dict:
        return {**super().describe(), "model_args": {k: repr(v) for k, v in
                                                     self.model_args.items()},
                "inputs": [f"{s.name}={s.dtype}[{','.join(map(str, s.dims))}]"
                           for s in self.input_specs]}


def _ended(ref: str, when: str, error: BaseException, near: str | None = None) -> RunFailed:
    """The model's code ended with what is not an Exception (sys.exit, os._exit, a
    BaseException, a KeyboardInterrupt of its own): a failed run, said in one line. Ctrl-C or
    SIGTERM meanwhile is raised on, to stop tfcli as usual."""
    what = model_ending(error)
    if what is None:
        raise error
    return RunFailed(f"--model {ref}: the model {what} {when}{_where(error, near)}; tfcli "
                     f"reports it as a failed run")


# torch walks a model's modules by recursion (.to(), .eval(), apply, state_dict, named_modules),
# as does the forward pass of nested modules (about four Python frames a level); tfcli's own
# calls take some 200 of Python's 1,000. 100 levels leave room for all of it; real models nest
# a dozen or two.
MAX_DEPTH = 100


def check_module_tree(model: nn.Module, who: str) -> None:
    """Refuse, in one line, a module tree that recursion over it cannot walk: a cycle (a
    module that holds itself, or one of the modules holding it) never ends, and one nested
    deeper than MAX_DEPTH levels exceeds Python's recursion limit. The walk here does not
    recurse, and a module shared by several parents (tied) is walked once."""
    levels: dict[int, int] = {}  # id -> levels from it down, once its subtree is walked
    open_paths = {id(model): ""}  # the modules whose subtrees are being walked
    stack = [(model, "", model.named_children())]
    while stack:
        module, path, children = stack[-1]
        for name, child in children:
            where = f"{path}.{name}" if path else name
            if id(child) in open_paths:
                ancestor = open_paths[id(child)] or "(model)"
                raise TfcliError(f"{who}: the model's module tree has a cycle through "
                                 f"{where!r}, which is {ancestor} ({type(child).__name__}) "
                                 f"again, one of the modules holding it; tfcli walks modules "
                                 f"as a tree and cannot walk a cycle")
            if id(child) not in levels:
                open_paths[id(child)] = where
                stack.append((child, where, child.named_children()))
                break
        else:
            stack.pop()
            del open_paths[id(module)]
            levels[id(module)] = 1 + max((levels[id(c)] for c in module.children()), default=0)
    if levels[id(model)] > MAX_DEPTH:
        raise TfcliError(f"{who}: the model's modules are nested {levels[id(model)]:,} levels "
                         f"deep, beyond the {MAX_DEPTH} levels tfcli walks (torch walks them "
                         f"by recursion, within Python's recursion limit)")


def _materialise(model: nn.Module, device) -> None:
    """Parameters a factory created on meta itself get real storage and their module's own
    initialisation, so the model can run."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    model.to_empty(device=device)
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
