"""The option tables (tfcli.cli.rules): each rule names a real option of its command, --help
states every condition, and only an option the user typed is ever refused."""

from __future__ import annotations

import re

import pytest
import typer.main

from tfcli.cli import app
from tfcli.cli.rules import Needs, Rule, Rules

COMMANDS = typer.main.get_command(app).commands


def _rules(name: str) -> Rules:
    callback = COMMANDS[name].callback
    return getattr(getattr(callback, "__wrapped__", callback), "rules")


@pytest.mark.parametrize("name", ["params", "shapes", "masks", "bench"])
def test_every_rule_names_an_option_of_its_command(name):
    """A misspelt parameter name would make its rule silently never apply."""
    options = {param.name for param in COMMANDS[name].params}
    named = {n for rule in _rules(name).rules for n in rule.names}
    assert named and named <= options, sorted(named - options)


@pytest.mark.parametrize("name", ["params", "shapes", "masks", "bench"])
def test_help_states_every_condition(cli, name):
    # a cell's text wraps onto lines of its own between the panel's borders: the borders go
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", cli(name, "--help",
                                                env={"COLUMNS": "400"}).stdout).split())
    for rule in _rules(name).rules:
        for needs in rule.needs:
            assert needs.shown in text, (rule.names, needs.shown)


@pytest.mark.parametrize("name", ["params", "shapes", "masks", "bench"])
def test_every_refusal_starts_with_the_option_it_refuses(name):
    """A refusal that names {option} later, after words, would read "tfcli: error: is not
    modelled ..." (it did, for --optimizer-impl with --parallel)."""
    for rule in _rules(name).rules:
        for needs in rule.needs:
            text = needs.refusal
            assert "{option}" not in text or text.startswith(("{option}", "--")), \
                (rule.names, text)


def test_help_states_the_conditions_once_however_often_it_is_shown(cli):
    for _ in range(2):
        text = " ".join(cli("params", "--help", env={"COLUMNS": "400"}).stdout.split())
    assert text.count("KV cache dtype with --inference (default: --dtype). (only with "
                      "--inference)") == 1


RULES = Rules(
    Rule("b", Needs(lambda v: v.a, "only with --a", "applies to --a")),
    Rule(("c", "d"), Needs(lambda v: not v.a, "not with --a", "{option}: not with --a ({it})")),
)


def _command(cli_rules: Rules):
    import typer

    from tfcli.cli.options import TfcliCommand

    def command(a: bool = typer.Option(False, "--a"), b: int = typer.Option(0, "--b"),
                c: int = typer.Option(0, "--c"), d: int = typer.Option(0, "--d")) -> None:
        cli_rules.apply(locals())
        typer.echo("ran")

    command.rules = cli_rules
    small = typer.Typer()
    small.command(cls=TfcliCommand)(command)
    small.command("other")(lambda: None)
    return small


@pytest.mark.parametrize("args,refusal", [
    (["--b", "0"], "--b applies to --a"),  # typed, though equal to its default
    (["--a", "--c", "1"], "--c: not with --a (it)"),
    (["--a", "--c", "1", "--d", "2"], "--c, --d: not with --a (them)"),
    (["--a", "--d", "2"], "--d: not with --a (it)"),
    ([], None), (["--a", "--b", "3"], None), (["--c", "1", "--d", "1"], None),
])
def test_only_a_typed_option_is_refused_and_the_line_names_it(args, refusal):
    from typer.testing import CliRunner

    result = CliRunner().invoke(_command(RULES), ["command", *args])
    if refusal is None:
        assert result.exit_code == 0 and result.stdout == "ran\n", result.output
    else:
        assert isinstance(result.exception, Exception) and str(result.exception) == refusal


def test_outside_a_command_nothing_was_typed():
    """A direct call (the library) has no command line: no option is refused by the table."""
    assert RULES.apply({"a": False, "b": 5, "c": 1, "d": 1}).b == 5
