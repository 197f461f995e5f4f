"""Routed experts (Qwen3-MoE) in strop's fast decoder against Hugging Face ``generate``, side by side in one run.

A random-initialised small Qwen3-MoE (hidden 512, 8 layers, 32 experts of 256, 4 per token, vocabulary 16384; about
0.3 B parameters, 50 M active), fp32 on the CPU. Each side decodes ``--batch`` rows of distinct 32-token prompts for
exactly ``--new-tokens`` tokens (stop tokens off, temperature 1), the sides alternating (HF, strop, HF, strop)
``--repeats`` times. Printed: tokens per second, strop over HF in the same repeat, and how many expert choices strop
recorded.

    python bench/moe_decode.py [--batch 1 16] [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch


# the attention and sizes bench/moe_replay.py's dense model shares (its MLP: 4 x 256, the active width)
SHAPE = dict(
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def small_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**SHAPE, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4)
    return Qwen3MoeForCausalLM(config).float().eval()


def hf_side(model, prompts, new_tokens):
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompts),
            attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return (out.shape[1] - len(prompts[0])) * len(prompts), time.perf_counter() - t, 0


def strop_side(engine, prompts, new_tokens):
    from strop.types import SamplingParams

    sps = [
        SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i, stop_token_ids=[-1])
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = engine.generate_batch(prompts, sps)
    dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs), dt, sum(o.routed_experts.numel() for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from limits import cpu_line

    from strop.serving.embedded import EmbeddedEngine

    print(cpu_line())
    model = small_moe()
    params = sum(p.numel() for p in model.parameters())
    print(f"Qwen3-MoE, {params / 1e6:.0f} M parameters, 32 experts, 4 per token; {torch.get_num_threads()} threads")
    engine = EmbeddedEngine(model, pad_token_id=0)
    print(f"strop: {engine.decode_path}")
    print("| repeat | batch | HF tok/s | strop tok/s | strop / HF | routes recorded |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for rep in range(args.repeats):
        for batch in args.batch:
            prompts = torch.randint(10, 16000, (batch, 32), generator=g).tolist()
            hf_side(model, prompts[:1], 4)  # warm-up of each side's first call
            strop_side(engine, prompts[:1], 4)
            n_hf, t_hf, _ = hf_side(model, prompts, args.new_tokens)
            n_s, t_s, routes = strop_side(engine, prompts, args.new_tokens)
            print(
                f"| {rep + 1} | {batch} | {n_hf / t_hf:.1f} | {n_s / t_s:.1f} | {(n_s / t_s) / (n_hf / t_hf):.2f}x | "
                f"{routes} |"
            )


if __name__ == "__main__":
    main()
