"""The local launcher (`strop train --nproc N`) and failures on one rank."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from strop.cluster.local import launch

WORKER = textwrap.dedent("""
    import os, sys, time
    rank = int(os.environ["RANK"])
    open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
    if rank == 1:
        sys.stderr.write("x" * 200_000 + "\\nrank one gives up\\n")  # more than a pipe buffer
        sys.stderr.flush()
        sys.exit(3)
    time.sleep(600)  # rank 0 would wait forever (as in a collective whose peer is gone)
""")


@pytest.mark.timeout(60)
def test_a_failed_rank_gets_the_others_killed_and_its_stderr_shown(tmp_path, capfd):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    t0 = time.monotonic()
    code = launch(2, [str(tmp_path)], command=[sys.executable, str(script)], poll_s=0.1)
    elapsed = time.monotonic() - t0
    assert code == 3 and elapsed < 30
    pid0 = int((tmp_path / "pid0").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)  # rank 0 was stopped by the launcher, not left running
    err = capfd.readouterr().err
    assert "rank 1 failed (exit code 3)" in err and "rank one gives up" in err
    assert "strop: then ended: rank 0 (SIGTERM)" in err  # stopped by the launcher


@pytest.mark.timeout(180)
def test_rank_0_set_up_failure_stops_the_workers(tiny_model_dir, tmp_path):
    """Only rank 0 reads the data: its failure must reach rank 1, which is loading the model."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strop.cli",
            "train",
            "--nproc=2",
            f"--model.path={tiny_model_dir}",
            "--data.source=file",
            f"--data.path={tmp_path}",
            f"--run.dir={tmp_path / 'run'}",
            "--parallel.controller_timeout_s=120",
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "is a directory" in proc.stderr
    assert time.monotonic() - t0 < 150
    assert not (tmp_path / "run").exists()


def _wait_for_rank_0(rank, world, timeout_s, work_s):
    from strop.parallel.runtime import Control

    control = Control(timeout_s)
    t0 = time.monotonic()
    try:
        value = control.on_controller(lambda: time.sleep(work_s) or "samples")
    except Exception as exc:  # rank 1 gave up waiting
        return ("error", type(exc).__name__, str(exc)[:200], time.monotonic() - t0)
    return ("ok", value, "", time.monotonic() - t0)


@pytest.mark.timeout(120)
def test_workers_wait_for_rank_0_as_long_as_the_controller_timeout_says():
    """The control channel has its own timeout (parallel.controller_timeout_s), not the collective default."""
    from strop.parallel.launch import run_on_ranks

    waited = run_on_ranks(_wait_for_rank_0, 2, 30.0, 4.0, timeout=60)
    assert waited[1][:2] == ("ok", "samples") and waited[1][3] >= 3.5  # waited through a 4 s "rollout"
    gave_up = run_on_ranks(_wait_for_rank_0, 2, 1.0, 6.0, timeout=60)
    status, kind, text, seconds = gave_up[1]
    assert status == "error" and seconds < 5.0, gave_up[1]  # a 1 s budget is honoured


GROUP_WORKER = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from strop.parallel.runtime import process_group
    with process_group():
        inside = dist.is_initialized() and dist.get_world_size() == 2
        dist.barrier()
    open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}"), "w").write(f"{inside} {dist.is_initialized()}")
""")


@pytest.mark.timeout(120)
def test_the_runs_gloo_group_is_destroyed_when_the_run_ends(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(GROUP_WORKER)
    assert launch(2, [str(tmp_path)], command=[sys.executable, str(script)]) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["True False"] * 2


@pytest.mark.timeout(60)
def test_a_process_group_the_caller_made_is_left_as_it_was(tmp_path):
    import torch.distributed as dist

    from strop.parallel.runtime import process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with process_group():
            pass
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def _where_am_i(rank, world_size):
    import torch.distributed as dist

    return os.environ.get("STROP_TEST_CALLER_VALUE"), os.getcwd(), os.getppid(), dist.get_world_size()


@pytest.mark.timeout(120)
def test_ranks_forked_from_the_server_take_the_callers_environment_and_directory_at_each_call(tmp_path, monkeypatch):
    """run_on_ranks forks its ranks from a server that imported torch once (not spawned: no import per rank), yet
    each call's ranks see the environment and working directory the caller has at that call, not the server's."""
    from strop.parallel.launch import run_on_ranks

    monkeypatch.delenv("STROP_TEST_CALLER_VALUE", raising=False)
    first = run_on_ranks(_where_am_i, 2, timeout=60)  # (starts the server, if no earlier test did)
    assert [r[0] for r in first] == [None, None] and all(r[3] == 2 for r in first)
    monkeypatch.setenv("STROP_TEST_CALLER_VALUE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    second = run_on_ranks(_where_am_i, 2, timeout=60)
    assert [r[:2] for r in second] == [("set after the server started", str(tmp_path))] * 2
    parents = {r[2] for r in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # every rank a child of the same server


def _omp_threads(rank, world_size):
    import torch

    return torch.get_num_threads()


@pytest.mark.timeout(120)
def test_a_variable_only_a_new_process_reads_makes_the_ranks_spawned(monkeypatch):
    """OMP_NUM_THREADS is read when torch loads: a fork of a server that loaded torch without it would ignore it."""
    from strop.parallel.launch import run_on_ranks

    run_on_ranks(_where_am_i, 2, timeout=60)  # (the fork server runs from here on)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run_on_ranks(_omp_threads, 2, timeout=60) == [1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_on_ranks(_omp_threads, 2, timeout=60) == [2, 2]


def _hash(rank, world_size):
    return hash("strop")


@pytest.mark.timeout(120)
def test_the_env_of_a_call_is_in_the_ranks_processes_from_their_start(monkeypatch):
    """PYTHONHASHSEED, like MALLOC_* and OMP_*, is read when a process starts: set later it would change nothing."""
    from strop.parallel.launch import run_on_ranks

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seeded = dict(os.environ, PYTHONHASHSEED="0")
    want = subprocess.run([sys.executable, "-c", "print(hash('strop'))"], env=seeded, capture_output=True, text=True)
    assert run_on_ranks(_hash, 2, env={"PYTHONHASHSEED": "0"}, timeout=60) == [int(want.stdout)] * 2
    assert "PYTHONHASHSEED" not in os.environ  # (the caller's environment as it was)


def _rank_0_done_first(rank, world_size):
    import torch.distributed as dist

    if rank == 1:  # still using the group's store, which rank 0's process holds, after rank 0 returned
        time.sleep(1.0)
        dist.new_group([1])
        dist.distributed_c10d._get_default_store().set("late", "1")
    return rank


@pytest.mark.timeout(120)
def test_rank_0_keeps_the_groups_store_until_every_rank_is_done():
    """A rank that returns has nothing more to do with the group, but rank 0's process holds its store: were it to
    end first, a rank still setting up a subgroup (a device mesh's own dimension, say) would lose the store."""
    from strop.parallel.launch import run_on_ranks

    assert run_on_ranks(_rank_0_done_first, 2, timeout=60) == [0, 1]
