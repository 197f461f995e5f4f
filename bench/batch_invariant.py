"""What batch invariance costs the embedded engine: decode throughput with ``batch_invariant`` off and
on, at 16 and 44 concurrent requests, interleaved (off, on, off, on: ``--rounds`` rounds) so drift in
the machine's load falls on both sides, with the ratio of each pair.

Two workloads: distinct chat prompts of different lengths, and GRPO-shaped groups of 8 samples sharing
a prompt (prefilled once); in the invariant mode each row attends in a call of its own. Every request samples with its own seed at temperature 1, exactly
``--new-tokens`` tokens (stop tokens disabled). Before timing, it checks on this model that a request
decodes bitwise the same alone and as a middle row of the largest batch.

    python bench/batch_invariant.py [--model embedded:smollm2-135m-instruct] [--batch 16 44] [--new-tokens 64]
                                    [--rounds 2] [--groups 1 8]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch


def prompts_for(tok, n: int, group: int) -> list[list[int]]:
    """``n`` chat prompts; ``group`` > 1: n / group distinct prompts, each repeated ``group`` times."""
    topics = ["a prime", "the moon", "tea", "rivers", "a poem", "sorting", "bread", "clocks", "rain", "chess"]
    distinct = []
    for i in range(-(-n // group)):
        words = " ".join(["please"] * (i % 7))  # different lengths
        msg = f"Tell me {words} something about {topics[i % len(topics)]} number {i}."
        ids = tok.apply_chat_template(
            [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        distinct.append(list(ids))
    return [distinct[i // group] for i in range(n)]


def run(engine, prompts, new_tokens: int) -> tuple[int, float, list]:
    from strop.types import SamplingParams

    sps = [
        SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1000 + i, stop_token_ids=[-1])
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = engine.generate_batch(prompts, sps)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t, outs


def check(engine, prompts, new_tokens: int) -> bool:
    """The middle request alone and in the batch: the same tokens and logprobs, bitwise."""
    from strop.types import SamplingParams

    mid = len(prompts) // 2
    _, _, outs = run(engine, prompts, new_tokens)
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1000 + mid, stop_token_ids=[-1])
    alone = engine.generate_batch([prompts[mid]], sp)[0]
    return alone.token_ids == outs[mid].token_ids and torch.equal(
        torch.tensor(alone.logprobs), torch.tensor(outs[mid].logprobs)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 44])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 8], help="samples per prompt (1: distinct prompts)")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine

    tok = load_tokenizer(args.model)
    model = load_model(args.model).float().eval()
    width = max(args.batch)
    engines = {
        mode: EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=width, batch_invariant=mode == "on")
        for mode in ("off", "on")
    }
    print(f"model {args.model}, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens per request")
    for mode, e in engines.items():
        same = check(e, prompts_for(tok, width, 1), 16)
        print(f"batch_invariant={mode}: middle of {width} == alone (tokens and logprobs, bitwise): {same}")
    run(engines["off"], prompts_for(tok, 4, 1), 4)  # warm up both
    run(engines["on"], prompts_for(tok, 4, 1), 4)
    print(f"{'workload':<22}{'round':>6}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}")
    for group in args.groups:
        label = "distinct prompts" if group == 1 else f"groups of {group}"
        for n in args.batch:
            prompts = prompts_for(tok, n, group)
            for r in range(args.rounds):
                rate = {}
                for mode in ("off", "on"):
                    tokens, dt, _ = run(engines[mode], prompts, args.new_tokens)
                    rate[mode] = tokens / dt
                print(
                    f"{f'{label}, {n}':<22}{r + 1:>6}{rate['off']:>11.1f}{rate['on']:>10.1f}"
                    f"{rate['on'] / rate['off']:>8.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
