"""Generation speed side by side: Hugging Face ``generate``, strop's engine before the KV-cache
decoder (``fast_decode=False``), strop's engine now, and vLLM's CPU server (when
``scripts/setup_vllm.sh`` installed it), on the same model, prompts and lengths, all in ``--dtype``
(fp32 by default) on ``--device`` (the CPU by default; on ``cuda`` there is no vLLM column).

Two workloads:
- fixed batches (1, 32, 64 rows; distinct chat prompts; exactly ``--new-tokens`` tokens per row,
  stop tokens disabled, temperature 1);
- GRPO-shaped: 8 prompts x 8 samples (~45-token chat prompts), up to ``--new-tokens`` new tokens,
  stopping at end-of-turn, temperature 1. Lengths differ by engine (sampling), so the table has
  the tokens generated next to the seconds.

vLLM runs last, alone (its CPU engine slows down 2-4x when anything else runs), with both cores
bound, every request sent at once over HTTP.

    python bench/engine.py [--batch 1 32 64] [--new-tokens 128] [--repeats 2] [--no-vllm] [--compiled] [--baseline 0a93335]

``--baseline REV`` adds strop's engine as it was at REV (0a93335 is the engine when the speed issue
was filed; ``strop before`` is today's code with the KV-cache decoder turned off, which shares
today's sampler).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("STROP_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"


def hf_generate(model, tok, prompts, new_tokens, *, eos, n=1):
    tok.padding_side = "left"
    enc = {k: v.to(model.device) for k, v in tok.pad({"input_ids": prompts}, return_tensors="pt").items()}
    kw = dict(min_new_tokens=new_tokens) if eos is None else dict(eos_token_id=eos)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            pad_token_id=tok.pad_token_id,
            num_return_sequences=n,
            **kw,
        )
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    dt = time.perf_counter() - t
    gen = out[:, enc["input_ids"].shape[1] :]
    if eos is None:
        tokens = gen.numel()
    else:  # up to and including the first end-of-turn
        ended = (gen == eos).int()
        whole = torch.full((len(gen),), gen.shape[1], device=gen.device)
        first = torch.where(ended.any(-1), ended.argmax(-1) + 1, whole)
        tokens = int(first.sum())
    return tokens, dt


def strop_generate(engine, prompts, new_tokens, *, eos, seed0=0):
    from strop.types import SamplingParams

    sps = [
        SamplingParams(
            temperature=1.0, max_new_tokens=new_tokens, seed=seed0 + i, stop_token_ids=[-1] if eos is None else [eos]
        )
        for i in range(len(prompts))
    ]
    t = time.perf_counter()
    outs = engine.generate_batch(prompts, sps)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t


class VLLMServer:
    def __init__(self, model_dir: str, port: int, dtype: str = "float32"):
        self.url = f"http://127.0.0.1:{port}"
        env = dict(
            os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_LOGGING_LEVEL="WARNING"
        )
        self.log = open(f"/tmp/bench-vllm-{port}.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(VLLM_PY),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                dtype,
                "--max-num-batched-tokens",
                "8192",
                "--max-model-len",
                "2048",
                "--max-num-seqs",
                "128",
            ],
            stdout=self.log,
            stderr=self.log,
            env=env,
        )
        import urllib.request

        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"vLLM not healthy in 300 s; see {self.log.name}") from None
                time.sleep(1)

    def generate(self, prompts, new_tokens, *, eos, n=1):
        import httpx

        async def main():
            async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
                model = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]

                async def one(p):
                    body = {"model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 1.0, "n": n}
                    if eos is None:
                        body |= {"ignore_eos": True, "min_tokens": new_tokens}
                    r = await client.post(self.url + "/v1/completions", json=body)
                    r.raise_for_status()
                    return r.json()["usage"]["completion_tokens"]

                t = time.perf_counter()
                counts = await asyncio.gather(*(one(p) for p in prompts))
                return sum(counts), time.perf_counter() - t

        return asyncio.run(main())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def case_rates(engine, cases, new_tokens: int = 128, rounds: int = 2) -> list[str]:
    """Tokens per second of each of :func:`make_cases`'s cases on ``engine``, ``rounds`` times each, as table cells."""
    cells = []
    for _case, prompts, stop, n in cases:
        batch = [p for p in prompts for _ in range(n)]
        for r in range(rounds):
            tokens, seconds = strop_generate(engine, batch, new_tokens, eos=stop, seed0=100 * r)
            cells.append(f"{tokens / seconds:.0f}")
    return cells


def make_cases(tok, args):
    def chat(q):
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],
                add_generation_prompt=True,  # noqa: E731
                tokenize=True,
                return_dict=False,
            )
        )

    fixed = [chat(f"What is {3 + 7 * i} plus {11 + 13 * i}? Explain step by step.") for i in range(max(args.batch))]
    grpo = [
        chat(f"A shop sells {4 + i} apples for {12 + 3 * i} dollars. How much do {7 + 2 * i} apples cost?")
        for i in range(8)
    ]
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    cases = [(f"batch {b}", fixed[:b], None, 1) for b in args.batch]
    cases.append(("GRPO 8 prompts x 8", grpo, eos, 8))
    return fixed, cases


def engine_only(args, model, tok, engine) -> None:
    """The baseline's side: this file's cases on the engine imported from the baseline tree, best
    of ``--repeats``, written as JSON."""
    import json

    _, cases = make_cases(tok, args)
    out = {}
    for case, prompts, stop, n in cases:
        rows = [p for p in prompts for _ in range(n)]
        runs = [strop_generate(engine, rows, args.new_tokens, eos=stop) for _ in range(args.repeats)]
        out[case] = max(runs, key=lambda r: r[0] / r[1])
    Path(args.engine_only).write_text(json.dumps(out))


def run_baseline(args) -> dict:
    """Run this script's cases against strop's engine at ``args.baseline`` (a git worktree put first
    on PYTHONPATH, in a subprocess, so both versions never share a process)."""
    import json
    import sys
    import tempfile

    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"strop-engine-{rev}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True, capture_output=True
        )
    out = tree / "engine-only.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--model",
        args.model,
        "--new-tokens",
        str(args.new_tokens),
        "--dtype",
        args.dtype,
        "--repeats",
        str(args.repeats),
        "--batch",
        *map(str, args.batch),
        "--engine-only",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    check = subprocess.run(
        [sys.executable, "-c", "import strop, sys; print(strop.__file__)"],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not check.startswith(str(tree)):
        raise SystemExit(f"the baseline run would import strop from {check}, not from {tree}")
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="add strop's engine with engine.compile_attention (its compile time printed apart)",
    )
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-vllm", action="store_true", help="skip the vLLM column even when it is installed")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="every engine's precision (HF generate, strop, vllm-cpu); the bound uses its matmul rate",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda: HF generate and strop's engine on the GPU, the "
        "bound from the GPU's own matmul rate and bandwidth (no vllm-cpu column there)",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        default=None,
        help="add a column for strop's engine as it was at git revision REV (e.g. 0a93335, the engine "
        "when the speed issue was filed), run from a worktree in a subprocess",
    )
    ap.add_argument("--engine-only", metavar="JSON", default=None, help=argparse.SUPPRESS)  # the baseline's side
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        from strop.serving.embedded import EmbeddedEngine
    except ImportError:  # a baseline tree from before the engine's side of the wire was strop.serving
        from strop.engines.embedded import EmbeddedEngine
    from strop.models import load_model, load_tokenizer, resolve_model_path

    tok = load_tokenizer(args.model)
    model = load_model(args.model).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    width = max(max(args.batch), 64)
    if args.engine_only:  # the strop found on sys.path (a baseline worktree) only
        return engine_only(args, model, tok, EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=width))
    before = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=width, fast_decode=False)
    now = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=width)
    compiled = None
    if args.compiled:  # engine.compile_attention: its compile time is printed apart, not in its column
        compiled = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=width, compile_attention=True)
        from strop.serving.attention import COMPILED

        strop_generate(compiled, [[1, 2, 3]] * COMPILED.from_rows, 4, eos=None)  # (smaller steps do not compile)
        print(f"strop compiled: attention compiled in {COMPILED.seconds:.1f} s {COMPILED.reason}", flush=True)
    fixed, cases = make_cases(tok, args)
    grpo = cases[-1][1]
    from limits import decode_bound, measure, model_shape

    limits = [measure(args.device)]  # (and again at the end: the bound is the better of the two)
    print(
        f"prompt tokens: fixed {min(map(len, fixed))}-{max(map(len, fixed))}, GRPO {min(map(len, grpo))}-"
        f"{max(map(len, grpo))}; new tokens up to {args.new_tokens}; best of {args.repeats}; {args.dtype}",
        flush=True,
    )
    results: dict[str, dict[str, tuple[int, float]]] = {}

    def best(name, case, fn):
        runs = [fn() for _ in range(args.repeats)]
        tokens, secs = max(runs, key=lambda r: r[0] / r[1])
        results.setdefault(case, {})[name] = (tokens, secs)

    for case, prompts, stop, n in cases:
        rows = [p for p in prompts for _ in range(n)]
        best("HF generate", case, lambda: hf_generate(model, tok, prompts, args.new_tokens, eos=stop, n=n))
        best("strop before", case, lambda: strop_generate(before, rows, args.new_tokens, eos=stop))
        best("strop now", case, lambda: strop_generate(now, rows, args.new_tokens, eos=stop))
        if compiled is not None:
            best("strop compiled", case, lambda: strop_generate(compiled, rows, args.new_tokens, eos=stop))
        print(f"  {case}: " + ", ".join(f"{k} {v[0] / v[1]:.1f} tok/s" for k, v in results[case].items()), flush=True)
    engines = ["HF generate", "strop before", "strop now"] + (["strop compiled"] if compiled is not None else [])
    if args.baseline:
        base = f"strop at {args.baseline}"
        for case, got in run_baseline(args).items():
            results[case][base] = tuple(got)
            print(f"  {case}: {base} {got[0] / got[1]:.1f} tok/s", flush=True)
        engines.append(base)
    if not args.no_vllm and VLLM_PY.exists() and args.device == "cpu":
        from strop.process import free_port

        del before, now, compiled
        server = VLLMServer(resolve_model_path(args.model), free_port(), args.dtype)
        try:
            server.generate(fixed[:2], 8, eos=None)  # warm-up
            for case, prompts, stop, n in cases:
                best("vllm-cpu", case, lambda: server.generate(prompts, args.new_tokens, eos=stop, n=n))
                print(
                    f"  {case}: vllm-cpu {results[case]['vllm-cpu'][0] / results[case]['vllm-cpu'][1]:.1f} tok/s",
                    flush=True,
                )
        finally:
            server.stop()
        engines.append("vllm-cpu")
    else:
        print(
            "(vllm-cpu column skipped: "
            + (
                "--no-vllm"
                if args.no_vllm
                else f"--device {args.device}"
                if args.device != "cpu"
                else f"{VLLM_PY} missing; run `bash scripts/setup_vllm.sh`"
            )
            + ")"
        )

    limits.append(measure(args.device))
    best_limits = max(limits, key=lambda lim: lim.flops[args.dtype])
    print("\n" + "\n".join(f"{when}: {lim.describe()}" for when, lim in zip(("before", "after"), limits)))
    shape = model_shape(model)
    bounds = {}
    for case, prompts, _, n in cases:
        rows, context = len(prompts) * n, sum(map(len, prompts)) / len(prompts) + args.new_tokens / 2
        bounds[case] = decode_bound(shape, rows, int(context), best_limits, str(model.dtype).removeprefix("torch."))
    print()
    base = f"strop at {args.baseline}" if args.baseline else None
    vllm = "vllm-cpu" in engines
    header = [f"{e} tok/s (tokens, s)" for e in engines] + ["now / HF", "now / before"]
    header += (
        [f"now / {args.baseline}"] * bool(base) + ["now / vllm"] * vllm + ["compiled / vllm"] * (vllm and args.compiled)
    )
    header += ["bound tok/s", "now / bound"] + ["compiled / bound"] * args.compiled
    print("| case | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    for case, _, _, _ in cases:
        r = results[case]
        rate = {e: r[e][0] / r[e][1] for e in engines}
        cells = [f"{rate[e]:.1f} ({r[e][0]}, {r[e][1]:.1f})" for e in engines]
        ratios = [f"{rate['strop now'] / rate['HF generate']:.2f}", f"{rate['strop now'] / rate['strop before']:.2f}"]
        if base:
            ratios.append(f"{rate['strop now'] / rate[base]:.2f}")
        if "vllm-cpu" in engines:
            ratios.append(f"{rate['strop now'] / rate['vllm-cpu']:.2f}")
            if args.compiled:
                ratios.append(f"{rate['strop compiled'] / rate['vllm-cpu']:.2f}")
        ratios += [f"{bounds[case]:.0f}", f"{rate['strop now'] / bounds[case]:.2f}"]
        if args.compiled:
            ratios.append(f"{rate['strop compiled'] / bounds[case]:.2f}")
        print(f"| {case} | " + " | ".join(cells + ratios) + " |")
    print(
        "(bound: what this machine's measured matmul throughput and memory read bandwidth allow a decoder at "
        "that batch, bench/limits.py; now / bound: the fraction strop's engine reaches)"
    )


if __name__ == "__main__":
    main()
