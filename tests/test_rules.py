"""The option tables (tfcli.cli.rules): each rule names a real option of its command, --help
states every condition, and only an option the user typed is ever refused."""

from __future__ import annotations

import re

import pytest
import typer.main

from tfcli.cli import app
from tfcli.cli.rules import Needs, Rule, Rules

COMMANDS = typer.main.get_command(app).commands
TABLES = ["params", "shapes", "masks", "bench", "config"]  # every command with options to refuse


def _rules(name: str) -> Rules:
    callback = COMMANDS[name].callback
    return getattr(getattr(callback, "__wrapped__", callback), "rules")


@pytest.mark.parametrize("name", TABLES)
def test_every_rule_names_an_option_of_its_command(name):
    """A misspelt parameter name would make its rule silently never apply."""
    options = {param.name for param in COMMANDS[name].params}
    named = {n for rule in _rules(name).rules for n in rule.names}
    assert named and named <= options, sorted(named - options)


@pytest.mark.parametrize("name", TABLES)
def test_help_states_every_condition(cli, name):
    # a cell's text wraps onto lines of its own between the panel's borders: the borders go
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", cli(name, "--help",
                                                env={"COLUMNS": "400"}).stdout).split())
    for rule in _rules(name).rules:
        for needs in rule.needs:
            assert needs.shown in text, (rule.names, needs.shown)


@pytest.mark.parametrize("name", TABLES)
def test_every_refusal_starts_with_the_option_it_refuses(name):
    """A refusal that names {option} later, after words, would read "tfcli: error: is not
    modelled ..." (it did, for --optimizer-impl with --parallel)."""
    for rule in _rules(name).rules:
        for needs in rule.needs:
            text = needs.refusal
            assert "{option}" not in text or text.startswith(("{option}", "--")), \
                (rule.names, text)


def test_every_command_but_presets_has_a_table():
    """presets takes --json alone; every other command's combinations are in its table."""
    assert sorted(TABLES) == sorted(set(COMMANDS) - {"presets"})


PLANTED = "open(__file__ + '.imported', 'w').close()\n\ndef build():\n    raise SystemExit(3)\n"


@pytest.mark.parametrize("args,refusal", [
    (["params", "--model", "{m}", "--inference", "--seq-len", "8", "--timeline", "t.html"],
     "--timeline with --inference draws tfcli's own model"),
    (["params", "--model", "{m}", "--input", "x=float32[B,L]", "--seq-len", "8", "--dtype",
      "int8"], "--seq-len with --dtype int8: activations need a floating dtype"),
    # an internal error once (the serving search made int8 the default dtype)
    (["params", "-p", "tiny", "--inference", "--fit", "seq-len", "--device-memory", "1GiB",
      "--dtype", "int8"], "--fit seq-len with --dtype int8: the search replays steps"),
    # was "--parallel with --dtype int8", an option not typed
    (["params", "-p", "tiny", "--fit", "seq-len", "--device-memory", "1GiB", "--dtype", "int8"],
     "--fit seq-len with --dtype int8"),
    (["params", "-p", "tiny", "--device-memory", "1GiB", "--dtype", "int8"],
     "--device-memory with --dtype int8: the per-rank plan sizes a training step"),
    (["params", "-p", "tiny", "--fit", "batch", "--seq-len", "8"],
     "--fit needs --device-memory to fit into: add --device-memory SIZE|GPU"),
    (["params", "-p", "tiny", "--fit", "batch", "--device-memory", "1GiB"],
     "--fit batch needs --seq-len"),
    (["params", "--model", "{m}", "--input", "x=float32[B,L]", "--fit", "batch", "--dim",
      "B=2", "--seq-len", "8", "--device-memory", "1GiB"],
     "--dim B=2 with --fit batch: the search sets B"),
    (["params", "--model", "{m}", "--input", "x=float32[B,L]", "--parallel", "dp=2", "--dim",
      "B=2", "--seq-len", "8"], "--dim B=2 with --parallel: the plan divides B over the ranks"),
    (["params", "--param-count", "7e9", "--parallel", "dp=2,ep=2"],
     "--param-count with --parallel ep=2: a stated size has no experts to split"),
    (["masks", "--model", "{m}", "--pad-id", "0"],
     "--pad-id pads the sequences --lengths describes"),
    (["bench", "--model", "{m}"], "--model {m}: --what attention times the attention core"),
    (["bench", "--what", "model", "--model", "{m}", "--nproc", "2"],
     "--nproc needs tfcli's own configuration"),
    (["bench", "--backend", "gloo"], "--backend: for the ranks of --nproc N"),
    (["shapes", "--model", "{m}", "--hf-class", "X"], "--hf-class applies to --model hf:PATH"),
    (["shapes", "--model", "{m}", "--attn-implementation", "eager"],
     "--attn-implementation applies to --model hf:PATH"),
    (["shapes", "--model", "hf:examples/llama-tiny", "--model-arg", "a=1"],
     "--model-arg applies to --model FILE.py:NAME"),
    (["shapes", "--model", "{m}", "--preset", "tiny"], "--model with --preset: those configure"),
    (["config", "--fields", "--set", "d_model=8"],
     "--fields lists the keys themselves; it takes no --set"),
    # found by a second audit: refused once torch had loaded, or ignored, or "with None"
    (["params", "--param-count", "7e9", "--parallel", "dp=8,zero=2", "--precision",
      "fsdp-mixed"], "--precision fsdp-mixed: FSDP's MixedPrecisionPolicy gathers sharded "
                     "parameters; add zero=3 to --parallel (now zero=2)"),
    (["params", "--model", "{m}", "--wrap", "Block", "--device-memory", "80GiB", "--seq-len",
      "8"], "--wrap Block with --device-memory: it chooses FSDP's units"),
    (["masks", "--model", "{m}", "--input", "src=int64[B,S]", "--lengths", "src=5,3",
      "--mask", "src=additive"], "--mask src=additive: --lengths names src as a sequence"),
    (["config", "--fields", "--markdown", "--json"], "--markdown and --json: give one"),
    # and by a hostile sweep: ignored, said as the wrong mistake, or accepted meaning nothing
    (["bench", "--model", "hf:examples/llama-tiny", "--attn-implementation", "eager"],
     "--attn-implementation: --what attention times the attention core alone"),
    (["bench", "--strategy", "ddp", "-p", "tiny", "--pass", "fwd"],
     "--strategy: for the ranks of --nproc N"),
    (["params", "--param-count", "7e9", "--dtype", "int8"],
     "--param-count with --dtype int8: the per-rank plan sizes a training step"),
])
def test_a_combination_is_refused_by_the_table_before_any_model_is_imported(
        cli, tmp_path, monkeypatch, args, refusal):
    """Combinations once refused inside the commands (some after the user's model was
    imported and built, one as an internal error, one naming an option not typed), now
    rules of the commands' tables: one line, exit 2, and the model file never imported."""
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "planted_model.py"
    planted.write_text(PLANTED)
    model = f"{planted}:build"
    result = cli(*[a.replace("{m}", model) for a in args])
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"tfcli: error: {refusal.replace('{m}', model)}"), \
        result.stderr
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "planted_model.py.imported").exists()


def test_the_16_bit_dtype_of_a_precision_policy_needs_no_length(cli):
    """--mixed-precision was refused without --seq-len ("changes the activations"), so the
    16-bit dtype of --precision zero-paper/megatron could not be chosen for model states."""
    import json

    for dtype in ("fp16", "bf16"):
        data = json.loads(cli("params", "--param-count", "7e9", "--precision", "zero-paper",
                              "--mixed-precision", dtype, "--json").stdout)
        assert data["conditions"]["mixed_precision"] == dtype
        assert data["conditions"]["state_bytes"].startswith(f"zero-paper: Rajbhandari et al. "
                                                            f"2020: {dtype} weights")
    refused = cli("params", "-p", "tiny", "--mixed-precision", "bf16")  # autocast: activations
    assert refused.exit_code == 2 and "--mixed-precision changes the activations" in \
        refused.stderr


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
