"""The options every command shares, and how their values are read: which model (--preset,
--config, --set, --model …) and the rules of which goes with which, the sizes of its
dimensions (--batch-size, --dim, …), integer lists, path options that refuse the empty
string, and the command class that applies what is declared about each option
(``tfcli.cli.rules``)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from tfcli.cli.rules import Needs, Rule, Rules, any_model
from tfcli.errors import TfcliError

# typer >= 0.29 vendors click; its names are not re-exported at the top level.
from typer._click.core import ParameterSource
from typer._click.globals import get_current_context


def _preset_names() -> list[str]:
    from tfcli.model.presets import PRESETS

    return list(PRESETS)


PresetOpt = Annotated[Optional[str], typer.Option(
    "--preset", "-p", metavar="NAME", autocompletion=_preset_names, show_default=False,
    help="Named preset (see `tfcli presets`). Default: vaswani-base.")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", metavar="FILE", show_default=False,
    help="TOML or JSON file of flat key = value overrides, applied after the preset.")]
SetOpt = Annotated[Optional[list[str]], typer.Option(
    "--set", "-s", metavar="KEY=VALUE", show_default=False,
    help="Override one field, e.g. --set d_model=256 (repeatable; applied last).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout.")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="FILE.py:NAME|module:NAME|hf:PATH|hf:ORG/NAME[@REV]",
    show_default=False,
    help="Inspect a model tfcli did not build: NAME is an nn.Module subclass or a callable "
         "returning a module or (module, example_inputs); importing FILE runs its code (your "
         "explicit opt-in; nothing else is executed). hf:PATH builds the Transformers model "
         "for a config.json (or a directory holding one) from the config alone, random "
         "weights; hf:ORG/NAME (or hf:ORG/NAME@REVISION) takes a Hub model's config.json "
         "from the local Hugging Face cache, downloading that one file when it is absent "
         "unless HF_HUB_OFFLINE is set. No weights, no remote code.")]
ModelArgOpt = Annotated[Optional[list[str]], typer.Option(
    "--model-arg", metavar="KEY=VALUE", show_default=False,
    help="Keyword argument for --model's callable, read as a Python literal (else a string); "
         "repeatable.")]
HfClassOpt = Annotated[Optional[str], typer.Option(
    "--hf-class", metavar="CLASS", show_default=False,
    help="Transformers model class for --model hf:PATH (default: the config's architectures, "
         "else the causal-LM, seq2seq-LM or base class).")]
class AttnImplementation(str, Enum):
    auto = "auto"
    sdpa = "sdpa"
    eager = "eager"


AttnImplOpt = Annotated[AttnImplementation, typer.Option(
    "--attn-implementation", metavar="auto|sdpa|eager", show_default=False,
    help="Attention a --model hf:PATH model runs: sdpa (torch's scaled_dot_product_attention) "
         "or eager (the model's own softmax(QKᵀ)V). Default auto: what the config.json asks "
         "for if eager, else sdpa where Transformers has it for the class, else eager; the "
         "one that ran is named in the output and in --json.")]
InputOpt = Annotated[Optional[list[str]], typer.Option(
    "--input", "-i", metavar="NAME=DTYPE[DIMS]", show_default=False,
    help="An input of --model's forward, e.g. src=int64[B,S] or x=float32[B,L,512]; integer "
         "ids are drawn below the smallest embedding table unless it ends in <N. Repeatable.")]
DimOpt = Annotated[Optional[list[str]], typer.Option(
    "--dim", metavar="NAME=SIZE", show_default=False,
    help="Size of a dimension letter used by --input, e.g. --dim S=128 (repeatable).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", metavar="SIZE", show_default=False,
    help="Memory a real run may use, e.g. 8GiB (default: what is available: MemAvailable, "
         "the cgroup limit, RLIMIT_AS, CUDA free memory). A run estimated above it is refused.")]


def _hf(v) -> bool:
    return v.model_ref is not None and v.model_ref.startswith("hf:")


_OWN_TAKES = "applies to --model; tfcli's own model takes --preset/--config/--set"

# Which model the options name (--model, or tfcli's own configuration) and what each kind of
# --model takes: first in the table of every command that takes a model.
# (tfcli.subjects.resolve_subject checks the same of a library call, where nothing is typed.)
SUBJECT_RULES = Rules(
    Rule(("preset", "config", "set_"), Needs(
        lambda v: v.model_ref is None, "not with --model",
        "--model with {option}: those configure tfcli's own model; give one or the other")),
    Rule("attn_implementation", Needs(
        lambda v: v.model_ref is not None, "only with --model hf:PATH",
        "applies to --model hf:PATH; tfcli's own model chooses with --set attention=naive|sdpa"),
         Needs(_hf, "only with --model hf:PATH", "applies to --model hf:PATH")),
    Rule("model_arg", any_model(_OWN_TAKES), Needs(
        lambda v: not _hf(v), "not with --model hf:",
        "applies to --model FILE.py:NAME; a Hugging Face config is configured by its "
        "config.json")),
    Rule("hf_class", Needs(lambda v: v.model_ref is not None, "only with --model hf:PATH",
                           _OWN_TAKES),
         Needs(_hf, "only with --model hf:PATH", "applies to --model hf:PATH")),
    Rule("input_", any_model(_OWN_TAKES)),
)


def resolve_config(preset: str | None, config: Path | None, overrides: list[str] | None):
    from tfcli.model.config import load_config

    return load_config(preset, config, overrides or [])


def resolve_subject(preset, config, overrides, model, model_args, hf_class, inputs,
                    attn_implementation=AttnImplementation.auto):
    from tfcli.subjects import resolve_subject as resolve

    return resolve(preset, config, overrides, model, model_args, hf_class, inputs,
                   AttnImplementation(attn_implementation).value)



MAX_SIZE = 2**31 - 1


def sizes(subject, batch: int, src_len: int, tgt_len: int, dims: list[str] | None,
          length: int | None = None) -> dict[str, int]:
    """The size of every letter: B, S, T (and L) from the usual options, --dim over them."""
    from tfcli.subjects.base import parse_dim

    out = {**subject.default_sizes, "B": batch, "S": src_len, "T": tgt_len,
           "L": length if length is not None else src_len}
    options = ({"B": "--batch-size", "S": "--seq-len", "T": "--seq-len", "L": "--seq-len"}
               if length is not None else
               {"B": "--batch-size", "S": "--src-len", "T": "--tgt-len", "L": "--src-len"})
    for letter, option in options.items():
        if out[letter] > MAX_SIZE:  # beyond it, index arithmetic overflows even on meta
            raise TfcliError(f"{option} {out[letter]}: at most {MAX_SIZE:,}")
    used = subject.dims_used()
    seen: dict[str, str] = {}
    for text in dims or []:
        name, value = parse_dim(text)
        if name in seen:
            raise TfcliError(f"--dim {seen[name]} and --dim {text}: {name} is given twice; "
                             f"give it once")
        if name not in used:
            raise TfcliError(f"--dim {text}: no input of this model has a dimension {name} "
                             f"(its inputs use {', '.join(used)})")
        seen[name] = text
        out[name] = value
    for name, (size, why) in subject.fixed_dims().items():
        if name in seen and out[name] != size:
            raise TfcliError(f"--dim {seen[name]}: {why}; {name} can only be {size}")
    return out


def given(name: str) -> bool:
    """Whether the option with parameter ``name`` was typed on the command line: a default
    cannot be told from the same value given. Outside a command (a direct call) nothing was."""
    ctx = get_current_context(silent=True)
    source = ctx.get_parameter_source(name) if ctx is not None else None
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT,
                      ParameterSource.PROMPT)



# The letters each size option sets; L (an input's one length) follows --src-len.
SIZE_LETTERS = {"--batch-size": ("B",), "--src-len": ("S", "L"), "--tgt-len": ("T",)}


def refuse_unused_sizes(subject, options: dict[str, int], dims: list[str] | None) -> None:
    """Refuse a size option that was given (``options``: option -> value) but sets no letter
    the model's inputs use, or only letters --dim sets instead."""
    from tfcli.subjects.base import parse_dim

    by_dim = {parse_dim(text)[0]: text for text in dims or []}
    used = subject.dims_used()
    for option, value in options.items():
        letters = [d for d in SIZE_LETTERS[option] if d in used]
        if not letters:
            raise TfcliError(f"{option} {value}: {_no_such_dimension(subject, option, used)}")
        if all(d in by_dim for d in letters):
            raise TfcliError(f"{option} {value} and --dim {by_dim[letters[0]]}: both set "
                             f"{'/'.join(letters)}; give one")


def _no_such_dimension(subject, option: str, used: list[str]) -> str:
    cfg = getattr(subject, "cfg", None)
    if cfg is not None:  # tfcli's own: S is the encoder's length, T the decoder's
        side, other = ("source", "--tgt-len") if option == "--src-len" else ("target", "--src-len")
        return f"this {cfg.kind} model has no {side} sequence; its length is {other}"
    letters = " or ".join(SIZE_LETTERS[option])
    if subject.kind == "hf" and used == ["B", "L"]:
        return (f"{subject.label} is decoder-only: its one length L is --src-len "
                f"(or --dim L=N)")
    if not used and not getattr(subject, "input_specs", None):
        return (f"no --input names the dimensions of {subject.label}'s inputs, so it sizes "
                f"nothing (example inputs its callable returns keep their sizes); describe them, "
                f"e.g. --input NAME=DTYPE[B,{SIZE_LETTERS[option][0].replace('B', 'S')}]")
    return (f"the inputs of {subject.label} have no {letters} dimension (they use "
            f"{', '.join(used) or 'literal sizes only'})")


def max_seq_len_hint(length: int) -> str:
    """How to make room for ``length`` positions: a --set that is allowed, or why none is."""
    from tfcli.model.config import LIMITS

    bound = LIMITS["max_seq_len"]
    if length <= bound:
        return f"raise it with --set max_seq_len={length}"
    return f"that is beyond what max_seq_len allows (at most {bound:,})"


def int_list(text: str, option: str, example: str, minimum: int = 0) -> list[int]:
    """Parse "5,3" for options that take integers per sequence or per length."""
    parts = text.replace(" ", "").split(",")
    # ASCII digits only: int() also takes "６４" and "6_4", which no one means as a length
    if all(part.isascii() and part.isdigit() for part in parts):
        longest = max(parts, key=len)
        if len(longest) > 40:  # int() refuses more than 4,300 digits; no size has 40
            raise TfcliError(f"{option} {text[:60]!r}…: a {len(longest)}-digit number is beyond "
                             f"any size")
        values = [int(part) for part in parts]
    else:
        values = []
    if not values or any(v < minimum for v in values):
        kind = "positive integers" if minimum > 0 else "non-negative integers"
        raise TfcliError(f"{option} {text!r}: expected {kind}, e.g. {option} {example}")
    return values



def refuse_empty_paths(params: list) -> list:
    """typer reads an empty path option (``--csv ""``, ``--profile ""``, ``--config ""``) as
    ``Path("")``, which is ``Path(".")``: the current directory, so the emptiness is lost
    before any check sees it, and ``--profile ""`` would write into the current directory.
    Each option annotated as a path refuses the empty string before typer converts it.
    For a command's ``get_params``."""
    for param in params:
        if getattr(getattr(param, "type_descriptor", None), "annotation", None) is not Path \
                or getattr(param, "_refuses_empty", False):
            continue

        def process(ctx, value, convert=param.process_value, option=param.opts[0]):
            if isinstance(value, str) and value == "":
                raise TfcliError(f"{option} '': an empty path; give a "
                                 f"{'directory' if option == '--profile' else 'file'} name")
            return convert(ctx, value)

        param.process_value = process
        param._refuses_empty = True
    return params


def flags_take_no_value(params: list) -> list:
    """typer 0.29 shows "<bool>" beside every flag, which reads as if `--expand true` were
    expected (it is refused): a flag's metavar is empty."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class TfcliCommand(TyperCommand):
    """A command whose options refuse an empty path, show flags without a value, and state in
    ``--help`` when they mean something (the command's ``rules`` table, ``tfcli.cli.rules``)."""

    def get_params(self, ctx):
        from tfcli.cli.rules import help_with_conditions

        function = getattr(self.callback, "__wrapped__", self.callback)
        params = refuse_empty_paths(super().get_params(ctx))
        return flags_take_no_value(help_with_conditions(params, getattr(function, "rules", None)))

