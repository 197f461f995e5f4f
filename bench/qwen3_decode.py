"""The embedded engine's KV-cache decoder on Qwen3 against Llama of the same size (issue 23): two random models
with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads and 3 KV heads of 64, MLP 1536, vocabulary 49152),
one with Qwen3's per-head query/key norms, decoding the same prompts; rounds interleaved (Llama, Qwen3, Llama,
Qwen3, ...) in one run, fp32, sampling at temperature 1 with stop tokens off (every row generates
``--new-tokens``).

    python bench/qwen3_decode.py [--batch 32] [--new-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time

import torch


def models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=64)).eval()
    return {"llama": llama, "qwen3": qwen3}


def main() -> None:
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49000, (40,), generator=g).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[-1])
    engines = {name: EmbeddedEngine(m, pad_token_id=0, default_stop_token_ids=[-1]) for name, m in models().items()}
    for name, e in engines.items():
        assert e._fast is not None, f"{name} is not on the fast path: {e.decode_path}"
        e.generate_batch(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[-1]))  # warm
    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, e in engines.items():
            t = time.perf_counter()
            outs = e.generate_batch(prompts, params)
            seconds = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for o in outs)
            rates[name].append(tokens / seconds)
            print(
                f"round {r + 1} {name:<6} {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.0f} tokens/s",
                flush=True,
            )
    for r in range(args.rounds):
        print(f"round {r + 1}: qwen3 / llama = {rates['qwen3'][r] / rates['llama'][r]:.3f}")


if __name__ == "__main__":
    main()
