"""Generation beside training on one CPU: how the cores are best shared between them.

One process holds the quickstart's trainer (SmolLM2-135M, 64 samples of ~40 prompt + 48 response
tokens) and the embedded engine (its own copy of the weights). Interleaved, in one run:

- ``train``: one trainer step alone;
- ``decode``: the engine decodes 64 rows x 48 tokens alone (8 prompts x 8 samples, no stop token);
- ``both T/E``: the two at once, training in this thread with T torch threads, decoding in another
  with E (torch's thread count is per thread with OpenMP), as the off-policy rollout modes run them.

The ratio ``(train + decode) / both`` is what overlapping can win over running them one after the
other (1.0: nothing).

    python bench/overlap.py [--repeats 2] [--splits 2/2 1/1 2/1 1/2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--splits", nargs="+", default=["2/2", "1/1", "2/1", "1/2"])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the engine's")
    args = ap.parse_args()

    import logging

    import torch

    logging.disable(logging.WARNING)
    from strop.config import AlgoConfig, TrainConfig
    from strop.serving.embedded import EmbeddedEngine
    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.train.trainer import Sampling, Trainer
    from strop.types import Sample, SamplingParams, Status

    cores = torch.get_num_threads()
    tok = load_tokenizer(EMBEDDED_MODEL)
    trainer = Trainer(
        load_model(EMBEDDED_MODEL),
        pad_token_id=tok.pad_token_id,
        train=TrainConfig(),
        algo=AlgoConfig(),
        rollout=Sampling(temperature=0.8),
    )
    engine = EmbeddedEngine(load_model(EMBEDDED_MODEL).to(getattr(torch, args.dtype)), pad_token_id=tok.pad_token_id)
    g = torch.Generator().manual_seed(0)
    prompts, samples = [], []
    for i in range(64):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"Calculate {i // 8} + {(i // 8) * 7 % 9}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        prompts.append(list(prompt))
        s = Sample(prompt="q", prompt_ids=list(prompt), group_id=i // 8, index=i % 8)
        ids = torch.randint(0, 49152, (args.new_tokens,), generator=g).tolist()
        s.append(ids, [-1.0] * len(ids))
        s.status, s.reward = Status.COMPLETED, float(torch.rand(1, generator=g) > 0.5)
        samples.append(s)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=args.new_tokens)

    def train(threads: int) -> float:
        torch.set_num_threads(threads)
        t = time.perf_counter()
        trainer.step(samples)
        return time.perf_counter() - t

    def decode(threads: int, out: list) -> None:
        torch.set_num_threads(threads)
        t = time.perf_counter()
        done = engine.generate_batch(prompts, sampling)
        out.append(time.perf_counter() - t)
        assert sum(len(c.token_ids) for c in done) > 0

    def alone_decode() -> float:
        out: list = []
        th = threading.Thread(target=decode, args=(cores, out))
        th.start()
        th.join()
        return out[0]

    def both(t_threads: int, e_threads: int) -> float:
        out: list = []
        t0 = time.perf_counter()
        th = threading.Thread(target=decode, args=(e_threads, out))
        th.start()
        train(t_threads)
        th.join()
        torch.set_num_threads(cores)
        return time.perf_counter() - t0

    train(cores)  # warm-up: AdamW state, the engine's packed weights
    alone_decode()
    columns = {"train": lambda: train(cores), "decode": alone_decode}
    for split in args.splits:
        t_threads, e_threads = (int(x) for x in split.split("/"))
        columns[f"both {split}"] = lambda t=t_threads, e=e_threads: both(t, e)
    times: dict[str, list[float]] = {k: [] for k in columns}
    for _ in range(args.repeats):  # interleaved: every column once per round
        for name, fn in columns.items():
            times[name].append(fn())
    seq = statistics.fmean(times["train"]) + statistics.fmean(times["decode"])
    print(f"{cores} threads; engine {args.dtype}; rounds: {args.repeats}; seconds per round in order")
    print("column | seconds (each round) | mean | (train + decode) / column")
    for name, ts in times.items():
        mean = statistics.fmean(ts)
        ratio = f"{seq / mean:.2f}x" if name.startswith("both") else "-"
        print(f"{name} | {' '.join(f'{t:.1f}' for t in ts)} | {mean:.1f} | {ratio}")


if __name__ == "__main__":
    main()
