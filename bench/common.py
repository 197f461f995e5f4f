"""Shared by the benchmark scripts."""

from __future__ import annotations


def synthetic_samples(n: int = 16, prompt_len: int = 24, response_len: int = 16, group: int = 4, seed: int = 0):
    """``n`` scored samples of random tokens in groups of ``group`` (rewards alternate 0/1)."""
    import torch

    from strop.types import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = Sample(
            prompt="p",
            prompt_ids=torch.randint(3, 40000, (prompt_len,), generator=g).tolist(),
            group_id=i // group,
            index=i % group,
        )
        s.append(torch.randint(3, 40000, (response_len,), generator=g).tolist(), [-3.0] * response_len)
        s.status, s.reward = Status.COMPLETED, float(i % 2)
        out.append(s)
    return out


def quickstart_samples(tok, n: int = 64, response_tokens: int = 48, weight_version: int = -1):
    """``n`` quickstart-sized samples: a ~40-token chat prompt, ``response_tokens`` random tokens with rollout
    logprobs of -1 (sampled at ``weight_version``), random 0/1 rewards, groups of 8."""
    import torch

    from strop.types import Sample, Status

    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"Calculate {i % 9} + {(i * 7) % 9}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        s = Sample(prompt="q", prompt_ids=list(prompt), group_id=i // 8, index=i % 8)
        ids = torch.randint(0, 49152, (response_tokens,), generator=g).tolist()
        s.append(ids, [-1.0] * len(ids), weight_version=weight_version)
        s.status, s.reward = Status.COMPLETED, float(torch.rand(1, generator=g) > 0.5)
        samples.append(s)
    return samples


def timed_train(args: list[str], run_dir, what: str) -> tuple[float, list[dict]]:
    """``strop train ARGS --run.dir=RUN_DIR`` in a process of its own: (wall seconds, metrics.jsonl rows);
    a failed run ends the benchmark with its stderr, naming ``what``."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "strop.cli", "train", *args, f"--run.dir={run_dir}"], capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{what}: strop train failed:\n{proc.stderr[-3000:]}")
    return wall, [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def timed(fn, seconds: list[float]):
    """``fn``, wrapped to append the seconds each call takes to ``seconds`` (a raise is timed too)."""
    import time

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return wrapper


def off_on_runs(prefix: str, rounds: int, flags_on: list[str], flags_off: list[str], extra: list[str]):
    """``strop train`` off and on, alternating, ``rounds`` rounds, each in a run folder of its own: yields
    (round, 'off' or 'on', wall seconds, metrics.jsonl rows, the held-out accuracies); first prints the folder."""
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp(prefix=prefix))
    print(f"strop train {' '.join(extra)}; runs in {root}")
    for k in range(rounds):
        for name, flags in (("off", flags_off), ("on", flags_on)):
            wall, rows = timed_train([*flags, "--run.progress=false", *extra], root / f"{name}-{k + 1}", name)
            yield k, name, wall, rows, [r["eval_accuracy"] for r in rows if "eval_accuracy" in r] or [float("nan")]
