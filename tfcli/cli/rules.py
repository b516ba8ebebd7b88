"""Which option means something when, declared once per command and applied by one function.

A command's table says, for each of its options, the conditions under which the option means
something, and for each condition the refusal when it does not hold::

    RULES = Rules(
        Rule("kv_dtype", Needs(lambda v: v.inference, "only with --inference",
                               "{option} applies to --inference")),
        ...)

``RULES.apply(locals())``, the first line of the command, refuses the first option the user
typed whose condition fails, in one line and before any model is imported or built. An option
that was not typed (its default) is never refused. ``--help`` shows each option's conditions
after its own help (``TfcliCommand`` reads the table). Checks that need the model itself (a
length beyond its ``max_seq_len``, a side it does not have) are made where the model is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tfcli.errors import TfcliError


class Values:
    """A command's parameter values as attributes (``v.seq_len``), the derived values its
    table declares, and which options were typed on the command line."""

    def __init__(self, values: dict[str, Any], derived: dict[str, Callable]) -> None:
        self.__dict__.update(values)
        for name, compute in derived.items():
            setattr(self, name, compute(self))

    @staticmethod
    def typed(name: str) -> bool:
        from tfcli.cli.options import given

        return given(name)


@dataclass(frozen=True)
class Needs:
    """A condition under which an option means something: ``holds(v)``; ``shown`` is how
    ``--help`` states it ("only with --seq-len", "not with --json"); ``refusal`` is the line when it fails. The refusal may name
    ``{option}`` (the option as typed, several joined by commas), ``{value}`` (its value),
    ``{it}`` ("it" or "them") and any attribute of ``v`` as ``{v.NAME}``; without ``{option}``
    the line starts with the option."""

    holds: Callable[[Values], bool]
    shown: str
    refusal: str


def own_model(refusal: str) -> Needs:
    """Means something for tfcli's own configuration only, not with --model."""
    return Needs(lambda v: v.model_ref is None, "not with --model", refusal)


def any_model(refusal: str) -> Needs:
    """Means something with --model only."""
    return Needs(lambda v: v.model_ref is not None, "only with --model", refusal)


@dataclass(frozen=True)
class Rule:
    """The conditions of one option (a parameter name), or of several refused together."""

    names: str | tuple[str, ...]
    needs: tuple[Needs, ...]

    def __init__(self, names: str | tuple[str, ...], *needs: Needs) -> None:
        object.__setattr__(self, "names", (names,) if isinstance(names, str) else names)
        object.__setattr__(self, "needs", needs)


class Rules:
    """A command's table: rules in the order they are checked, and the derived values their
    conditions read (``derived``: name -> function of the values). A table may hold another
    (the options every command that takes a model shares, tfcli.cli.options.SUBJECT_RULES):
    its rules are checked where it stands, and its derived values are added."""

    def __init__(self, *rules: "Rule | Rules",
                 derived: dict[str, Callable[[Values], Any]] | None = None):
        flat: list[Rule] = []
        merged: dict[str, Callable[[Values], Any]] = {}
        for item in rules:
            if isinstance(item, Rules):
                flat.extend(item.rules)
                merged.update(item.derived)
            else:
                flat.append(item)
        self.rules = tuple(flat)
        self.derived = {**merged, **(derived or {})}

    def apply(self, values: dict[str, Any], **derived: Callable[[Values], Any]) -> Values:
        """Refuse the first typed option whose condition fails; the values (with the derived
        ones) otherwise, for the command to read. ``derived`` replaces some of the table's
        derived values: a second pass once the model tells what the first could not know."""
        v = Values(values, {**self.derived, **derived})
        for rule in self.rules:
            typed = [name for name in rule.names if v.typed(name)]
            if not typed:
                continue
            for needs in rule.needs:
                if not needs.holds(v):
                    raise TfcliError(_refusal(needs.refusal, typed, v))
        return v

    def shown(self, name: str) -> list[str]:
        """How ``--help`` states the conditions of parameter ``name``."""
        return [needs.shown for rule in self.rules if name in rule.names for needs in rule.needs]


def _refusal(text: str, typed: list[str], v: Values) -> str:
    options = ", ".join(_flag(name) for name in typed)
    value = getattr(v, typed[0])
    value = getattr(value, "value", value)  # an Enum's value, as it was typed
    if isinstance(value, list):
        value = " ".join(map(str, value))
    if "{option}" not in text:
        text = "{option} " + text
    return text.format(option=options, value=value, v=v, it="them" if len(typed) > 1 else "it")


def _flag(name: str) -> str:
    """The option's name as the user sees it (its first declaration, e.g. --pass for pass_)."""
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    if ctx is not None:
        for param in ctx.command.params:
            if param.name == name and param.opts:
                return max(param.opts, key=len)
    return "--" + name.strip("_").replace("_", "-")


def help_with_conditions(params: list, rules: Rules | None) -> list:
    """Add each option's conditions to its help, once: "(only with --seq-len; not with
    --parallel)"."""
    if rules is None:
        return params
    for param in params:
        shown = list(dict.fromkeys(rules.shown(param.name)))  # each condition once
        if shown and not getattr(param, "_conditions_shown", False):
            # parentheses, not brackets: Rich reads [text] in help as markup and drops it
            param.help = f"{param.help or ''} ({'; '.join(shown)})".strip()
            param._conditions_shown = True
    return params
