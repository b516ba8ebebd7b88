"""`params --seq-len L --timeline FILE` (issue 23, first step): the replayed training step's
allocations and frees, checked against the peak line, against PyTorch's own snapshot tooling,
and against torch.profiler's memory timeline of a real CPU step."""

from __future__ import annotations

import base64
import copy
import json
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "tutorial_transformer.py")
# Small enough that a replay takes a fraction of a second: one layer a side, L = 8.
TINY = ("--preset", "tiny", "--set", "n_encoder_layers=1", "--set", "n_decoder_layers=1")
USER = ("--model", f"{EXAMPLE}:build", "--model-arg", "d_model=32", "--model-arg", "d_ff=48",
        "--model-arg", "layers=1", "--model-arg", "src_vocab=50", "--model-arg", "tgt_vocab=60",
        "--input", "src=int64[B,S]", "--input", "tgt=int64[B,T]")
SIZES = ("--seq-len", "8", "--batch-size", "2")


def run_json(cli, *args) -> dict:
    result = cli("params", *args, *SIZES, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def trace_peak(snapshot: dict) -> int:
    """The highest live total of a torch.cuda.memory._snapshot() trace, read as its format
    says: alloc adds the block, free_completed takes it away."""
    live = peak = 0
    for event in snapshot["device_traces"][0]:
        live += {"alloc": event["size"], "free_completed": -event["size"]}.get(event["action"], 0)
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("model", [TINY, USER], ids=["tiny", "user-module"])
def test_json_is_a_memory_snapshot_whose_peak_is_the_peak_line(cli, tmp_path, model):
    from torch.cuda import _memory_viz as viz

    plain = run_json(cli, *model)["bytes"]["peak of a training step"]  # no recorder
    path = tmp_path / "t.json"
    data = run_json(cli, *model, "--timeline", str(path))
    assert data["bytes"]["peak of a training step"] == plain
    assert data["timeline"]["peak_bytes"] == plain and data["timeline"]["path"] == str(path)
    snapshot = json.loads(path.read_text())
    assert trace_peak(snapshot) == plain

    # PyTorch's own tooling reads it: segsum checks the segments' accounting, trace and the
    # flamegraph inputs walk every event and block, the viewer pages embed it
    identity = lambda text: text  # noqa: E731 (no flamegraph.pl download)
    assert "total_free: 0.0B" in viz.segsum(snapshot)
    assert len(viz.trace(snapshot).splitlines()) == len(snapshot["device_traces"][0]) + 3
    lines = viz.memory(snapshot, format_flamegraph=identity).splitlines()
    at_end = sum(b["size"] for s in snapshot["segments"] for b in s["blocks"])
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == at_end
    assert viz.segments(snapshot, format_flamegraph=identity).count("\n") == len(lines)
    for page in (viz.trace_plot(snapshot), viz.segment_plot(snapshot)):
        embedded = json.loads(re.search(r"const local_files = (.*)\n", page).group(1))
        assert pickle.loads(base64.b64decode(embedded[0]["base64"]).rstrip(b"\0")) == snapshot
    # what is never freed, as torch pairs allocations with frees, is what the segments hold
    kept = viz.filter_alloc_free_pairs(copy.deepcopy(snapshot))["device_traces"][0]
    assert {e["action"] for e in kept} == {"alloc"} and sum(e["size"] for e in kept) == at_end
    first = snapshot["device_traces"][0][0]
    assert first["category"] == "parameter" and first["frames"][0]["filename"]


def test_html_is_self_contained_and_marks_phases_and_the_peak(cli, tmp_path):
    path = tmp_path / "t.html"
    data = run_json(cli, *TINY, "--timeline", str(path))
    page = path.read_text()
    peak = data["bytes"]["peak of a training step"]
    assert not re.search(r"\b(src|href)=|@import|url\(", page)
    assert re.findall(r"https?://[^\"' ]+", page) == ["http://www.w3.org/2000/svg"]
    for phase in ("before the step", "forward encoder.layers.0", "loss",
                  "backward decoder.layers.0", "optimizer step", "zero_grad"):
        assert f">{phase}<" in page, phase
    assert f"{peak:,} B" in page and "equal to the peak line" in page
    # the points the drawing and its script use: the highest stack is the peak
    data_in_page = json.loads(re.search(r'id="data">(.*?)</script>', page).group(1))
    assert max(sum(p[1:]) for p in data_in_page["points"]) == peak
    script = re.findall(r"<script>(.*?)</script>", page, flags=re.S)[-1]
    assert set(re.findall(r"\bd\.(\w+)", script)) <= set(data_in_page)  # all it reads is there
    largest = data["timeline"]["by_category_at_peak"]
    assert sum(largest.values()) == peak


def test_png_follows_the_plot_conventions(cli, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    seen = {}
    original = matplotlib.figure.Figure.savefig

    def savefig(fig, *args, **kwargs):
        ax = fig.axes[0]
        seen.update(title=fig._suptitle.get_text(), ylabel=ax.get_ylabel(),
                    legend=[t.get_text() for t in fig.legends[0].get_texts()],
                    texts=[t.get_text() for t in ax.texts])
        return original(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    path = tmp_path / "t.png"
    result = cli("params", *TINY, *SIZES, "--depth", "0", "--timeline", str(path))
    assert result.exit_code == 0, result.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote timeline: {path}" in result.stdout
    assert "encoder-decoder (tiny)" in seen["title"] and "B=2, S=8, T=8" in seen["title"]
    assert "adam.step()" in seen["title"] and seen["ylabel"] == "live memory (MiB)"
    assert any(t.startswith("activations") for t in seen["legend"])
    assert any(t.startswith("peak ") for t in seen["texts"])


def test_png_without_matplotlib_is_one_line_naming_the_extra(cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = cli("params", *TINY, *SIZES, "--timeline", str(tmp_path / "t.png"))
    assert result.exit_code == 2 and list(tmp_path.iterdir()) == []
    assert result.stderr.count("\n") == 1 and "the 'plot' extra" in result.stderr


@pytest.mark.parametrize("args,words", [
    (("--timeline", "t.json"), "--timeline applies to the memory of a step: add --seq-len"),
    ((*SIZES, "--timeline", "t.svg"), "must end in .json, .html or .png"),
    ((*SIZES, "--parallel", "dp=2", "--timeline", "t.json"),
     "--timeline is not yet supported with --parallel"),
    ((*SIZES, "--inference", "--timeline", "t.json"),
     "--timeline is not yet supported with --inference"),
    ((*SIZES, "--timeline", "d.json"), "is a directory"),
    ((*SIZES, "--timeline", "nowhere/t.json"), "no such directory"),
])
def test_refusals(cli, tmp_path, monkeypatch, args, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.json").mkdir()
    result = cli("params", "--preset", "tiny", *args)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert words in result.stderr, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]


def test_a_failed_write_leaves_the_old_file(cli, tmp_path, monkeypatch):
    import tfcli.render.timeline as draw

    def full_disk(timeline, about, out):
        out.write("<!DOCTYPE html> half a page")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(draw, "write_html", full_disk)
    path = tmp_path / "t.html"
    path.write_text("old page")
    result = cli("params", *TINY, "--seq-len", "4", "--batch-size", "1", "--timeline",
                 str(path))
    assert result.exit_code == 1
    assert result.stderr == f"tfcli: error: --timeline '{path}': No space left on device\n"
    assert path.read_text() == "old page" and list(tmp_path.iterdir()) == [path]


# --- against torch.profiler's memory timeline of a real CPU step --------------------------------

SCALAR = 16  # bytes: Adam's step counters and the scalars C++ wraps Python numbers in


def _profiled_step(subject, sizes):
    """One steady-state step (after a warm-up step) under torch.profiler; its memory profile's
    live bytes by category (torch's own classification) at its highest live total, counting
    tensors larger than SCALAR bytes, and the highest total counting every tensor."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline, TensorKey

    from tfcli.inspection.memory import quiet_native_stderr

    torch.manual_seed(0)
    model = subject.build("cpu").train()
    optimizer = torch.optim.Adam(model.parameters())
    inputs = subject.make_inputs(model, sizes, "cpu")

    def step():
        out = subject.loss(inputs(model))
        out.backward()
        del out
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    with quiet_native_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                        record_shapes=True, with_stack=True) as prof:
        step()
    memory = MemoryProfileTimeline(prof._memory_profile())

    def replay(smallest: int) -> tuple[int, dict[str, int]]:
        live: dict = {}
        best: tuple[int, dict[str, int]] = (-1, {})
        for _, action, (key, version), nbytes in memory.timeline:
            if not isinstance(key, TensorKey) or key.device.type != "cpu":
                continue
            if action in (Action.PREEXISTING, Action.CREATE):
                if nbytes > smallest:
                    live[(key, version)] = nbytes
            elif action == Action.INCREMENT_VERSION:
                if (key, version) in live:
                    live[(key, version + 1)] = live.pop((key, version))
            elif action == Action.DESTROY:
                live.pop((key, version), None)
            total = sum(live.values())
            if total > best[0]:
                sums: dict[str, int] = {}
                for (k, v), n in live.items():
                    category = memory.categories.get(k, v)
                    name = category.name if category is not None else "NONE"
                    sums[name] = sums.get(name, 0) + n
                best = (total, sums)
        return best

    return replay(SCALAR), replay(0)[0]


@pytest.mark.parametrize("which", ["tiny", "user-module"])
def test_timeline_agrees_with_the_profilers_memory_timeline_of_a_real_step(which):
    from tfcli.inspection.memory import estimate_step_peak
    from tfcli.inspection.timeline import TimelineRecorder
    from tfcli.model.presets import get_preset
    from tfcli.subjects.base import parse_input
    from tfcli.subjects.own import OwnSubject
    from tfcli.subjects.user import UserSubject

    if which == "tiny":
        subject = OwnSubject(get_preset("tiny").replace(n_encoder_layers=1, n_decoder_layers=1))
    else:
        subject = UserSubject(f"{EXAMPLE}:build", {"d_model": 32, "d_ff": 48, "layers": 1,
                                                    "src_vocab": 50, "tgt_vocab": 60},
                              [parse_input("src=int64[B,S]"), parse_input("tgt=int64[B,T]")])
    sizes = dict(B=2, S=8, T=8)
    recorder = TimelineRecorder()
    estimate_step_peak(subject, sizes, "fp32", None, "adam", timeline=recorder)
    timeline = recorder.timeline
    batch = timeline.excluded["inputs (the batch)"]
    (measured, theirs), measured_all = _profiled_step(subject, sizes)

    live, best, at = 0, -1, 0
    for k, (index, sign) in enumerate(timeline.events):
        if timeline.allocations[index].nbytes > SCALAR:
            live += sign * timeline.allocations[index].nbytes
            if live > best:
                best, at = live, k
    # The peak, to the byte, apart from scalar-sized tensors; the profiler counts the batch.
    assert best + batch == measured
    every = timeline.peak()[0] + sum(timeline.excluded.values())
    assert 0 <= measured_all - every <= 4 * SCALAR  # a few C++ scalars the replay never sees
    # The categories at the peak, named as torch's profiler names them.
    ours = {}
    for a in timeline.live_at(at):
        if a.nbytes > SCALAR:
            ours[a.category] = ours.get(a.category, 0) + a.nbytes
    for mine, its in (("parameter", "PARAMETER"), ("optimizer_state", "OPTIMIZER_STATE"),
                      ("gradient", "GRADIENT")):
        assert ours.get(mine, 0) == theirs.get(its, 0), (mine, ours, theirs)
    assert ours.get("temporary", 0) == sum(theirs.get(c, 0) for c in
                                           ("TEMPORARY", "AUTOGRAD_DETAIL", "NONE"))
    # What the profiler calls input beyond the buffers and the batch is what the replay calls
    # an activation: masks the model's forward computes from the token ids (bool, no gradient).
    masks = sum(a.nbytes for a in timeline.live_at(at)
                if a.nbytes > SCALAR and a.category == "activation" and a.dtype == "bool")
    assert theirs.get("INPUT", 0) - ours.get("buffer", 0) - batch == masks
    assert ours.get("activation", 0) - masks == theirs.get("ACTIVATION", 0)


def test_written_where_asked_when_the_model_changes_directory(cli, tmp_path, monkeypatch):
    """The path is fixed before the user's model is imported, which may chdir (issue 25)."""
    (tmp_path / "away").mkdir()
    (tmp_path / "m.py").write_text(
        "import os, torch\nos.chdir(os.path.abspath('away'))\n"
        "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.p = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n"
        "        return self.p(x)\n")
    monkeypatch.chdir(tmp_path)
    result = cli("params", "--model", "m.py:M", "--input", "x=float32[B,L,4]", "--seq-len", "4",
                 "--timeline", "t.html")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "t.html").is_file() and not (tmp_path / "away" / "t.html").exists()
