"""Speculative decoding (engine.speculative) against decoding without it, side by side in one run.

Part 1, the engine alone (``--part engine``): the embedded SmolLM2-135M (fp32) generates the quickstart's
rollout, 8 prompts x 8 samples (``--prompts``, ``--samples``) at temperature 0.8, up to 48 tokens, each seeded:
after a warm-up rollout on other prompts, one on new prompts (an RL step's: drafts from the prompt and the
siblings only), then the same prompts again (drafting from the earlier responses too). Engines: the default decoder, the batch-invariant one
(what speculation verifies on), and speculation with 4 drafted tokens; each in a fresh process, alternating
(A B C A B C) over ``--rounds`` rounds. Printed: seconds per rollout, the speed-up against the default, the
acceptance rate and tokens per forward pass, and whether every token and logprob of the speculative engine equals
the batch-invariant engine's (the exactness check, on the real model); a batch of more than 32 rows does not
speculate, and there they must equal the default engine's.

Part 2, whole runs (``--part quickstart``): ``strop train`` with and without ``--engine.speculative=4``,
alternating, ``--rounds`` rounds: ``rollout_seconds`` per step and the speculation metrics. Pass the preset or
other arguments after ``--`` (``-- --preset=tool_python`` for the multi-turn preset).

    python bench/speculative.py --part engine [--rounds 2] [--k 4] [--prompts 8 --samples 8]
    python bench/speculative.py --part quickstart [--rounds 2] [-- --train.steps=6]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time

ENGINES = ("default", "batch-invariant", "speculative")


def child(args) -> None:
    import asyncio
    import logging

    logging.disable(logging.WARNING)
    import torch

    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    tok = load_tokenizer(EMBEDDED_MODEL)
    model = load_model(EMBEDDED_MODEL).requires_grad_(False)
    kw = {"batch-invariant": {"batch_invariant": True}, "speculative": {"speculative": args.k}}.get(args.engine, {})
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, default_stop_token_ids=[tok.eos_token_id], **kw)

    def prompt_set(offset):
        return [
            tok.apply_chat_template(
                [{"role": "user", "content": f"Calculate {3 * k + 17 + offset} + {(k * 29) % 50 + 8}."}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            for k in range(args.prompts)
        ]

    async def rollout(prompts):
        reqs = [
            engine.generate(p, SamplingParams(temperature=0.8, max_new_tokens=48, seed=1000 * k + i))
            for k, p in enumerate(prompts)
            for i in range(args.samples)
        ]
        return await asyncio.gather(*reqs)

    out = {"seconds": [], "stats": [], "digest": []}
    torch.manual_seed(0)
    asyncio.run(rollout(prompt_set(100)))  # warm-up: the engine's first rollout, on other prompts
    engine.take_speculation_stats()
    for prompts in (prompt_set(0), prompt_set(0)):  # new prompts (as each RL step's), then the same ones again
        t = time.perf_counter()
        done = asyncio.run(rollout(prompts))
        out["seconds"].append(time.perf_counter() - t)
        out["stats"].append(engine.take_speculation_stats())
        out["digest"].append(hashlib.sha256(repr([(c.token_ids, c.logprobs) for c in done]).encode()).hexdigest())
        out["tokens"] = sum(len(c.token_ids) for c in done)
    print(json.dumps(out))


def part_engine(args) -> None:
    from limits import measure

    print(measure().describe())
    print(
        f"{args.prompts} prompts x {args.samples} samples, temperature 0.8, <= 48 tokens, seeded; engines "
        f"alternating, {args.rounds} rounds"
    )
    rows = {e: [] for e in ENGINES}
    for _ in range(args.rounds):
        for e in ENGINES:
            cmd = [sys.executable, __file__, "--engine", e, "--k", str(args.k)]
            cmd += ["--prompts", str(args.prompts), "--samples", str(args.samples)]
            rows[e].append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
    from strop.serving.speculative import Speculator

    # what speculation must equal bitwise: batch-invariant decoding where the batch drafts, else the default decoder
    reference = "batch-invariant" if Speculator(args.k).drafts_at(args.prompts * args.samples) else "default"
    print(
        f"| engine | rollout | s (per round) | vs default, same round | acceptance | tokens/forward | = {reference} |"
    )
    print("|---|---|---|---|---|---|---|")
    for e, rs in rows.items():
        for n, what in enumerate(("new prompts", "same again")):
            secs = ", ".join(f"{r['seconds'][n]:.2f}" for r in rs)
            ratio = ", ".join(f"{d['seconds'][n] / r['seconds'][n]:.2f}x" for r, d in zip(rs, rows["default"]))
            st = [r["stats"][n] for r in rs if r["stats"][n]]
            acc = f"{statistics.fmean(s['spec_acceptance_rate'] for s in st):.2f}" if st else "-"
            tpf = f"{statistics.fmean(s['spec_tokens_per_forward'] for s in st):.2f}" if st else "-"
            same = all(r["digest"][n] == b["digest"][n] for r, b in zip(rs, rows[reference]))
            same = "-" if e != "speculative" else "yes" if same else "NO"
            print(f"| {e} | {what} | {secs} | {ratio} | {acc} | {tpf} | {same} |")


def part_quickstart(args, extra: list[str]) -> None:
    from common import off_on_runs

    got = {}
    for k, name, wall, rows, evals in off_on_runs(
        "strop-spec-", args.rounds, [f"--engine.speculative={args.k}"], [], extra
    ):
        if not got:
            print("| run | rollout s per step | vs off, same round | acceptance | tokens/forward | held-out | wall s |")
            print("|---" * 7 + "|")
        steps = [r for r in rows if "rollout_seconds" in r]
        got[name] = statistics.fmean(r["rollout_seconds"] for r in steps)
        spec = [r for r in steps if "spec_acceptance_rate" in r]
        acc = f"{statistics.fmean(r['spec_acceptance_rate'] for r in spec):.2f}" if spec else "-"
        tpf = f"{statistics.fmean(r['spec_tokens_per_forward'] for r in spec):.2f}" if spec else "-"
        print(
            f"| {name} {k + 1} | {got[name]:.2f} | {got['off'] / got[name]:.2f}x | {acc} | {tpf} | "
            f"{evals[0]:.1%} -> {evals[-1]:.1%} | {wall:.0f} |"
        )


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["engine", "quickstart"], default="engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="drafted tokens per row")
    ap.add_argument("--prompts", type=int, default=8, help="engine part: prompts per rollout")
    ap.add_argument("--samples", type=int, default=8, help="engine part: samples per prompt")
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # child only
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.engine:
        return child(args)
    if args.part == "engine":
        part_engine(args)
    else:
        part_quickstart(args, extra)


if __name__ == "__main__":
    main()
