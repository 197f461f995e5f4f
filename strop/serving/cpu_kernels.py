"""Which kernel the fast decoder's linear layers run on (``engine.cpu_kernels``, ``strop serve --cpu-kernels``).

On a CPU the decoder keeps each layer's weights packed for one kernel:

- ``mkl``: oneMKL's packed sgemm (fp32 only). Without packing, MKL repacks the weight on every call, about a
  third of a decode step at batch 64. It is the one the batch-invariant mode rests on (a row's result does not
  depend on the other rows when a call computes exactly the rows it was packed for; tested).
- ``onednn``: oneDNN's packed matmul (fp32 and bf16; on AMX it uses the tiles). Inductor uses the same pair. Where
  the CPU has no bf16 instructions oneDNN can use (AVX2 only), bf16 weights are packed as a float32 copy, each
  input of 3 rows or more is widened to float32 and each output rounded back to bf16 (:func:`computes_in`): torch's
  own bf16 matmul there was 3-6x slower at 8 to 64 rows (an AMD EPYC with AVX2, measured). The packed copy takes
  twice the bf16 weights' memory.
- ``plain``: ``F.linear`` on the unpacked weights (what a GPU, or a torch build without MKL and oneDNN, runs).

``auto`` picks by CPU and dtype: bf16 runs oneDNN (1.4-1.9x ``plain`` per call here). In fp32, MKL on Intel CPUs.
Elsewhere it is oneDNN: MKL's sgemm is tuned for Intel's CPUs, and on an AMD EPYC vLLM's CPU engine read
weights at 0.53 of the machine's bound against strop's 0.27-0.35 on MKL. ``bench/linear_kernels.py`` times every kernel
for each layer shape on the CPU it runs on, and prints which one ``auto`` picks there.
"""

from __future__ import annotations

import functools
import platform

import torch

KERNELS = ("auto", "mkl", "onednn", "plain")


@functools.cache
def cpu() -> dict[str, str | bool]:
    """This CPU: its vendor and model name (from /proc/cpuinfo where there is one), and whether torch sees
    AMX tiles and AVX-512 bf16 instructions on it."""
    info = {"vendor": "", "model": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not info["vendor"]:
                    info["vendor"] = value.strip()
                elif key == "model name":
                    info["model"] = value.strip()
                    break
    except OSError:  # not Linux: the platform's words
        pass
    probe = getattr(torch, "cpu", None)
    info["amx"] = bool(getattr(probe, "_is_amx_tile_supported", lambda: False)())
    info["avx512_bf16"] = bool(getattr(probe, "_is_avx512_bf16_supported", lambda: False)())
    return info


def unavailable(kernel: str, dtype: torch.dtype) -> str:
    """Why ``kernel`` cannot run linear layers of ``dtype`` on this CPU with this torch build ('' when it can)."""
    if kernel == "plain":
        return ""
    if kernel == "mkl":
        if dtype != torch.float32:
            return f"MKL's packed sgemm computes float32 only, and these weights are {str(dtype).split('.')[-1]}"
        if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
            return "this torch build has no MKL"
        return ""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch build has no oneDNN"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the packed kernels take float32 or bfloat16, not {dtype}"
    return ""


def bf16_instructions() -> bool:
    """Whether oneDNN has bf16 instructions to use on this CPU (AVX-512 bf16, AMX or AVX-NE-convert)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def computes_in(kernel: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype ``kernel`` keeps its packed weights in and computes a layer with ``dtype`` weights in: float32
    for ``onednn`` on bf16 weights where the CPU has no bf16 instructions (module doc), else ``dtype`` itself."""
    return torch.float32 if kernel == "onednn" and dtype == torch.bfloat16 and not bf16_instructions() else dtype


def choose(asked: str, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel the decoder runs: ``asked`` itself (a ValueError saying why where it cannot run), or for
    ``auto`` this CPU's pick (module doc)."""
    if asked not in KERNELS:
        raise ValueError(f"cpu_kernels={asked!r}: choose one of {', '.join(KERNELS)}")
    if device.type != "cpu":
        if asked not in ("auto", "plain"):
            raise ValueError(f"cpu_kernels={asked!r} is a CPU kernel; the weights are on {device.type}")
        return "plain"
    if asked != "auto":
        why = unavailable(asked, dtype)
        if why:
            raise ValueError(f"cpu_kernels={asked!r}: {why}")
        return asked
    intel = cpu()["vendor"] == "GenuineIntel"
    order = ("mkl", "onednn") if dtype == torch.float32 and intel else ("onednn", "mkl")
    return next((k for k in order if not unavailable(k, dtype)), "plain")


def describe(kernel: str, dtype: torch.dtype) -> str:
    """The start line's words: the kernel, the dtype and the CPU it was chosen for."""
    c = cpu()
    extras = [name for name, on in (("AMX", c["amx"]), ("AVX-512 bf16", c["avx512_bf16"])) if on]
    wide = computes_in(kernel, dtype) != dtype
    name = str(dtype).split(".")[-1] + (" weights computed in float32: no bf16 instructions" if wide else "")
    return f"linear layers on {kernel} ({name}; {c['model']}{', ' if extras else ''}{', '.join(extras)})"
