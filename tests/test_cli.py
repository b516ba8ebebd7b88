"""The CLI shell: version, help without torch, presets, config output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tfcli import __version__
from tfcli.model.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def test_version(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"tfcli {__version__}"


def test_help_and_import_do_not_import_torch():
    code = ("import sys, tfcli, tfcli.cli\n"
            "from typer.testing import CliRunner\n"
            "r = CliRunner().invoke(tfcli.cli.app, ['--help'])\n"
            "assert r.exit_code == 0 and 'presets' in r.stdout, r.stdout\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "tfcli", "--version"], capture_output=True,
                         text=True)
    assert out.returncode == 0 and out.stdout.startswith("tfcli ")


def test_unknown_option_is_one_line_exit_2(cli):
    result = cli("presets", "--bogus")
    assert result.exit_code == 2
    assert result.stderr == "tfcli: error: No such option: --bogus (see 'tfcli presets --help')\n"


def test_unknown_command(cli):
    result = cli("paramz")
    assert result.exit_code == 2 and "No such command 'paramz'" in result.stderr


def test_presets_json_lists_every_preset_with_exact_counts(cli):
    result = cli("presets", "--json")
    assert result.exit_code == 0
    rows = {r["name"]: r for r in json.loads(result.stdout)["presets"]}
    assert set(rows) == set(PRESETS)
    assert rows["torch-transformer"]["params"] == 44_140_544
    assert rows["gpt2-small"]["params"] == 124_439_808
    assert rows["vaswani-base"]["default"] and rows["gpt2-small"]["kind"] == "decoder-only"


def test_presets_table(cli):
    result = cli("presets")
    assert result.exit_code == 0
    assert "124,439,808" in result.stdout and "vaswani-base (default)" in result.stdout


def test_config_toml_is_loadable_and_json_has_derived_sizes(cli, tmp_path):
    result = cli("config", "--preset", "tiny", "--set", "d_model=64")
    assert result.exit_code == 0
    data = tomllib.loads(result.stdout)
    assert data["d_model"] == 64 and data["n_heads"] == 4
    path = tmp_path / "c.toml"
    path.write_text(result.stdout)
    again = cli("config", "--config", str(path), "--json")
    payload = json.loads(again.stdout)
    assert payload["config"]["d_model"] == 64 and payload["derived"]["d_k"] == 16


# --- how a run ends: one line and an exit code that means one thing (issue 11) -----------------


def test_a_bug_is_one_line_exit_70_and_a_traceback_on_request(cli, monkeypatch):
    import tfcli.cli.config_cmd as config_cmd

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(config_cmd, "resolve_config", broken)
    result = cli("config")
    assert result.exit_code == 70
    assert result.stderr == ("tfcli: error: internal error: ZeroDivisionError: division by zero "
                             "(please report it; TFCLI_TRACEBACK=1 prints the traceback)\n")
    again = cli("config", env={"TFCLI_TRACEBACK": "1"})
    assert isinstance(again.exception, ZeroDivisionError)


def test_an_allocation_failing_without_memoryerror_under_ulimit_v_is_out_of_memory(
        cli, monkeypatch):
    """Issue 25: under `ulimit -v 700000` a run failed in CPython's compile, which returned
    NULL without an exception: SystemError, an internal error (exit 70). Under an address-space
    limit that is memory running out (exit 1, one line); without one it stays a bug."""
    import resource

    import tfcli.cli.config_cmd as config_cmd

    def no_memory(*args, **kwargs):
        raise SystemError("<built-in function compile> returned NULL without setting an "
                          "exception")

    monkeypatch.setattr(config_cmd, "resolve_config", no_memory)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (700 * 10**6, 700 * 10**6))
    result = cli("config")
    assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("tfcli: error: out of memory: the run needed more than the "
                                    "machine could give (the address-space limit, ulimit -v, "
                                    "was reached: SystemError)")
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert cli("config").exit_code == 70


def test_ctrl_c_in_any_command_is_one_line_and_130(cli, monkeypatch):
    import tfcli.cli.config_cmd as config_cmd

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(config_cmd, "resolve_config", interrupted)
    result = cli("config")
    assert result.exit_code == 130 and result.stderr == "tfcli: interrupted (Ctrl-C)\n"


@pytest.mark.parametrize("sig,code,line", [("SIGINT", 130, "interrupted (Ctrl-C)"),
                                            ("SIGTERM", 143, "terminated (SIGTERM)")])
def test_a_signal_while_the_cli_is_still_importing_is_one_line(sig, code, line):
    """The signal arrives (deterministically) while the entry point imports rich, before any
    command's own handler exists: one line, no KeyboardInterrupt traceback from an import."""
    script = f"""
import os, signal, sys
class SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == "rich":
            os.kill(os.getpid(), signal.{sig})
        return None
sys.meta_path.insert(0, SignalOnImport())
sys.argv = ["tfcli", "presets"]
from tfcli._entry import main
main()
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == code and proc.stdout == ""
    assert proc.stderr == f"tfcli: {line} while starting; nothing was written\n"


def test_the_console_script_and_python_m_go_through_the_early_handler():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tfcli"] == "tfcli._entry:main"
    assert "from tfcli._entry import main" in (ROOT / "tfcli" / "__main__.py").read_text()


def test_ascii_stand_ins():
    from tfcli.cli.process import _ascii_fallback  # noqa: F401 (registers nothing by itself)
    import codecs

    codecs.register_error("tfcli-ascii", _ascii_fallback)
    text = "2 × 3 → ∞ ≡ ✓ ∝ L² Qᵀ │├└ é 漢"
    assert text.encode("ascii", "tfcli-ascii") == b"2 x 3 -> inf == ok ~ L^2 Q^T |+` e ?"


@pytest.mark.parametrize("columns,width", [("0", "60"), ("-5", "60"), ("wide", "60"),
                                           ("1", "60"), ("100", "100"), ("9" * 20, "60"),
                                           ("99999", "1000")])
def test_columns_are_clamped(cli, columns, width):
    code = "import os; print(os.environ['COLUMNS'])"
    result = subprocess.run([sys.executable, "-c", "from tfcli.cli.process import "
                             "_prepare_process; _prepare_process(); " + code],
                            capture_output=True, text=True, env={"COLUMNS": columns})
    assert result.stdout.strip() == width


# --- output files: checked before work, written atomically -------------------------------------


def test_outputs_are_checked_before_work(tmp_path):
    from tfcli.cli.outputs import Output, check_outputs
    from tfcli.errors import TfcliError

    (tmp_path / "d.csv").mkdir()
    (tmp_path / "f.csv").write_text("x")
    cases = [
        ((Output(tmp_path / "d.csv", "--csv", ".csv"),), "is a directory"),
        ((Output(tmp_path / "r.txt", "--csv", ".csv"),), "must end in .csv"),
        ((Output(tmp_path / "no" / "r.csv", "--csv", ".csv"),), "no such directory"),
        ((Output(Path("/dev/null.csv"), "--csv", ".csv"),), "cannot write in directory"
         if os.geteuid() else "no such directory" if not Path("/dev").exists() else None),
        ((Output(tmp_path / "f.csv", "--profile", directory=True),), "is not a directory"),
        ((Output(tmp_path / "a.csv", "--csv"), Output(tmp_path / "." / "a.csv", "--profile",
                                                     directory=True)),
         "--csv and --profile both name"),
    ]
    for outputs, message in cases:
        if message is None:
            continue
        with pytest.raises(TfcliError, match=message):
            check_outputs(*outputs)
    check_outputs(Output(tmp_path / "f.csv", "--csv", ".csv"), Output(None, "--plot"),
                  Output(tmp_path / "traces", "--profile", directory=True))


def test_atomic_file_keeps_the_old_file_until_commit(tmp_path):
    from tfcli.cli.outputs import AtomicFile

    path = tmp_path / "r.csv"
    path.write_text("old")
    path.chmod(0o640)
    out = AtomicFile(path)
    out.text().write("new")
    out.text().flush()
    assert path.read_text() == "old" and out.temp.read_text() == "new"
    out.commit()
    assert path.read_text() == "new" and (path.stat().st_mode & 0o777) == 0o640
    again = AtomicFile(path)
    again.text().write("half")
    again.discard()
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


def test_temporary_files_not_yet_in_place_can_be_removed_at_once(tmp_path):
    """What a second Ctrl-C does before ending the process: every temporary file not yet
    renamed into place goes; the targets stay as they were."""
    from tfcli.cli.outputs import AtomicFile, remove_pending

    (tmp_path / "r.csv").write_text("old")
    first, second = AtomicFile(tmp_path / "r.csv"), AtomicFile(tmp_path / "p.png")
    first.text().write("half")
    done = AtomicFile(tmp_path / "done.csv")
    done.text().write("all")
    done.commit()
    remove_pending()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done.csv", "r.csv"]
    assert (tmp_path / "r.csv").read_text() == "old" and not second.temp.exists()


@pytest.mark.parametrize("args,message", [
    (["--model", "examples/tutorial_transformer.py:build"],
     "--what attention times the attention core alone, sized by --heads/--head-dim, and uses "
     "nothing of the module; add --what model"),
    (["--model", "hf:examples/llama-tiny", "--input", "input_ids=int64[B,L]"],
     "--input describes the forward of the model --what model runs"),
])
def test_bench_refuses_what_it_would_ignore(cli, args, message):
    result = cli("bench", "--seq-lens", "16", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1


def test_given_is_false_outside_a_command():
    from tfcli.cli.options import given

    assert not given("src_len")


def test_interrupted_bench_leaves_an_existing_csv_as_it_was(cli, ctrl_c_at_block, tmp_path):
    ctrl_c_at_block(6)
    path = tmp_path / "r.csv"
    path.write_bytes(b"precious\n")
    result = cli("bench", "--seq-lens", "16,32,64", "--heads", "2", "--head-dim", "8",
                 "--min-time", "0.02", "--max-time", "0.05", "--csv", str(path))
    assert result.exit_code == 130 and result.stderr.endswith("tfcli: interrupted (Ctrl-C)\n")
    assert "not written: records" in result.stdout and "wrote records" not in result.stdout
    assert path.read_bytes() == b"precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv"]


def test_plot_failure_after_the_sweep_keeps_the_table_and_the_old_plot(cli, monkeypatch,
                                                                       tmp_path):
    pytest.importorskip("matplotlib")
    import tfcli.render.bench_plot as bench_plot

    def full_disk(records, path, *context):
        Path(path).write_bytes(b"half a plot")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench_plot, "save_plot", full_disk)
    plot = tmp_path / "p.png"
    plot.write_bytes(b"old plot")
    result = cli("bench", "--seq-lens", "16", "--heads", "2", "--head-dim", "8", "--kernels",
                 "sdpa", "--pass", "fwd", "--min-time", "0.005", "--max-time", "0.02",
                 "--plot", str(plot))
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (f"tfcli: error: --plot '{plot}': [Errno 28] No "
                                              f"space left on device")
    assert plot.read_bytes() == b"old plot" and [p.name for p in tmp_path.iterdir()] == ["p.png"]
