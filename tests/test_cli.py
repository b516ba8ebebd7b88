"""The CLI shell: version, help without torch, presets, config output."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib

from tfcli import __version__
from tfcli.model.presets import PRESETS


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
