"""Routing replay (R3): the train/rollout logprob gap of a routed-experts model with and without replay, beside a
dense model of the same shape, in one run.

The engine (strop's embedded decoder) samples ``--rows`` responses of ``--new-tokens`` tokens (temperature 1, stop
tokens off) from distinct prompts; the trainer, on the same weights in fp32, computes the logprobs of the same tokens
(its old-logprob pass) with the replayed routes and with its live router. The engine runs in fp32, then in bf16 (its
kernels round differently, so more router decisions sit on the other side of a near tie). Printed per row: the
mean and largest |trainer - engine| logprob over response tokens, the fraction of tokens off by more than 1e-3, and
the fraction of router decisions where the trainer's live router disagrees with the engine's (the trainer
measures it with replay and without).

Models: bench/moe_decode.py's small Qwen3-MoE (hidden 512, 8 layers, 32 experts of 256, 4 per token) and a dense
Qwen3 with the same attention and an MLP of 4 x 256 (its active width).

    python bench/moe_replay.py [--rows 16] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_decode import SHAPE, small_moe  # noqa: E402


def small_dense():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE)).float().eval()


def rollout(model, dtype, rows, new_tokens):
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import Sample, SamplingParams, Status

    engine = EmbeddedEngine(copy.deepcopy(model).to(dtype), pad_token_id=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 16000, (24,), generator=g).tolist() for _ in range(rows)]
    samplings = [
        SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i, stop_token_ids=[-1]) for i in range(rows)
    ]
    samples = []
    for i, (p, c) in enumerate(zip(prompts, engine.generate_batch(prompts, samplings))):
        s = Sample(prompt="", prompt_ids=p, group_id=i)
        s.apply_completion(c)
        s.status, s.reward = Status.COMPLETED, 0.0
        samples.append(s)
    return samples


def gap(model, samples, replay: bool) -> dict[str, float]:
    from strop.algo.config import AlgoConfig
    from strop.observe.metrics import StepStats
    from strop.parallel.strategy import SingleProcess
    from strop.train.config import TrainConfig
    from strop.train.trainer import Sampling, Trainer

    trainer = Trainer(
        copy.deepcopy(model),
        pad_token_id=0,
        train=TrainConfig(micro_batch_size=8, shared_prefix=False),
        algo=AlgoConfig(routing_replay=replay),
        rollout=Sampling(max_new_tokens=10**4),
        parallel=SingleProcess("cpu"),
    )
    diffs = []
    with torch.no_grad():
        for k in range(0, len(samples), 8):
            batch = trainer._collate(samples[k : k + 8])
            lp = trainer._logprobs(trainer.policy, batch, replay=True)[0]
            mask = batch["loss_mask"] > 0
            diffs.append((lp - batch["rollout_logprobs"]).abs()[mask])
    d = torch.cat(diffs)
    out = {"mean": d.mean().item(), "max": d.max().item(), "over_1e-3": (d > 1e-3).float().mean().item()}
    if trainer.replay is not None:
        stats = StepStats()
        trainer.replay.count_into(stats)
        out["disagree"] = stats.result()["routing_disagreement"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    moe, dense = small_moe(), small_dense()
    print(
        f"{'engine':>8} {'model':>6} {'trainer':>10} {'mean |gap|':>11} {'max |gap|':>10} {'>1e-3':>7} {'router disagrees':>17}"
    )
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        samples = rollout(moe, dtype, args.rows, args.new_tokens)
        for replay in (True, False):
            r = gap(moe, samples, replay)
            dis = f"{r['disagree']:.4%}" if "disagree" in r else "-"
            who = "replay" if replay else "live"
            print(f"{name:>8} {'moe':>6} {who:>10} {r['mean']:11.2e} {r['max']:10.2e} {r['over_1e-3']:7.2%} {dis:>17}")
        r = gap(dense, rollout(dense, dtype, args.rows, args.new_tokens), False)
        print(f"{name:>8} {'dense':>6} {'-':>10} {r['mean']:11.2e} {r['max']:10.2e} {r['over_1e-3']:7.2%} {'-':>17}")


if __name__ == "__main__":
    main()
