"""tfcli bench --nproc's launcher and torchrun: ranks under torchrun (one JSON document, from rank
0), --nproc against WORLD_SIZE, a killed rank named, no rank outliving a killed launcher, and
the collective counter against torch's CommDebugMode."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import background
from fake_world import script
from rank_scenarios import ranks_of as _ranks_of

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rank_scenarios():
    return background.result("rank_scenarios")


@background.job("rank_scenarios", cost=15, waits=True)
def _rank_scenarios() -> dict:
    """Ranks that fail, hang, stop or lose their launcher (tests/rank_scenarios.py): real ranks
    that spend most of their time waiting, in one process beside the in-process tests."""
    done = background.run([sys.executable, str(ROOT / "tests" / "rank_scenarios.py")], 300,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _scenario(record: dict, name: str) -> dict:
    out = record[name]
    assert "scenario_failed" not in out, out
    return out


@pytest.fixture(scope="module")
def torchrun():
    return background.result("torchrun")


@background.job("torchrun", cost=5)
def _torchrun() -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """``torchrun --nproc-per-node 2 -m tfcli bench`` in a directory of its own: what it
    printed, the CSV it wrote, and the names of every file the directory held after it."""
    where = Path(tempfile.mkdtemp(prefix="tfcli-torchrun-"))
    out_csv = where / "ranks.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "tfcli", "bench", "--what", "model", "-p", "tiny", "--strategy", "fsdp",
           "--backend", "gloo", "--seq-lens", "16", "--batch-size", "2", "--json",
           "--csv", str(out_csv)]
    env = {**background.session_env(), "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    try:
        done = background.run(cmd, 120, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=where, env=env)
        written = out_csv.read_text() if out_csv.exists() else ""
        return done, written, sorted(p.name for p in where.iterdir())
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_torchrun_two_gloo_ranks(torchrun):
    """Each process is one rank (none spawned), parity holds, and only rank 0 prints (one
    JSON document) and writes the CSV."""
    done, written, files = torchrun
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(done.stdout)  # one document: rank 1 printed nothing
    records = document["records"]
    assert [r["rank"] for r in records] == [0, 1]
    for r in records:
        assert r["world_size"] == 2 and r["strategy"] == "fsdp" and r["backend"] == "gloo"
        assert r["parity"] and r["parity_grad_max_abs_err"] < 1e-5, r
        assert r["steps"] == 5 and r["median_s"] > 0 and r["peak_bytes"] > 0
        assert r["comm_counts"]["_allgather_base_"] > 0
    assert document["conditions"]["launch"] == "torchrun"
    rows = list(csv.DictReader(io.StringIO(written)))
    assert [row["rank"] for row in rows] == ["0", "1"]
    assert json.loads(rows[0]["comm_bytes"]) == records[0]["comm_bytes"]
    assert files == ["ranks.csv"]  # nothing else written, no temporary left


TORCHRUN_ENV = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "1"}  # never reached: refused before the process group


@pytest.mark.parametrize("args,message", [
    (["--what", "model", "--nproc", "3"],
     "--nproc 3 under torchrun with WORLD_SIZE=2: leave --nproc out, or make them equal"),
    ([], "under torchrun (WORLD_SIZE=2), bench runs training steps of the model on each rank"),
])
def test_under_torchrun_bad_input_is_one_line_from_rank_0(cli, monkeypatch, args, message):
    import tfcli.parallel.bench

    for name, value in {**TORCHRUN_ENV, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    result = cli("bench", "-p", "tiny", "--seq-lens", "16", *args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("RANK", "1")  # the other ranks refuse too, without a word, after
    monkeypatch.setattr(tfcli.parallel.bench, "REFUSAL_WAIT_S", 0.05)  # a wait (2 s)
    start = time.monotonic()
    result = cli("bench", "-p", "tiny", "--seq-lens", "16", *args)
    assert result.exit_code == 2 and result.stderr.strip() == ""
    assert time.monotonic() - start >= 0.05


def test_context_parallelism_is_refused_in_one_line(cli):
    result = cli("bench", "--what", "model", "-p", "tiny", "--nproc", "2", "--strategy", "cp",
                 "--batch-size", "2", "--seq-lens", "16")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--strategy cp: not benchmarked; torch's context_parallel shards only the CUDA" in \
        result.stderr



def test_a_killed_rank_is_named_and_no_rank_is_left(rank_scenarios):
    """Rank 1 dies by SIGKILL (as by the OOM killer), writing no traceback, while rank 0 waits
    in an all-reduce: rank 1 is named, and rank 0 is ended. Modules planted in the current
    directory under the names the ranks import (issue 25) are never imported by a rank."""
    out = _scenario(rank_scenarios, "killed")
    assert "rank 1 of 2 failed: killed by signal 9" in out["error"], out
    assert out["planted_ran"] == []
    assert out["rank"] == 1 and out["exit_code"] == 1
    # start-up + a few seconds: noticed, not left to the 120 s deadline
    assert out["seconds"] < 60
    assert out["left"] == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads the sockets from Linux's /proc")
def test_ranks_listen_on_the_loopback_interface_only(rank_scenarios):
    """Issue 25: the backend listens on 127.0.0.1, not on every interface, and the ranks meet
    at a file store: torch's TCPStore would bind the unspecified address and send a DNS query
    for 127.0.0.1's name at every connection (seen with strace)."""
    found = _scenario(rank_scenarios, "loopback")["returned"]
    assert [rank["store"] for rank in found] == ["FileStore", "FileStore"], found
    assert all(rank["listening"] for rank in found), found  # gloo's own listener, at least
    addresses = {a.rsplit(":", 1)[0] for rank in found for a in rank["listening"]}
    assert addresses <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, found


def test_a_hung_rank_is_named_not_the_rank_waiting_for_it(rank_scenarios):
    """Rank 1 sleeps while rank 0 waits in an all-reduce: at the deadline their stacks say
    which one the other waits for. The deadline counts from when both have joined, so its 4 s
    need only cover rank 0 reaching its all-reduce."""
    out = _scenario(rank_scenarios, "hung")
    assert out["rank"] == 1, out
    assert out["error"].startswith("rank(s) 1 of 2 did not finish within 4 s (rank 1 at ")
    assert "in fail_rank); rank(s) 0 waited for it in a collective" in out["error"]
    assert out["left"] == []


def test_the_deadline_counts_from_when_every_rank_has_joined():
    """Start-up (a fresh interpreter importing torch, then the rendezvous) has its own
    allowance: a rank that has not joined by then is named as such, and none is left; the run's
    timeout starts only once all have joined, so a slow start cannot eat it."""
    from tfcli.parallel.launch import RankError, run_ranks
    from tfcli.parallel.workers import fail_rank

    with pytest.raises(RankError, match=r"of 2 did not join the process group within 0\.2 s "
                                        r"of starting"):
        run_ranks(fail_rank, 2, (1, True), timeout=120, startup=0.2)  # torch alone takes longer
    assert _ranks_of(os.getpid()) == []


def test_ranks_that_have_not_started_python_yet_are_named_too(tmp_path):
    """At a very early deadline a rank may not have written its stack file yet: the ranks are
    still named (here two processes that never run Python), without a traceback of tfcli's."""
    from tfcli.parallel.launch import RankError, _end, _raise_late

    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(2)]
    try:
        with pytest.raises(RankError, match=r"^rank\(s\) 0, 1 of 2 did not join the process "
                                            r"group within 0\.2 s of starting$"):
            _raise_late(procs, str(tmp_path), 0.2, joined=False)
    finally:
        _end(procs)


def test_ranks_end_when_the_launcher_is_killed(rank_scenarios):
    """SIGKILL gives the launcher no chance to end its ranks (one asleep, one in a collective):
    they notice that their parent is gone and end themselves."""
    out = _scenario(rank_scenarios, "launcher_killed")
    assert out["ranks"] == 2 and out["joined"], out
    assert out["alive_after"] == []


@pytest.fixture(scope="module")
def comm_counts(fake_world):
    return fake_world["comm_counts"]


@script("comm_counts")
def _comm_counts() -> str:
    return """
        import json, warnings
        warnings.simplefilter("ignore")
        import torch.distributed as dist
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from tfcli.parallel.bench import _CollectiveBytes
        from tfcli.parallel.workers import _layers, prepare
        from tfcli.model.presets import get_preset

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        cfg = {**get_preset("tiny").to_dict(), "dropout": 0.0}
        out = {}
        for strategy in ("fsdp", "tp"):
            model, runner, subject, inputs = prepare(0, 2, strategy, cfg, 2, 16)
            for layer in _layers(model):
                del layer.dropout
                layer.dropout = lambda x: x
            step = lambda: subject.loss(inputs(runner)).backward()
            step()  # warm-up: lazy initialisation
            own = _CollectiveBytes()
            with own.mode:
                step()
            with CommDebugMode() as theirs:
                step()
            out[strategy] = [own.calls, {getattr(op, "__name__", str(op)).split(".")[-1]: n
                                         for op, n in theirs.get_comm_counts().items()}]
        dist.destroy_process_group()
        print(json.dumps(out))
        """


def test_collective_counter_agrees_with_comm_debug_mode(comm_counts):
    """On the fake process group (world 2, one process): per collective, the calls that bench's
    dispatch counter sees in one FSDP2 or tensor-parallel step equal CommDebugMode's. Each
    layer's dropout module (p = 0) is taken out first: CommDebugMode's module tracker fails on a
    module called twice in one forward."""
    out = comm_counts
    for strategy, (own, theirs) in out.items():
        assert own == theirs and own, (strategy, own, theirs)
    assert set(out["fsdp"][0]) == {"_allgather_base_", "_reduce_scatter_base_"}
    assert set(out["tp"][0]) == {"all_reduce"}


def test_a_stopped_rank_is_named_not_the_rank_waiting_for_it(rank_scenarios):
    """Issue 25: a rank stopped by SIGSTOP cannot dump its stack, and the launcher named the
    rank waiting for it in a collective. A stopped rank is named as stopped, and ended."""
    out = _scenario(rank_scenarios, "stopped")
    assert out["rank"] == 1, out
    assert out["error"].startswith("rank(s) 1 of 2 did not finish within 3 s (rank 1 is "
                                   "stopped (SIGSTOP or SIGTSTP")
    assert "rank(s) 0 waited for it in a collective" in out["error"]
    assert out["left"] == []
    assert out["seconds"] < 60
