"""This machine's limits, measured in the run that compares against them (issue 27): matrix throughput in fp32
and bf16, and memory read bandwidth; and the bounds they put on decoding and training.

Absolute tokens per second differ between machines (and this one drifts by 2x within an hour); a result as
a fraction of the bound that applies is what compares across them. The bounds:

- decode, one step of a batch of B rows: the weights are read once (``weight_bytes`` / bandwidth) and every
  row does its matmuls (``flops_per_token`` x B / matrix throughput); a step takes at least the larger, so
  tokens/s <= B / max(the two). At batch 1 that is the bandwidth bound, at large batches the compute bound.
- training: 6 x parameters x tokens FLOPs for forward and backward (the matmuls) at matrix throughput.

``flops_per_token`` counts the matmuls: 2 x the parameters that multiply (every linear layer and the output
projection, tied or not; not the embedding lookup) + attention's 4 x layers x context x hidden.

    python bench/limits.py [cuda]   # prints this machine's figures (or its GPU's)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Limits:
    flops: dict[str, float]  # dtype name -> matmul FLOP/s (best of several rounds)
    read_bytes_per_s: float  # memory read bandwidth (a reduction over a tensor far larger than the caches)
    threads: int
    device: str = "cpu"

    def describe(self) -> str:
        where = f"this machine ({self.threads} torch threads)" if self.device == "cpu" else f"this {self.device}"
        return (
            f"{where}: matmul {self.flops['float32'] / 1e9:.0f} GFLOP/s fp32, "
            f"{self.flops['bfloat16'] / 1e9:.0f} GFLOP/s bf16; memory read {self.read_bytes_per_s / 1e9:.1f} GB/s"
            + (f"\n{cpu_line()}" if self.device == "cpu" else "")
        )


def cpu_line() -> str:
    """The CPU, the linear-layer kernels strop's decoder runs on it (engine.cpu_kernels=auto), per dtype, and the
    path of its decode attention's C kernel."""
    from strop.serving import attention_kernel
    from strop.serving.cpu_kernels import choose, cpu

    c = cpu()
    picks = ", ".join(f"{d} {choose('auto', getattr(torch, d), torch.device('cpu'))}" for d in ("float32", "bfloat16"))
    return (
        f"CPU: {c['model']} ({c['vendor'] or 'vendor unknown'}; AMX {'yes' if c['amx'] else 'no'}, AVX-512 bf16 "
        f"{'yes' if c['avx512_bf16'] else 'no'}); strop's decoder runs its linear layers on: {picks}; its decode "
        f"attention's C kernel: {attention_kernel.isa()}"
    )


def _now(device: torch.device) -> float:
    if device.type == "cuda":  # (kernels run asynchronously: time what has finished)
        torch.cuda.synchronize(device)
    return time.perf_counter()


def matmul_flops(dtype: torch.dtype, n: int = 1024, rounds: int = 5, seconds: float = 0.5, device="cpu") -> float:
    """Best FLOP/s of an (n, n) x (n, n) matmul in ``dtype`` over ``rounds`` timed rounds of about ``seconds``:
    ``torch.mm`` and, on a CPU, oneDNN's matmul on a pre-packed weight, whichever is faster (on an AMD EPYC
    oneDNN's fp32 rate is about twice MKL's, which ``torch.mm`` calls: a bound from ``torch.mm`` alone sat below
    what strop's decoder reaches there). The packed kernel is the one strop's decoder runs: left out where it
    cannot run ``dtype``, and on bf16 computed in float32 where the CPU has no bf16 instructions (widening each
    input and rounding each output back, ``strop.serving.cpu_kernels.computes_in``; torch's own bf16 matmul there
    ran at 1 GFLOP/s on an AMD EPYC with AVX2)."""
    from strop.serving.cpu_kernels import computes_in, unavailable

    device = torch.device(device)
    n = n if device.type == "cpu" else 8192  # (a GPU needs a larger product to reach its rate)
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    kernels = [lambda: torch.mm(a, b, out=out)]
    if device.type == "cpu" and not unavailable("onednn", dtype):
        wide = computes_in("onednn", dtype)  # (bf16 on a CPU without bf16 instructions: float32's product, widened)
        packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous().to(wide), n)  # (a layer's (out, in))
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a.to(wide), packed, None, "none", [], "").to(dtype))
    best = 0.0
    for kernel in kernels:
        kernel()  # (warm-up: packing, thread pool)
        t = _now(device)
        kernel()
        reps = max(1, int(seconds / max(_now(device) - t, 1e-6)))
        for _ in range(rounds):
            t = _now(device)
            for _ in range(reps):
                kernel()
            best = max(best, 2 * n**3 * reps / (_now(device) - t))
    return best


def read_bandwidth(mib: int = 512, rounds: int = 5, device="cpu") -> float:
    """Best bytes/s of summing a ``mib`` MiB fp32 tensor (read once per round)."""
    device = torch.device(device)
    mib = mib if device.type == "cpu" else 4096
    x = torch.ones(mib << 18, device=device)  # (4 bytes each)
    x.sum()
    best = 0.0
    for _ in range(rounds):
        t = _now(device)
        x.sum()
        best = max(best, x.numel() * 4 / (_now(device) - t))
    return best


def measure(device="cpu") -> Limits:
    """Matmul rates and read bandwidth of ``device`` (this CPU by default, or a GPU)."""
    return Limits(
        {
            "float32": matmul_flops(torch.float32, device=device),
            "bfloat16": matmul_flops(torch.bfloat16, device=device),
        },
        read_bandwidth(device=device),
        torch.get_num_threads(),
        str(device),
    )


def model_shape(model) -> dict:
    """What the bounds need of a causal LM: the parameters that multiply, the weights' bytes, layers, hidden."""
    embed = model.get_input_embeddings().weight
    params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings() is not None and model.get_output_embeddings().weight is embed
    matmul_params = params - embed.numel() + (embed.numel() if tied else 0)  # the lookup is no matmul; the head is
    return {
        "matmul_params": matmul_params,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
    }


def flops_per_token(shape: dict, context: int) -> float:
    return 2 * shape["matmul_params"] + 4 * shape["layers"] * context * shape["hidden"]


def decode_bound(
    shape: dict, batch: int, context: int, limits: Limits, dtype: str = "float32", weight_bytes: int | None = None
) -> float:
    """Tokens/s no decoder can beat here at ``batch`` rows of about ``context`` tokens (see the module's text)."""
    compute = flops_per_token(shape, context) * batch / limits.flops[dtype]
    memory = (weight_bytes or shape["weight_bytes"]) / limits.read_bytes_per_s
    return batch / max(compute, memory)


def decode_linear_seconds(model, batch: int, dtype: str = "float32", rounds: int = 5) -> dict[str, float]:
    """Seconds one decode step of ``batch`` rows spends in the model's linear layers alone (every layer's
    fused qkv, o, gate_up and down, and the output head), with each kernel this CPU and torch build have for
    them (strop.serving.cpu_kernels): ``mkl`` (MKL's pre-packed sgemm, fp32), ``onednn`` (oneDNN's pre-packed
    matmul) and ``plain`` (``F.linear``, what Hugging Face ``generate`` calls). The best of ``rounds``, the
    kernels interleaved within each round.

    This is a floor under any decoder that computes these matmuls with these kernels, below the
    ``decode_bound`` of a large square matmul's rate: a (batch x hidden) activation reuses each weight
    only ``batch`` times, and the kernels do not reach their large-matrix rate at that shape."""
    import torch.nn.functional as F

    from strop.serving.cpu_kernels import unavailable
    from strop.serving.kvdecode import LlamaDecoder

    model = model.to(getattr(torch, dtype))  # (in place: pass a model of its own)
    decs, calls = {}, {}
    for kernel in ("mkl", "onednn", "plain"):
        if not unavailable(kernel, model.dtype):
            decs[kernel] = dec = LlamaDecoder(model, kernels=kernel)  # (each its own packed copy of the weights)
            dec._sync(batch)
            calls[kernel] = (lambda lin, x: F.linear(x, lin.weight, lin.bias)) if kernel == "plain" else packed_call
    xs = [torch.randn(batch, lin.weight.shape[1], dtype=lin.weight.dtype) for lin in next(iter(decs.values())).linears]
    out = dict.fromkeys(decs, float("inf"))
    with torch.no_grad():
        for _ in range(rounds + 1):  # (the first round warms up)
            for kernel, dec in decs.items():
                t = time.perf_counter()
                for lin, x in zip(dec.linears, xs):
                    calls[kernel](lin, x)
                out[kernel] = min(out[kernel], time.perf_counter() - t)
    for dec in decs.values():
        dec.release()
    return out


def packed_call(lin, x):
    """A layer through the kernel its weights are packed for (strop.serving.linear.PackedLinear)."""
    return lin(x)


def train_bound_seconds(shape: dict, tokens: int, limits: Limits, dtype: str = "float32") -> float:
    """Seconds of matmuls that training on ``tokens`` tokens needs at least (6 x parameters x tokens)."""
    return 6 * shape["matmul_params"] * tokens / limits.flops[dtype]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device", nargs="?", default="cpu")
    ap.add_argument(
        "--linears",
        type=int,
        metavar="BATCH",
        help="also time the embedded model's decode linears at this batch, in fp32 and bf16 (CPU)",
    )
    args = ap.parse_args()
    lim = measure(args.device)
    print(lim.describe())
    if args.linears:
        from strop.models import EMBEDDED_MODEL, load_model

        for dtype in ("float32", "bfloat16"):
            model = load_model(EMBEDDED_MODEL)
            shape = model_shape(model)
            secs = decode_linear_seconds(model, args.linears, dtype)
            flops = 2 * shape["matmul_params"] * args.linears
            print(
                f"{dtype} decode linears at batch {args.linears}: "
                + ", ".join(
                    f"{k} {v * 1e3:.1f} ms/step ({flops / v / 1e9:.0f} GFLOP/s, {flops / v / lim.flops[dtype]:.2f} of the "
                    f"square matmul's rate)"
                    for k, v in secs.items()
                )
            )
