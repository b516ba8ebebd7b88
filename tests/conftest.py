from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tfcli.cli import app


class Result:
    def __init__(self, result) -> None:
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr
        self.exception = result.exception


@pytest.fixture
def cli():
    """Run tfcli in-process as the console script would, with stdout and stderr apart."""
    runner = CliRunner()

    def run(*args: str, env: dict | None = None) -> Result:
        return Result(runner.invoke(app, list(args), env={"COLUMNS": "100", **(env or {})}))

    return run
