"""Every `tfcli ...` example in the README's ```sh blocks runs and exits 0 (long-running ones
are shown in ```console blocks instead, which this test leaves out)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
EXAMPLES = [line for block in BLOCKS for line in block.splitlines()
            if line.startswith("tfcli ")]


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("line", EXAMPLES)
def test_readme_example_runs(cli, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (--csv, --profile)
    for folder in ("examples", "tests"):  # as from the repository (tests/corpus: models)
        (tmp_path / folder).symlink_to(README.parent / folder)
    result = cli(*shlex.split(line)[1:])
    assert result.exit_code == 0, result.stderr


def test_readme_library_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert tuple(namespace["logits"].shape) == (2, 5, namespace["cfg"].tgt_vocab_size)
