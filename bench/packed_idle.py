"""What freeing the fast decoder's packed weights between batches costs a server: one engine (``compile_step``, as
bench/against_vllm.py runs it), bench/engine.py's fixed batches and its GRPO case, 128 new tokens, each batch
decoded with the weights freed at the end of the batch before it (``release_idle=True``, a training run's engine:
each batch packs them again) and with them kept (``release_idle=False``, strop serve), interleaved A B then B A per
round. Also the two parts of that work alone: freeing the copies and packing them again.

    python bench/packed_idle.py [--dtype float32] [--batch 32 64] [--rounds 2]

Prints the CPU, then per case and round both rates (tokens per second) and kept / freed, then per case the ratio
of the best rounds and of the summed times.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODEL = "embedded:smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from engine import make_cases, strop_generate
    from limits import cpu_line

    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine

    logging.disable(logging.WARNING)
    print(cpu_line(), flush=True)
    tok = load_tokenizer(MODEL)
    _, cases = make_cases(tok, argparse.Namespace(batch=args.batch))
    model = load_model(MODEL).to(dtype=getattr(torch, args.dtype)).eval()
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True)
    for _case, prompts, _stop, n in cases:  # (the compiles happen here)
        strop_generate(engine, [p for p in prompts for _ in range(n)], 8, eos=None)

    def timed(case, keep: bool, seed0: int) -> tuple[int, float]:
        _name, prompts, stop, n = case
        batch = [p for p in prompts for _ in range(n)]
        engine.release_idle = not keep
        if keep:  # the batch before it kept them (a short one, not timed)
            strop_generate(engine, batch[:1], 1, eos=None)
        else:
            engine._fast.release()  # what the batch before it did at its end
        return strop_generate(engine, batch, args.new_tokens, eos=stop, seed0=seed0)

    fast, packing, freeing = engine._fast, [], []
    for _ in range(5):  # the work a freed batch adds, alone: freeing the copies, then fusing and packing again
        t = time.perf_counter()
        fast.release()
        freeing.append(time.perf_counter() - t)
        t = time.perf_counter()
        fast._sync(64)  # (the rows of a full batch: MKL packs per row count, oneDNN for every count)
        packing.append(time.perf_counter() - t)
    print(f"{args.dtype}, {args.new_tokens} new tokens, {engine.decode_path}")
    print(
        f"freeing the fused and packed weights: {statistics.median(freeing):.3f} s, fusing and packing them again: "
        f"{statistics.median(packing):.3f} s (medians of 5)"
    )
    print("| case | round | kept tok/s | freed tok/s | kept / freed |")
    print("|---|---|---|---|---|")
    for case in cases:
        best, total = {True: 0.0, False: 0.0}, {True: [0, 0.0], False: [0, 0.0]}
        for r in range(args.rounds):
            rate = {}
            for keep in (True, False) if r % 2 == 0 else (False, True):
                tokens, seconds = timed(case, keep, seed0=100 * r)
                rate[keep] = tokens / seconds
                best[keep] = max(best[keep], rate[keep])
                total[keep][0] += tokens
                total[keep][1] += seconds
            print(f"| {case[0]} | {r + 1} | {rate[True]:.0f} | {rate[False]:.0f} | {rate[True] / rate[False]:.3f} |")
        summed = (total[True][0] / total[True][1]) / (total[False][0] / total[False][1])
        print(
            f"| {case[0]} | best / summed | {best[True]:.0f} | {best[False]:.0f} | "
            f"{best[True] / best[False]:.3f} / {summed:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
