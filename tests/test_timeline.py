"""The memory timeline of a replayed training step (issue 23, first step), checked against
torch.profiler's memory timeline of a real CPU step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "tutorial_transformer.py")


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
