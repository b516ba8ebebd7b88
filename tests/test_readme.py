"""Every `tfcli ...` example in the README's ```sh blocks runs and exits 0 (long-running ones
are shown in ```console blocks instead, which this test leaves out)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import background

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
EXAMPLES = [line for block in BLOCKS for line in block.splitlines()
            if line.startswith("tfcli ")]


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3


def _timed(line: str) -> bool:
    """A bench example: seconds of timing loops whatever the machine does meanwhile."""
    return line.startswith("tfcli bench ")


@pytest.fixture(scope="module")
def timed_examples():
    return background.result("timed_examples")


@background.job("timed_examples")
def _timed_examples() -> dict[str, subprocess.CompletedProcess]:
    """The bench examples, each as the console script in a directory of its own, one after
    another beside the in-process tests."""
    out = {}
    for line in filter(_timed, EXAMPLES):
        with tempfile.TemporaryDirectory(prefix="tfcli-readme-") as where:
            _as_in_the_repository(Path(where))
            out[line] = background.run([sys.executable, "-m", "tfcli", *shlex.split(line)[1:]],
                                       300, cwd=where, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True,
                                       env={**background.session_env(), "COLUMNS": "100"})
    return out


def _as_in_the_repository(where: Path) -> None:
    for folder in ("examples", "tests"):  # as from the repository (tests/corpus: models)
        (where / folder).symlink_to(README.parent / folder)


@pytest.mark.parametrize("line", [line for line in EXAMPLES if not _timed(line)])
def test_readme_example_runs(cli, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (--csv, --profile)
    _as_in_the_repository(tmp_path)
    result = cli(*shlex.split(line)[1:])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("line", [line for line in EXAMPLES if _timed(line)])
def test_readme_bench_example_runs(timed_examples, line):
    result = timed_examples[line]
    assert result.returncode == 0, result.stderr


def test_readme_library_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert tuple(namespace["logits"].shape) == (2, 5, namespace["cfg"].tgt_vocab_size)
