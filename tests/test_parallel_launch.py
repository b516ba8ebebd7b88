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
import textwrap
import time
from pathlib import Path

import pytest

import background

ROOT = Path(__file__).resolve().parents[1]


def _ranks_of(pid: int) -> list[int]:
    """Live ``python -m tfcli.parallel.launch`` children of ``pid`` (zombies are ended)."""
    out = subprocess.run(["ps", "--ppid", str(pid), "-o", "pid=,stat=,args="],
                         capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines()
            if "tfcli.parallel.launch" in line and line.split()[1][0] != "Z"]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _threads(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("Threads:")))


@pytest.fixture(scope="module")
def torchrun():
    return background.result("torchrun")


@background.job("torchrun")
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
    for name, value in {**TORCHRUN_ENV, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    result = cli("bench", "-p", "tiny", "--seq-lens", "16", *args)
    assert result.exit_code == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    monkeypatch.setenv("RANK", "1")  # the other ranks refuse too, without a word
    result = cli("bench", "-p", "tiny", "--seq-lens", "16", *args)
    assert result.exit_code == 2 and result.stderr.strip() == ""


def test_context_parallelism_is_refused_in_one_line(cli):
    result = cli("bench", "--what", "model", "-p", "tiny", "--nproc", "2", "--strategy", "cp",
                 "--batch-size", "2", "--seq-lens", "16")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--strategy cp: not benchmarked; torch's context_parallel shards only the CUDA" in \
        result.stderr


PLANTED = "open(__file__ + '.ran', 'w').close()\nraise SystemExit('planted module imported')\n"


def test_a_killed_rank_is_named_and_no_rank_is_left(tmp_path, monkeypatch):
    """Rank 1 dies by SIGKILL (as by the OOM killer), writing no traceback, while rank 0 waits
    in an all-reduce: rank 1 is named, and rank 0 is ended. Modules planted in the current
    directory under the names the ranks import (issue 25) are never imported by a rank."""
    from tfcli.parallel.launch import RankError, run_ranks
    from tfcli.parallel.workers import fail_rank

    for name in ("json", "torch", "tfcli", "faulthandler"):
        (tmp_path / f"{name}.py").write_text(PLANTED)
    monkeypatch.chdir(tmp_path)
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 of 2 failed: killed by signal 9") as error:
        run_ranks(fail_rank, 2, (1, False, True), timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".ran") == []
    assert error.value.rank == 1 and error.value.exit_code == 1
    # start-up + a few seconds: noticed, not left to the 120 s deadline
    assert time.monotonic() - start < 60
    assert _ranks_of(os.getpid()) == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads the sockets from Linux's /proc")
def test_ranks_listen_on_the_loopback_interface_only():
    """Issue 25: the rendezvous store and the backend listen on 127.0.0.1, not on every
    interface (torch's own TCPStore would bind the unspecified address)."""
    from tfcli.parallel.launch import run_ranks
    from tfcli.parallel.workers import listening_sockets

    found = run_ranks(listening_sockets, 2, timeout=60)
    assert found[0], found  # rank 0 holds the store at least
    addresses = {a.rsplit(":", 1)[0] for rank in found for a in rank}
    assert addresses <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, found


def test_a_hung_rank_is_named_not_the_rank_waiting_for_it():
    """Rank 1 sleeps while rank 0 waits in an all-reduce: at the deadline their stacks say
    which one the other waits for. The deadline counts from when both have joined, so its 4 s
    need only cover rank 0 reaching its all-reduce."""
    from tfcli.parallel.launch import RankError, run_ranks
    from tfcli.parallel.workers import fail_rank

    with pytest.raises(RankError) as error:
        run_ranks(fail_rank, 2, (1, True), timeout=4)
    assert error.value.rank == 1
    assert str(error.value).startswith("rank(s) 1 of 2 did not finish within 4 s (rank 1 at ")
    assert "in fail_rank); rank(s) 0 waited for it in a collective" in str(error.value)
    assert _ranks_of(os.getpid()) == []


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


def test_ranks_end_when_the_launcher_is_killed():
    """SIGKILL gives the launcher no chance to end its ranks (one asleep, one in a collective):
    they notice that their parent is gone and end themselves."""
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        from tfcli.parallel.launch import run_ranks
        from tfcli.parallel.workers import fail_rank
        run_ranks(fail_rank, 2, (1, True), timeout=120)
        """)])
    try:
        deadline = time.monotonic() + 60
        # both in the process group (gloo's threads started): one in all_reduce, one asleep
        while not (len(ranks := _ranks_of(launcher.pid)) == 2 and
                   all(_threads(pid) >= 5 for pid in ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks) == 2 and all(_threads(pid) >= 5 for pid in ranks)
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in ranks)


@pytest.fixture(scope="module")
def comm_counts():
    return background.result("comm_counts")


@background.job("comm_counts")
def _comm_counts() -> subprocess.CompletedProcess:
    code = textwrap.dedent("""
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
        print(json.dumps(out))
        """)
    return background.run([sys.executable, "-c", code], 120, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def test_collective_counter_agrees_with_comm_debug_mode(comm_counts):
    """On the fake process group (world 2, one process): per collective, the calls that bench's
    dispatch counter sees in one FSDP2 or tensor-parallel step equal CommDebugMode's. Each
    layer's dropout module (p = 0) is taken out first: CommDebugMode's module tracker fails on a
    module called twice in one forward."""
    done = comm_counts
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for strategy, (own, theirs) in out.items():
        assert own == theirs and own, (strategy, own, theirs)
    assert set(out["fsdp"][0]) == {"_allgather_base_", "_reduce_scatter_base_"}
    assert set(out["tp"][0]) == {"all_reduce"}


def test_a_stopped_rank_is_named_not_the_rank_waiting_for_it():
    """Issue 25: a rank stopped by SIGSTOP cannot dump its stack, and the launcher named the
    rank waiting for it in a collective. A stopped rank is named as stopped, and ended."""
    from tfcli.parallel.launch import RankError, run_ranks
    from tfcli.parallel.workers import fail_rank

    start = time.monotonic()
    with pytest.raises(RankError) as error:
        run_ranks(fail_rank, 2, (1, False, False, True), timeout=3)
    assert error.value.rank == 1
    assert str(error.value).startswith("rank(s) 1 of 2 did not finish within 3 s (rank 1 is "
                                       "stopped (SIGSTOP or SIGTSTP")
    assert "rank(s) 0 waited for it in a collective" in str(error.value)
    assert _ranks_of(os.getpid()) == []
    assert time.monotonic() - start < 60
