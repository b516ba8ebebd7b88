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


@pytest.fixture
def one_block_per_cell(monkeypatch):
    """bench as the README runs it, each cell ending after its first timed block and the
    machine's load sampled over 10 ms instead of 250: these tests check that the examples run
    and exit 0, not what they measure (tests/test_bench.py holds the timing rules), and the
    examples' timing loops would otherwise spend most of a minute of CPU."""
    import functools

    import tfcli.bench.sweep
    from tfcli.bench.timer import CellTimer, machine_state

    monkeypatch.setattr(CellTimer, "spent", property(lambda self: float("inf")))
    monkeypatch.setattr(CellTimer, "reliable", lambda self: True)
    monkeypatch.setattr(tfcli.bench.sweep, "machine_state",
                        functools.partial(machine_state, window=0.01))


def _as_in_the_repository(where: Path) -> None:
    for folder in ("examples", "tests"):  # as from the repository (tests/corpus: models)
        (where / folder).symlink_to(README.parent / folder)


@pytest.mark.parametrize("line", EXAMPLES)
def test_readme_example_runs(cli, line, tmp_path, monkeypatch, one_block_per_cell):
    monkeypatch.chdir(tmp_path)  # examples may write files (--csv, --profile)
    _as_in_the_repository(tmp_path)
    result = cli(*shlex.split(line)[1:])
    assert result.exit_code == 0, result.stderr


def test_readme_library_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert tuple(namespace["logits"].shape) == (2, 5, namespace["cfg"].tgt_vocab_size)
