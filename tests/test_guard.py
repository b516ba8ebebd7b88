"""Memory guards: sizes, what is available under each kind of limit, the refusal line, and the
closed forms and estimates it compares (tfcli.guard)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tfcli.errors import TfcliError
from tfcli.guard import (attention_cell_bytes, available, gib, parse_size, require, shortfall,
                         _cgroup_available)


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 2**30), ("8gib", 8 * 2**30), ("1.5G", 1_500_000_000), ("512", 512),
    ("2 MiB", 2 * 2**20), ("100KB", 100_000), (".5TiB", 2**39), ("1B", 1)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text,message", [
    ("", "expected a size such as 8GiB"), ("lots", "expected a size"), ("-1GB", "expected a size"),
    ("inf", "expected a size"), ("1e400", "expected a size"), ("8 parsecs", "expected a size"),
    ("0", "must be between 1 byte and 1 EiB"), ("0.1", "must be between 1 byte"),
    ("9" * 400 + "TiB", "must be between 1 byte and 1 EiB")])
def test_parse_size_refuses(text, message):
    with pytest.raises(TfcliError, match=message):
        parse_size(text)


def test_gib():
    assert [gib(n) for n in (512, 2048, 3 * 2**20, 1.5 * 2**30, 2**41)] == [
        "512 B", "2 KiB", "3 MiB", "1.5 GiB", "2 TiB"]


def test_max_memory_replaces_what_is_detected():
    budget = available("cpu", 12345)
    assert (budget.bytes, budget.source) == (12345, "--max-memory")
    assert available("cpu").bytes > 0


def test_require_names_the_estimate_and_the_limit():
    require(2**20, "a run", max_memory=2**21)  # fits: nothing happens
    with pytest.raises(TfcliError) as err:
        require(10 * 2**30, "shapes --device cpu", max_memory=2**30, how="weights 9 GiB")
    assert str(err.value) == ("shapes --device cpu needs an estimated 10 GiB (weights 9 GiB), "
                              "but 1 GiB is available on cpu (--max-memory)")
    assert shortfall(10, "cpu", 100) is None
    assert shortfall(3 * 2**30, "cpu", 2**30) == "needs 3 GiB, 1 GiB available (--max-memory)"


def test_rlimit_as_is_seen():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2**31, 2**31)); "
            "from tfcli.guard import available; b = available(); print(b.source, b.bytes)")
    source, nbytes = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.split()
    assert source == "RLIMIT_AS" and 0 < int(nbytes) < 2**31


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    tmp_path.mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return _cgroup_available(str(proc), str(tmp_path / "fs"))


def test_cgroup_v2_and_v1_limits(tmp_path):
    assert _cgroup(tmp_path / "a", "0::/job", {"job/memory.max": "1000\n",
                                              "job/memory.current": "300\n"}) == 700
    assert _cgroup(tmp_path / "b", "0::/", {"memory.max": "max\n",
                                           "memory.current": "300\n"}) is None
    # v1, the process's path absent inside the container: the mount's root holds the files
    assert _cgroup(tmp_path / "c", "4:memory:/docker/abc", {
        "memory/memory.limit_in_bytes": "5000", "memory/memory.usage_in_bytes": "6000"}) == 0
    assert _cgroup(tmp_path / "d", "4:memory:/", {
        "memory/memory.limit_in_bytes": str(2**63 - 4096),
        "memory/memory.usage_in_bytes": "1"}) is None


def test_attention_closed_form():
    # q, k, v, out (+1 for the row statistics) per head and position; two L x L for naive fwd
    assert attention_cell_bytes("naive", "fwd", 1, 1, 2, 4, 4) == (4 * (2 * 4 + 1) + 16 * 2) * 4
    assert attention_cell_bytes("sdpa-flash", "fwd", 1, 1, 2, 4, 4) == 4 * (2 * 4 + 1) * 4
    naive, fused = (attention_cell_bytes(k, "fwdbwd", 1, 8, 64, 2**17, 2)
                    for k in ("naive", "sdpa-flash"))
    assert naive > 2**40 and fused < 2**31  # quadratic against linear at L = 131072


def test_model_estimate_grows_with_the_batch_and_counts_weights():
    from tfcli.guard import model_run_bytes
    from tfcli.model.counting import count_params
    from tfcli.model.presets import get_preset
    from tfcli.subjects.own import OwnSubject

    cfg = get_preset("tiny")
    subject = OwnSubject(cfg)
    small, how = model_run_bytes(subject, {"B": 2, "S": 9, "T": 7})
    large, _ = model_run_bytes(subject, {"B": 2000, "S": 9, "T": 7})
    weights = count_params(cfg).total * 4
    assert small > 2 * weights * 0.9 and "activations" in how
    assert 500 < (large - small) / (small - 2 * weights) < 1500  # ~linear in B


def test_a_cell_that_does_not_fit_is_a_skipped_record():
    from tfcli.bench.sweep import Spec, Sweep

    spec = Spec("attention", [16, 32], ["naive", "sdpa"], ["fwd"], ["cpu"], ["fp32"], heads=2,
                head_dim=8, min_time=0.005, max_time=0.02, max_memory=4096)
    records = Sweep(spec).run()
    statuses = {(r.seq_len, r.kernel): r.status for r in records}
    assert statuses[(32, "naive")].startswith("skipped: needs ")
    assert statuses[(32, "naive")].endswith("4 KiB available (--max-memory)")
    assert len(records) == 4  # the sweep went on past it


def test_a_run_without_backward_is_not_charged_for_gradients(cli):
    """Issue 25: the guard charged gradients to forward-only runs and refused runs that fit.
    A forward that autograd records (shapes without --backward) keeps the step's activations
    but makes no gradients; a no_grad forward (bench's fwd) keeps only its own peak."""
    from tfcli.guard import model_run_bytes
    from tfcli.model.counting import count_params
    from tfcli.model.presets import get_preset
    from tfcli.subjects.own import OwnSubject

    cfg = get_preset("tiny")
    subject, dims = OwnSubject(cfg), {"B": 2, "S": 9, "T": 7}  # shapes' default sizes
    step, _ = model_run_bytes(subject, dims, run="step")
    forward, how = model_run_bytes(subject, dims, run="forward")
    inference, _ = model_run_bytes(subject, dims, run="inference")
    assert step - forward == 4 * count_params(cfg).total and "gradients" not in how
    assert inference < forward
    limit = f"{(step + forward) // 2}B"
    assert cli("shapes", "-p", "tiny", "--device", "cpu", "--max-memory", limit).exit_code == 0
    refused = cli("shapes", "-p", "tiny", "--device", "cpu", "--max-memory", limit, "--backward")
    assert refused.exit_code == 2 and "gradients" in refused.stderr
