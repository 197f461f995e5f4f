"""Shared-prefix rows against rows of their own: the quickstart's train step, side by side in one run.

Part 1, the trainer step alone (``--part step``): the embedded SmolLM2-135M, 8 groups x 8 samples, each group
one quickstart prompt (the chat template around "Calculate a + b.", ~40 tokens) and responses of random
tokens whose lengths follow the quickstart's (uniform in [--min-response, --max-response]). Each layout
runs in a fresh process: one warm-up step, then ``--repeats`` timed steps; the layouts alternate
(A B A B ...) over ``--rounds`` rounds. Layouts: padded (micro_batch_size 16, the default before),
packed (max_tokens_per_micro_batch), and shared (the default now), each its tokens forwarded per step.

Part 2, the whole quickstart (``--part quickstart``): ``strop train`` on the embedded default with
``--train.shared_prefix=false`` and with the default, alternating, ``--rounds`` rounds; the mean
``train_seconds`` of steps 2.. and the held-out accuracy of each run.

    python bench/shared_prefix.py --part step [--rounds 2] [--repeats 3]
    python bench/shared_prefix.py --part quickstart [--rounds 2] [-- extra strop train args]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

LAYOUTS = {
    "padded (before)": {"micro_batch_size": 16, "shared_prefix": False},
    "packed 2048": {"max_tokens_per_micro_batch": 2048, "shared_prefix": False},
    "shared (now)": {"micro_batch_size": 16},
}


def samples(tok, groups: int, n: int, lo: int, hi: int, seed: int = 0):
    import torch

    from strop.types import Sample, Status

    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"Calculate {k % 9} + {(k * 7) % 9}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(n):
            R = int(torch.randint(lo, hi + 1, (1,), generator=g))
            ids = torch.randint(0, 49152, (R,), generator=g).tolist()
            s = Sample(prompt="q", prompt_ids=list(prompt), group_id=k, index=i)
            s.append(ids, [-1.0] * R)
            s.status, s.reward = Status.COMPLETED, float(torch.rand(1, generator=g) > 0.5)
            out.append(s)
    return out


def child(args) -> None:
    import logging

    logging.disable(logging.WARNING)
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.train.trainer import Sampling, Trainer

    tok = load_tokenizer(EMBEDDED_MODEL)
    batch = samples(tok, 8, 8, args.min_response, args.max_response)
    train = TrainConfig(**LAYOUTS[args.layout])
    trainer = Trainer(
        load_model(EMBEDDED_MODEL),
        pad_token_id=tok.pad_token_id,
        train=train,
        algo=AlgoConfig(),
        rollout=Sampling(temperature=0.8),
    )
    trainer.step(batch)  # warm-up (allocates AdamW state)
    times, m = [], {}
    for _ in range(args.repeats):
        t = time.perf_counter()
        m = trainer.step(batch)
        times.append(time.perf_counter() - t)
    print(
        json.dumps(
            {
                "seconds": statistics.median(times),
                "forwarded": m["train_tokens_forwarded"],
                "own_rows": sum(s.total_length for s in batch),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "loss": m["loss"],
            }
        )
    )


def part_step(args) -> None:
    from limits import measure

    print(measure().describe())
    print(
        f"8 groups x 8 samples, responses of {args.min_response}-{args.max_response} tokens; median of "
        f"{args.repeats} steps after a warm-up, layouts alternating, {args.rounds} rounds"
    )
    rows: dict[str, list[dict]] = {k: [] for k in LAYOUTS}
    for _ in range(args.rounds):
        for layout in LAYOUTS:
            cmd = [sys.executable, __file__, "--layout", layout, "--repeats", str(args.repeats)]
            cmd += ["--min-response", str(args.min_response), "--max-response", str(args.max_response)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rows[layout].append(json.loads(out))
    base = rows["padded (before)"]
    print("| layout | train step s (per round) | vs padded (per round) | tokens forwarded | peak RSS MiB | loss |")
    print("|---|---|---|---|---|---|")
    for layout, rs in rows.items():
        secs = ", ".join(f"{r['seconds']:.2f}" for r in rs)
        ratio = ", ".join(f"{b['seconds'] / r['seconds']:.2f}x" for r, b in zip(rs, base))
        print(
            f"| {layout} | {secs} | {ratio} | {rs[0]['forwarded']:.0f} of {rs[0]['own_rows']} | "
            f"{max(r['peak_rss_mib'] for r in rs):.0f} | {rs[0]['loss']:.6f} |"
        )


def part_quickstart(args, extra: list[str]) -> None:
    from common import off_on_runs

    runs = off_on_runs("strop-shared-", args.rounds, [], ["--train.shared_prefix=false"], extra)
    header = (
        "| run | train s per step (steps 2..) | vs off, same round | tokens forwarded per step | held-out 0 -> last |"
    )
    got = {}
    for k, name, wall, rows, evals in runs:
        if not got:
            print(header + " wall s |\n" + "|---" * 6 + "|")
        steps = [r for r in rows if "train_seconds" in r][1:]
        got[name] = statistics.fmean(r["train_seconds"] for r in steps)
        print(
            f"| {name} {k + 1} | {got[name]:.2f} | {got['off'] / got[name]:.2f}x | "
            f"{statistics.fmean(r['train_tokens_forwarded'] for r in steps):.0f} | "
            f"{evals[0]:.1%} -> {evals[-1]:.1%} | {wall:.0f} |"
        )


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["step", "quickstart"], default="step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-response", type=int, default=8)
    ap.add_argument("--max-response", type=int, default=48)
    ap.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)  # child only
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.layout:
        return child(args)
    if args.part == "step":
        part_step(args)
    else:
        part_quickstart(args, extra)


if __name__ == "__main__":
    main()
