"""The kv-cache decoder's prefill of bench/engine.py's 64 distinct prompts, every prompt forwarded whole against their
common prefix forwarded once (:mod:`strop.serving.prefix`), interleaved, in fp32 and bf16.

    python bench/prefill.py [--rounds 3] [--rows 64]

Prints the CPU, the prompts' lengths and common prefix, seconds per prefill of each way per round and their ratio,
the largest distance between the two ways' logits, and, for those prompts and three other sets of 64 chat prompts,
each way's mean KL divergence from a float64 forward of the same weights (the last position's distribution).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_cases  # noqa: E402
from limits import cpu_line  # noqa: E402


OTHER_SETS = (
    "Name a city whose population is near {n} people and describe it.",
    "Write a haiku about the number {n}.",
    "A train leaves at {n} pm. When does it arrive 100 miles away at 40 mph?",
)


def kl_from_float64(model64, prompts, logits) -> float:
    """Mean KL(float64 || engine) of the next-token distributions after each prompt."""
    with torch.no_grad():
        ref = torch.stack([model64(torch.tensor([p])).logits[0, -1] for p in prompts]).log_softmax(-1)
    return (ref.exp() * (ref - logits.double().log_softmax(-1))).sum(-1).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from strop.models import load_model, load_tokenizer
    from strop.serving.kvdecode import LlamaDecoder
    from strop.serving.linear import PackedLinear
    from strop.serving.prefix import common_prefix, forward_prompts, left_padded

    hf_logging.set_verbosity_error()
    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    tok = load_tokenizer(args.model)
    args.batch, args.new_tokens = [args.rows], 1
    prompts, _ = make_cases(tok, args)
    ids, lengths = left_padded(prompts, tok.pad_token_id)
    print(
        f"{len(prompts)} prompts of {min(lengths.tolist())}-{ids.shape[1]} tokens; common prefix {common_prefix(ids, lengths)}"
    )

    def chat(question):
        message = [{"role": "user", "content": question}]
        return list(tok.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False))

    sets = [prompts] + [[chat(q.format(n=7 * i + 3)) for i in range(64)] for q in OTHER_SETS]
    for name in ("float32", "bfloat16"):
        model = load_model(args.model).to(dtype=getattr(torch, name)).eval()
        model64 = copy.deepcopy(model).double()  # (the same rounded weights: only the arithmetic differs)
        dec = LlamaDecoder(model)
        dec._sync()

        def whole():
            return forward_prompts(dec, ids, lengths, PackedLinear.batched)

        def shared():
            return dec.prefill(ids, lengths)

        with torch.no_grad():
            gap = (whole()[0] - shared()[0]).abs().max().item()  # (also the first calls: packing)
            print(f"\n{name}: largest logit gap whole / shared {gap:.2e}")
            print("| round | whole s | shared s | whole / shared |\n|---|---|---|---|")
            for r in range(args.rounds):
                seconds = []
                for way in (whole, shared):
                    start = time.perf_counter()
                    way()
                    seconds.append(time.perf_counter() - start)
                print(f"| {r + 1} | {seconds[0]:.3f} | {seconds[1]:.3f} | {seconds[0] / seconds[1]:.2f} |", flush=True)
            print("| prompt set | common prefix | KL whole | KL shared |\n|---|---|---|---|")
            for j, chats in enumerate(sets):
                ids_j, lengths_j = left_padded(chats, tok.pad_token_id)
                whole_j = forward_prompts(dec, ids_j, lengths_j, PackedLinear.batched)[0]
                shared_j = dec.prefill(ids_j, lengths_j)[0]
                kls = [kl_from_float64(model64, chats, x) for x in (whole_j, shared_j)]
                print(f"| {j + 1} | {common_prefix(ids_j, lengths_j)} | {kls[0]:.2e} | {kls[1]:.2e} |", flush=True)


if __name__ == "__main__":
    main()
