"""`strop train` under torchrun across two nodes (two torchrun agents on loopback) is the `--nproc 2` run."""

import json
import math
import os
import signal
import subprocess
import sys
import uuid

import pytest

from strop.process import free_port
from strop.observe.metrics import reproducible


def _args(model_dir, run_dir):
    return [
        f"--model.path={model_dir}",
        "--data.size=16",
        "--data.eval_size=4",
        "--rollout.prompts_per_step=2",
        "--rollout.n_samples_per_prompt=4",
        "--rollout.max_new_tokens=8",
        "--rollout.reward=tests.plugins:even_token_reward",
        "--train.steps=2",
        "--train.lr=1e-4",
        "--train.warmup_steps=0",
        "--train.micro_batch_size=2",
        "--run.progress=false",
        "--parallel.grad_reduce_bucket_bytes=1048576",
        f"--run.dir={run_dir}",
    ]


def _steps(run_dir):
    return [reproducible(json.loads(x)) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_all(commands, tmp_path, timeout_s):
    """Run ``commands`` at once; each one's (exit code, stdout, stderr). Whatever still runs at the end
    gets SIGTERM (a launcher stops its ranks), then its process group SIGKILL."""
    procs = []
    try:
        for i, command in enumerate(commands):
            out, err = open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")
            procs.append((subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True), out, err))
        for proc, _, _ in procs:
            proc.wait(timeout=timeout_s)
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    results = []
    for proc, out, err in procs:
        out.seek(0), err.seek(0)
        results.append((proc.returncode, out.read(), err.read()))
        out.close(), err.close()
    return results


@pytest.mark.timeout(300)
def test_torchrun_on_two_nodes_equals_nproc_2(tiny_model_dir, tmp_path):
    strop = ["-m", "strop.cli", "train"]
    # two torchrun agents, one rank each, meeting at one c10d rendezvous: what two hosts would run; they
    # share one run directory (shared storage on real hosts), which only global rank 0 writes
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id={uuid.uuid4().hex}",
        "--rdzv-conf=join_timeout=60",
        "--local-addr=127.0.0.1",
        *strop,
        *_args(tiny_model_dir, tmp_path / "torchrun"),
    ]
    nproc = [sys.executable, *strop, "--nproc=2", *_args(tiny_model_dir, tmp_path / "nproc")]
    runs = _run_all([nproc, torchrun, torchrun], tmp_path, timeout_s=200)
    for code, _out, err in runs:
        assert code == 0, err[-3000:]
    talking = [out for _, out, _ in runs[1:] if "strop: run directory" in out]
    assert len(talking) == 1 and "2 processes = data parallel 2 (replicate) x context parallel 1" in talking[0]

    want, got = _steps(tmp_path / "nproc"), _steps(tmp_path / "torchrun")
    assert [r["step"] for r in got if "loss" in r] == [1, 2]
    assert all(k in r for r in got if "loss" in r for k in ("reward_mean", "advantage_mean", "advantage_std"))
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for a, b in zip(want, got):
        for key, value in a.items():  # losses, rewards, advantages, gaps, counts: timing and memory left out
            same = (
                math.isclose(value, b[key], rel_tol=1e-6, abs_tol=1e-9) if isinstance(value, float) else value == b[key]
            )
            assert same, (a["step"], key, value, b[key])
