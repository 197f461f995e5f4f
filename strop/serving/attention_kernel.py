"""A decode step's attention as one C kernel (``attention_kernel.c``), built on first use with the machine's C compiler.

For each row and key/value head, one task: its G query heads against the cache's columns and the step's own key and
value (which join as a term of their own: the compiled step writes the cache after its graph). The scores are kept
in fp32; the softmax's exponentials are Cephes' single-precision polynomial (within 2 ulp of ``expf``), a masked
column weighing exactly 0. Which kernel runs is set when the library is compiled for the machine (:func:`lanes`):

- with AVX-512: each cache column is read in place, bf16 ones widened in registers, 16 values at a time for up to 3
  query heads and 8 columns at once (24 accumulators, one shuffle tree for each head's 8 sums); the softmax 16 lanes
  at a time; the weighted sums keep 64 values of D for up to 3 heads in registers. Meanwhile the thread's next task's
  columns are fetched into the cache (a step reads the layer's cache from memory: 1.1-1.2x in a step's conditions).
- with AVX2 and FMA: columns go in blocks of 64, fp32 ones read where they are, bf16 ones (and the block holding the
  step's own column) widened to fp32 into a buffer once; each vector of a key column is loaded once for up to 3 query
  heads, 4 columns at a time (12 accumulators: with the 3 queries and the key, AVX2's 16 registers), the weighted
  sums 32 values of D at a time; the softmax 8 lanes at a time.
- otherwise, the same blocks in the compiler's vectors; and where D is not a multiple of 64, one column at a time.

Tasks are spread over torch's OpenMP threads (the kernel links the same ``libgomp.so.1`` torch loaded).

The library is compiled once per source, compiler and CPU into ``$STROP_KERNEL_CACHE`` (default
``~/.cache/strop/kernels``), in about a second, with ``-O3 -march=native``; a process that finds it there loads it.
:func:`why_unavailable` says why it cannot be used (no compiler, a failed build, not x86-64 or aarch64 Linux): the
attention then stays Inductor's.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attention_kernel.c").read_text()
MAX_GROUP = 64  # query heads per key/value head the kernel takes (its per-task array)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=gnu11"]
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5 + [ctypes.c_long] * 3 + [ctypes.c_float, ctypes.c_int]
_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded library, "reason": why there is none


def cache_dir() -> Path:
    return Path(os.environ.get("STROP_KERNEL_CACHE") or Path.home() / ".cache" / "strop" / "kernels")


def _cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(lines))


def _build(compiler: str, extra: tuple[str, ...] = ()) -> Path:
    """The library for this machine, ``extra`` flags after strop's (a test builds one without AVX-512)."""
    flags = [*FLAGS, *extra]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, *flags, version, _cpu()]).encode()).hexdigest()[:20]
    target = cache_dir() / f"attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src, lib = Path(tmp) / "attention.c", Path(tmp) / "attention.so"
        src.write_text(SOURCE)
        run = subprocess.run([compiler, *flags, str(src), "-o", str(lib)], capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(run.stderr.strip().splitlines() or [''])[0][:200]}")
        os.replace(lib, target)  # (another process building the same file at once: either copy is whole)
    return target


def _load() -> None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        _state["reason"] = f"the attention kernel is built for x86-64 and aarch64 Linux, not {platform.machine()}"
        return
    compiler = shutil.which(os.environ.get("CC") or "cc") or (None if os.environ.get("CC") else shutil.which("gcc"))
    if not compiler:
        _state["reason"] = f"no C compiler ({os.environ.get('CC') or 'cc, gcc'}) to build the attention kernel"
        return
    try:
        _state["lib"] = open_library(_build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _state["reason"] = f"the attention kernel did not build: {err}"


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name in ("strop_attend_f32", "strop_attend_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = _ARGS, None
    lib.strop_attend_lanes.argtypes, lib.strop_attend_lanes.restype = [], ctypes.c_int
    return lib


def why_unavailable() -> str:
    """'' when the kernel is built and loaded (built now if needed), else why not."""
    with _lock:
        if not _state:
            _load()
    return _state.get("reason", "")


def lanes() -> int:
    """The kernel's vector width in floats: 16 (AVX-512), 8 (AVX2 and FMA), 0 (the compiler's own vectors); -1 where
    it is not built."""
    return -1 if why_unavailable() else _state["lib"].strop_attend_lanes()


def isa() -> str:
    """Which of the kernel's paths this machine runs, for start lines and benches."""
    return {16: "AVX-512", 8: "AVX2", 0: "plain C", -1: "not built"}[lanes()]


def why_not(dtype: torch.dtype, group: int) -> str:
    """'' when the kernel runs a decoder of ``dtype`` with ``group`` query heads per key/value head, else why not."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the C kernel takes float32 and bfloat16 caches, not {dtype}"
    if group > MAX_GROUP:
        return f"the C kernel takes up to {MAX_GROUP} query heads per key/value head, not {group}"
    return why_unavailable()


def attend(q, kc, vc, bias, k_new, v_new, scale: float) -> torch.Tensor:
    """``q`` (B, KV, G, D) against the cache's ``kc``, ``vc`` (B, KV, T, D; fp32 or bf16, each column's D values
    contiguous) and the step's own ``k_new``, ``v_new`` (B, KV, D), masked by ``bias`` (B, T + 1; the own key's
    last). q, the new key and value and the bias in fp32. Returns (B, KV, G, D) in fp32."""
    B, KV, G, D = q.shape
    T = kc.shape[2]
    lib = _state.get("lib")  # (each call of a step: no lock once loaded)
    if lib is None:
        if why_unavailable():
            raise RuntimeError(_state["reason"])
        lib = _state["lib"]
    if kc.dtype not in (torch.float32, torch.bfloat16) or vc.dtype != kc.dtype or kc.stride() != vc.stride():
        raise ValueError(f"attention kernel: caches of {kc.dtype}/{vc.dtype}, strides {kc.stride()}/{vc.stride()}")
    if kc.stride(-1) != 1 or G > MAX_GROUP:
        raise ValueError(f"attention kernel: a cache column's values must be contiguous, G <= {MAX_GROUP}")
    q, k_new, v_new, bias = (t.float().contiguous() for t in (q, k_new, v_new, bias.reshape(B, T + 1)))
    out = torch.empty(B, KV, G, D, dtype=torch.float32)
    fn = lib.strop_attend_f32 if kc.dtype == torch.float32 else lib.strop_attend_bf16
    sb, sh, st = kc.stride(0), kc.stride(1), kc.stride(2)
    fn(
        *(t.data_ptr() for t in (q, kc, vc, bias, k_new, v_new, out)),
        B, KV, G, D, T, sb, sh, st, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out
