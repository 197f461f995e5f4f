"""Checkpoint save and load of a GRPO trainer on a real model: seconds, size, extra memory.

One process: the policy is loaded, one real GRPO step on synthetic samples fills the AdamW state,
then a checkpoint is saved through the run's own path (strop.checkpoint: trainer state through
torch.distributed.checkpoint, the policy in Hugging Face format, the controller's state, fsync,
rename) and loaded into a fresh trainer, whose weights and optimizer state are compared with the
saved ones bit for bit. The extra memory is the rise of peak RSS (VmHWM, reset just before with
``5 > /proc/self/clear_refs``) against the state that already exists (weights + optimizer).
Loading reads from the page cache the save just filled (a warm read).

    python bench/checkpoint.py [--model embedded:smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS")


def _trainer(model_path):
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import load_model
    from strop.train.trainer import Sampling, Trainer

    torch.manual_seed(0)
    return Trainer(
        load_model(model_path),
        pad_token_id=0,
        train=TrainConfig(micro_batch_size=8, warmup_steps=0),
        algo=AlgoConfig(),
        rollout=Sampling(max_new_tokens=16),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    args = ap.parse_args()
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # large buffers go back to the system when freed
    from common import synthetic_samples

    from strop import checkpoint
    from strop.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    trainer = _trainer(path)
    trainer.step(synthetic_samples())
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    optim = sum(
        t.numel() * t.element_size()
        for s in trainer.policy_opt.optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )
    work = Path(tempfile.mkdtemp(prefix="strop-ckpt-bench-"))
    try:
        weights = trainer.full_weights()  # the run has this copy already (it synced the engine with it)
        before = _reset_peak()
        t0 = time.perf_counter()
        tmp = checkpoint.begin(work, 1)
        checkpoint.save_trainer(tmp, trainer)
        t_trainer = time.perf_counter() - t0
        final = checkpoint.finish(
            work,
            tmp,
            1,
            controller_state={"step": 1},
            weights=weights,
            model=trainer.model,
            tokenizer=tokenizer,
            keep=1,
        )
        t_save = time.perf_counter() - t0
        save_extra = (_kib("VmHWM") - before) / 1024
        sizes = {
            part: sum(f.stat().st_size for f in (final / part).rglob("*") if f.is_file())
            for part in ("trainer", "policy")
        }
        total = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        del weights

        fresh = _trainer(path)
        before = _reset_peak()
        t0 = time.perf_counter()
        checkpoint.load_trainer(final, fresh)
        t_load = time.perf_counter() - t0
        load_extra = (_kib("VmHWM") - before) / 1024
        same = all(torch.equal(a, b) for a, b in zip(trainer.model.parameters(), fresh.model.parameters()))
        for pa, pb in zip(trainer.model.parameters(), fresh.model.parameters()):
            sa, sb = trainer.policy_opt.optimizer.state[pa], fresh.policy_opt.optimizer.state[pb]
            same &= all(torch.equal(sa[k], sb[k]) for k in sa)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    print(
        f"model {args.model}: parameters {params / mib:.0f} MiB, AdamW state {optim / mib:.0f} MiB, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'':34}{'value':>12}")
    for name, value in (
        ("save: trainer state (DCP) s", t_trainer),
        ("save: whole checkpoint s", t_save),
        ("load: trainer state s", t_load),
        ("size: trainer/ MiB", sizes["trainer"] / mib),
        ("size: policy/ (HF) MiB", sizes["policy"] / mib),
        ("size: checkpoint MiB", total / mib),
        ("save: peak RSS rise MiB", save_extra),
        ("load: peak RSS rise MiB", load_extra),
        ("save rise / optimizer state", save_extra * mib / optim),
    ):
        print(f"{name:34}{value:12.2f}")
    print(f"loaded weights and optimizer state bitwise equal: {same}")


if __name__ == "__main__":
    main()
