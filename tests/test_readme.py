"""Every `tfcli ...` example in the README's ```sh blocks runs and exits 0 (long-running ones
are shown in ```console blocks instead, which this test leaves out).

The examples are whole models (GPT-2 small built and run, the paper's big model and Llama 3 8B
replayed): they run one after another in a process of their own (forked from one that has
imported torch: tests/forked.py), as tests/conftest.py's runner runs tfcli (the console
script's way, in that process), as a job beside the in-process tests (tests/background.py);
each example's test reads its exit code and stderr. ``python tests/test_readme.py`` runs them
and prints what each did."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

import background
import forked

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S)
EXAMPLES = [line for block in BLOCKS for line in block.splitlines()
            if line.startswith("tfcli ")]


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3


def _one_block_per_cell() -> None:
    """bench as the README runs it, each cell ending after its first timed block of one run (and
    the machine's load sampled over 10 ms instead of 250: tests/conftest.py, imported to run
    the examples): these tests check that the examples run and exit 0, not what they measure
    (tests/test_bench.py holds the timing rules), and the examples' timing loops would
    otherwise spend most of a minute of CPU."""
    from tfcli.bench.timer import CellTimer

    warm_up = CellTimer.warm_up

    def one_run_per_block(self, block_seconds: float) -> float:
        once = warm_up(self, block_seconds)
        self.number = 1
        return once

    CellTimer.warm_up = one_run_per_block
    CellTimer.spent = property(lambda self: float("inf"))
    CellTimer.reliable = lambda self: True


def _as_in_the_repository(where: Path) -> None:
    for folder in ("examples", "tests"):  # as from the repository (tests/corpus: models)
        (where / folder).symlink_to(README.parent / folder)


def run_examples() -> dict[str, list]:
    """Every example in this process, each in a directory of its own (examples may write
    files: --csv, --profile) that holds the repository's examples/ and tests/: example ->
    [exit code, stderr]."""
    import gc
    import os
    import tempfile

    from conftest import _objects, invoke

    _one_block_per_cell()
    here, out, after_full = os.getcwd(), {}, 0
    for line in EXAMPLES:
        # Each example runs with what earlier ones left (Transformers' modules, caches) frozen
        # out of the garbage collector, as tests/conftest.py runs each test: bench's sweep
        # collects after every length, which would walk all of it (~0.3 s each) in this
        # long-lived process; a full collection when the heap has grown by half keeps what
        # cycles leave bounded.
        if _objects() > 1.5 * after_full:
            gc.collect()
            after_full = _objects()
        gc.freeze()
        with tempfile.TemporaryDirectory(prefix="tfcli-readme-") as where:
            _as_in_the_repository(Path(where))
            os.chdir(where)
            try:
                result = invoke(shlex.split(line)[1:], env={"COLUMNS": "100"})
            finally:
                os.chdir(here)
                gc.unfreeze()
        out[line] = [result.exit_code, result.stderr]
    return out


@pytest.fixture(scope="module")
def readme_runs():
    return background.result("readme_runs")


# this file as a script, in a process forked from one that has imported torch (tests/forked.py)
_AS_SCRIPT = ("import runpy, sys; sys.path.insert(0, sys.argv[1].rpartition('/')[0]); "
              "runpy.run_path(sys.argv[1], run_name='__main__')")


@background.job("readme_runs", cost=41)
def _readme_runs() -> dict[str, list]:
    done = background.run(forked.command("-c", _AS_SCRIPT, __file__), 600,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("line", EXAMPLES)
def test_readme_example_runs(readme_runs, line):
    code, stderr = readme_runs[line]
    assert code == 0, stderr


def test_the_layout_section_names_the_package_as_it_is():
    """The README's account of the package ("How the package is laid out") against the tree:
    every top-level module and every folder of tfcli/ has a row, and every file the section
    names (a row's, or a path in the paragraph on imports) exists."""
    text = README.read_text()
    section = text[text.index("### How the package is laid out"):text.index("### Tests")]
    package = README.parent / "tfcli"
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `tfcli/")]
    named_first = {name for first, _ in rows for name in re.findall(r"`(tfcli/[^`]*)`", first)}
    folders = {f"tfcli/{d.name}/" for d in package.iterdir()
               if d.is_dir() and (d / "__init__.py").exists()}
    modules = {f"tfcli/{f.name}" for f in package.glob("*.py")}
    assert folders | modules == named_first, (sorted((folders | modules) - named_first),
                                              sorted(named_first - (folders | modules)))
    for first, second in rows:
        for folder in re.findall(r"`(tfcli/[^`]*/)`", first):
            for name in re.findall(r"`([\w*]+\.py)`", second):  # a file of that folder
                assert list((README.parent / folder).glob(name)), (folder, name)
    for path in re.findall(r"`((?:cli|render|bench|parallel|inspection|subjects|model)/[\w.]+)`",
                           section):
        assert (package / path).exists(), path


def test_readme_library_example_runs():
    block = re.search(r"```python\n(.*?)```", README.read_text(), flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert tuple(namespace["logits"].shape) == (2, 5, namespace["cfg"].tgt_vocab_size)


if __name__ == "__main__":
    print(json.dumps(run_examples()))
