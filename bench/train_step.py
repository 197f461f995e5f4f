"""One quickstart-sized trainer step with full logits vs chunked logprobs.

Each variant runs in a fresh subprocess (so peak RSS is its own): load the
embedded model, build ``--samples`` samples (chat prompt of ~40 tokens plus
``--response-tokens`` random response tokens, random rewards in groups of 8),
run one warm-up step, then time ``--repeats`` steps. Peak memory is the
process's peak RSS (ru_maxrss), which includes the model, the engine-free
trainer and AdamW state: the same quantity /usr/bin/time reports for a run.

    python bench/train_step.py [--samples 64] [--response-tokens 48] [--micro-batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(args) -> None:
    import logging

    logging.disable(logging.WARNING)
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.train.trainer import Sampling, Trainer

    from common import quickstart_samples

    tok = load_tokenizer(EMBEDDED_MODEL)
    model = load_model(EMBEDDED_MODEL)
    samples = quickstart_samples(tok, args.samples, args.response_tokens)
    train = TrainConfig(micro_batch_size=args.micro_batch_size, logprob_chunk_size=args.chunk_size)
    trainer = Trainer(
        model, pad_token_id=tok.pad_token_id, train=train, algo=AlgoConfig(), rollout=Sampling(temperature=0.8)
    )
    trainer.step(samples)  # warm-up (allocates AdamW state)
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = trainer.step(samples)
        times.append(time.perf_counter() - t)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    print(
        json.dumps({"seconds": min(times), "peak_rss_mib": peak_mib, "trained": m["trained_samples"], "tokens": tokens})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)  # child only
    args = ap.parse_args()
    if args.chunk_size is not None:
        return child(args)
    from limits import measure, model_shape, train_bound_seconds

    limits, rows = [measure()], {}
    for name, chunk in (("full logits (before)", 0), ("chunked 1024 (after)", 1024)):
        cmd = [
            sys.executable,
            __file__,
            "--chunk-size",
            str(chunk),
            "--samples",
            str(args.samples),
            "--response-tokens",
            str(args.response_tokens),
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--repeats",
            str(args.repeats),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows[name] = json.loads(out)
    limits.append(measure())
    from strop.models import EMBEDDED_MODEL, load_model

    shape, best = model_shape(load_model(EMBEDDED_MODEL)), max(limits, key=lambda lim: lim.flops["float32"])
    print("\n".join(f"{when}: {lim.describe()}" for when, lim in zip(("before", "after"), limits)))
    print(f"samples={args.samples} response_tokens={args.response_tokens} micro_batch_size={args.micro_batch_size}")
    print("| variant | train step s | peak RSS MiB | of the bound (6 x parameters x tokens, fp32 matmul) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        bound = train_bound_seconds(shape, r["tokens"], best)
        print(f"| {name} | {r['seconds']:.2f} | {r['peak_rss_mib']:.0f} | {bound / r['seconds']:.2f} |")
    a, b = rows.values()
    print(
        f"\nafter / before: time {b['seconds'] / a['seconds']:.2f}x, peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
