"""How far the merged weights an engine decodes (``W + (alpha / r) B A``) are from the adapters applied
unmerged, as the trainer runs them: the largest and the mean absolute difference of the next-token
logprobs over a batch of the quickstart's prompts, in float32 and in bfloat16.

The adapters get random B (zero at initialisation would make both sides the base model): N(0, ``--b-std``).

    python bench/lora_numerics.py [--rank 16] [--alpha 32] [--b-std 0.02] [--prompts 8]
"""

from __future__ import annotations

import argparse
import copy

import torch

from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer, resolve_model_path
from strop.train.config import LORA_TARGETS
from strop.train.lora import add_adapters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--b-std", type=float, default=0.02)
    ap.add_argument("--prompts", type=int, default=8)
    args = ap.parse_args()
    path = resolve_model_path(EMBEDDED_MODEL)
    tokenizer = load_tokenizer(path)
    texts = [f"Question: what is {i} + {2 * i + 1}? Think step by step, then answer." for i in range(args.prompts)]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        base = load_model(path, dtype=dtype)
        merged_model = copy.deepcopy(base)
        adapters = add_adapters(base, args.rank, args.alpha, 0.0, list(LORA_TARGETS))
        with torch.no_grad():
            for p in adapters.parameters():
                if p.dim() == 2 and p.shape[1] == args.rank:  # B: (out, r)
                    p.normal_(0, args.b_std)
            merged_model.load_state_dict(adapters.merged_weights())
            out[dtype] = (
                adapters.model(**batch).logits.float().log_softmax(-1),
                merged_model(**batch).logits.float().log_softmax(-1),
            )
    mask = batch["attention_mask"].bool()
    exact = out[torch.float32][0]  # fp32, unmerged: the trainer's numbers in fp32

    def gap(a, b):
        d = (a - b).abs()[mask]
        top = (a.argmax(-1) == b.argmax(-1))[mask].float().mean()
        return f"{d.max().item():12.3e} {d.mean().item():13.3e} {top.item():14.4f}"

    print(f"{'':44} {'max |dlogp|':>12} {'mean |dlogp|':>13} {'same argmax':>14}")
    print(f"{'fp32: unmerged vs merged':44} {gap(*out[torch.float32])}")
    print(f"{'bf16: unmerged vs merged':44} {gap(*out[torch.bfloat16])}")
    print(f"{'bf16 unmerged vs fp32 unmerged (bf16 itself)':44} {gap(out[torch.bfloat16][0], exact)}")
    print(f"{'bf16 merged vs fp32 unmerged':44} {gap(out[torch.bfloat16][1], exact)}")


if __name__ == "__main__":
    main()
