"""The cost of decoupled PPO's proximal policy: recomputed (a no-grad forward over the step before its first
update) against AReaL's log-linear interpolation from the tokens' versions (no forward), issue 24.

Two trainers in one process, each with its own copy of the embedded model, on the same quickstart-sized step:
``--samples`` samples (a ~40-token chat prompt plus ``--response-tokens`` random tokens, rollout logprobs of
-1, every token one weight version old), ``train.mini_batches=2`` (where the proximal policy needs the extra
forward), no behaviour weight (an elementwise weight costs nothing, and ``loglinear`` refuses one: its pi_old is
the rollout's for a token one version old). One warm-up step each, then ``--repeats`` timed steps, interleaved
(A B A B), so a drifting machine slows both alike.

    python bench/proximal.py [--samples 64] [--response-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import logging

    logging.disable(logging.WARNING)
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.train.trainer import Sampling, Trainer

    from common import quickstart_samples

    tok = load_tokenizer(EMBEDDED_MODEL)
    model = load_model(EMBEDDED_MODEL)
    samples = quickstart_samples(tok, args.samples, args.response_tokens)  # every token one version old
    train = TrainConfig(mini_batches=2)
    trainers = {
        name: Trainer(
            copy.deepcopy(model),
            pad_token_id=tok.pad_token_id,
            train=train,
            algo=AlgoConfig(proximal=name),
            rollout=Sampling(temperature=0.8),
        )
        for name in ("recompute", "loglinear")
    }
    for t in trainers.values():
        t.step(samples)  # warm-up (allocates AdamW state)
    times = {name: [] for name in trainers}
    for _ in range(args.repeats):
        for name, trainer in trainers.items():
            t0 = time.perf_counter()
            trainer.step(samples)
            times[name].append(time.perf_counter() - t0)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    rec, lin = (statistics.fmean(times[k]) for k in ("recompute", "loglinear"))
    print(f"samples={args.samples} response_tokens={args.response_tokens} mini_batches=2, mean of {args.repeats}")
    print("| proximal | train step s (each) | mean |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in ts)} | {statistics.fmean(ts):.2f} |")
    print(f"\nthe recompute forward costs {rec - lin:.2f} s per step: recompute = {rec / lin:.2f}x loglinear")


if __name__ == "__main__":
    main()
