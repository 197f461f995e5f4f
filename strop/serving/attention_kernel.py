"""A decode step's attention as one C kernel, built on first use with the machine's C compiler.

For each row and key/value head, one task: its G query heads against the cache's columns and the step's own key and
value (which join as a term of their own: the compiled step writes the cache after its graph). Columns go in blocks
of 64: fp32 ones are read where they are, bf16 ones (and the block holding the step's own column) widened to fp32
into a buffer once. Each vector of a key column is loaded once for up to 3 query heads, 4 columns at a time (12
accumulators, the 3 queries and the key fill AVX2's 16 registers), and so is each vector of a value column for the
weighted sums, 32 values of D at a time. The scores are kept in fp32, the softmax's exponentials are a polynomial
the compiler vectorises (Cephes' single-precision one: within 2 ulp of ``expf``). Tasks are spread over torch's
OpenMP threads (the kernel links the same ``libgomp.so.1`` torch loaded).

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

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __AVX__
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 v; memcpy(&v, p, 32); return v; }
static inline void st(float *p, v8 v) { memcpy(p, &v, 32); }

static inline float widen(float x) { return x; }
static inline float widen_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

/* exp(x) for x <= 0 (a score less the row's maximum); 0 below -87.3 (a masked column's -inf too): exactly, or the
   weighted sum would meet denormal products, slow on many CPUs */
static inline float exp_le0(float x) {
    float c = x < -87.3f ? -87.3f : x;
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = (int32_t)n + 127;
    uint32_t bits = (uint32_t)e << 23;
    float s;
    memcpy(&s, &bits, 4);
    return x < -87.3f ? 0.0f : p * s;
}

/* column t of a task's cache (base: its column 0) widened to fp32 into row, or the step's own (own) at t == T */
#define COLUMN(row, base, own, t, T, cst, D, CT, WIDEN)                                                            \
    if ((t) < (T)) {                                                                                              \
        const CT *col_ = (base) + (long)(t) * (cst);                                                              \
        _Pragma("omp simd") for (int d = 0; d < (D); d++) (row)[d] = WIDEN(col_[d]);                              \
    } else {                                                                                                      \
        memcpy((row), (own), sizeof(float) * (D));                                                                \
    }

/* each of G rows of T1 scores (stride apart) scaled, masked by bias and turned into exp(score - max); inv[g]: 1/sum */
static void softmax_rows(float *s, long stride, int G, int T1, const float *bias, float scale, float *inv) {
    for (int g = 0; g < G; g++) {
        float *sg = s + g * stride, m = -INFINITY, sum = 0.0f;
        for (int t = 0; t < T1; t++) {
            sg[t] = sg[t] * scale + bias[t];
            m = sg[t] > m ? sg[t] : m;
        }
        _Pragma("omp simd reduction(+:sum)") for (int t = 0; t < T1; t++) {
            sg[t] = exp_le0(sg[t] - m);
            sum += sg[t];
        }
        inv[g] = 1.0f / sum;
    }
}

/* a task's output: its G weighted sums, each times 1 / its weights' sum */
static void normalize(float *out, const float *acc, const float *inv, int G, int D) {
    for (int g = 0; g < G; g++) {
        _Pragma("omp simd") for (int d = 0; d < D; d++) out[g * D + d] = acc[g * D + d] * inv[g];
    }
}

#define SIMPLE(NAME, CT, WIDEN)                                                                                   \
void NAME(const float *q, const CT *kc, const CT *vc, const float *bias, const float *kn, const float *vn,        \
          float *out, int B, int KV, int G, int D, int T, long csb, long csh, long cst, float scale, int threads) { \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long task = 0; task < (long)B * KV; task++) {                                                           \
        long b = task / KV, h = task % KV;                                                                        \
        const float *qh = q + task * G * D;  /* (B, KV, G, D) contiguous */                                       \
        const CT *kh = kc + b * csb + h * csh, *vh = vc + b * csb + h * csh;                                     \
        const float *bb = bias + b * (long)(T + 1);                                                               \
        float *s = (float *)malloc(sizeof(float) * (size_t)G * (T + 1) + sizeof(float) * (size_t)(G + 1) * D);   \
        float *acc = s + (size_t)G * (T + 1), *row = acc + (size_t)G * D;                                         \
        for (int t = 0; t <= T; t++) {                                                                            \
            COLUMN(row, kh, kn + task * D, t, T, cst, D, CT, WIDEN)                                               \
            for (int g = 0; g < G; g++) {                                                                         \
                const float *qg = qh + g * D;                                                                     \
                float dot = 0.0f;                                                                                 \
                _Pragma("omp simd reduction(+:dot)") for (int d = 0; d < D; d++) dot += qg[d] * row[d];           \
                s[g * (T + 1) + t] = dot;                                                                         \
            }                                                                                                     \
        }                                                                                                         \
        float inv[64];                                                                                            \
        softmax_rows(s, T + 1, G, T + 1, bb, scale, inv);                                                         \
        memset(acc, 0, sizeof(float) * (size_t)G * D);                                                            \
        for (int t = 0; t <= T; t++) {                                                                            \
            COLUMN(row, vh, vn + task * D, t, T, cst, D, CT, WIDEN)                                               \
            for (int g = 0; g < G; g++) {                                                                         \
                float p = s[g * (T + 1) + t], *ag = acc + g * D;                                                  \
                _Pragma("omp simd") for (int d = 0; d < D; d++) ag[d] += p * row[d];                              \
            }                                                                                                     \
        }                                                                                                         \
        normalize(out + task * G * D, acc, inv, G, D);                                                            \
        free(s);                                                                                                  \
    }                                                                                                             \
}

/* the 4 sums of a0..a3's lanes, stored at s[0..3] */
static inline void store_sums4(float *s, v8 a0, v8 a1, v8 a2, v8 a3) {
#ifdef __AVX__
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#else
    v8 a[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) { float t = 0; for (int l = 0; l < 8; l++) t += a[j][l]; s[j] = t; }
#endif
}

/* GC query heads (q, D apart) against 4 key columns (k, ks apart): each loaded once for the GC heads; the scores
   go to s (ss apart per head). 4 x GC accumulators, GC queries and a key in AVX2's 16 registers. */
#define SCORE4(GC)                                                                                                 \
static inline void score4_##GC(const float *q, int D, const float *k, long ks, float *s, long ss) {             \
    v8 a[GC][4];                                                                                                  \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 4; c++) a[g][c] = (v8){0};                                   \
    for (int d = 0; d < D; d += 8) {                                                                              \
        v8 qv[GC];                                                                                                \
        for (int g = 0; g < GC; g++) qv[g] = ld(q + (size_t)g * D + d);                                           \
        for (int c = 0; c < 4; c++) {                                                                             \
            v8 kv = ld(k + c * ks + d);                                                                           \
            for (int g = 0; g < GC; g++) a[g][c] += qv[g] * kv;                                                   \
        }                                                                                                         \
    }                                                                                                             \
    for (int g = 0; g < GC; g++) store_sums4(s + g * ss, a[g][0], a[g][1], a[g][2], a[g][3]);                     \
}
SCORE4(1)
SCORE4(2)
SCORE4(3)

/* GC heads' weighted sums over n value columns (v, vs apart), 32 of their D values (acc, D apart per head): each
   column's 32 values loaded once for the GC heads, whose weights are p (ps apart per head) */
#define PV32(GC)                                                                                                   \
static inline void pv32_##GC(float *acc, int D, const float *p, long ps, const float *v, long vs, int n) {      \
    v8 a[GC][4];                                                                                                  \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 4; c++) a[g][c] = ld(acc + (size_t)g * D + 8 * c);          \
    for (int j = 0; j < n; j++) {                                                                                 \
        v8 pv[GC];                                                                                                \
        for (int g = 0; g < GC; g++) { float w = p[g * ps + j]; pv[g] = (v8){w, w, w, w, w, w, w, w}; }          \
        for (int c = 0; c < 4; c++) {                                                                             \
            v8 x = ld(v + j * vs + 8 * c);                                                                        \
            for (int g = 0; g < GC; g++) a[g][c] += pv[g] * x;                                                    \
        }                                                                                                         \
    }                                                                                                             \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 4; c++) st(acc + (size_t)g * D + 8 * c, a[g][c]);          \
}
PV32(1)
PV32(2)
PV32(3)

#define BLK 64  /* key/value columns at a time (widened into a buffer where they cannot be read in place) */
/* DIRECT: fp32 columns D apart are read where they are, except in a block holding the step's own column */
#define BLOCKED(NAME, CT, WIDEN, DIRECT)                                                                           \
void NAME(const float *q, const CT *kc, const CT *vc, const float *bias, const float *kn, const float *vn,        \
          float *out, int B, int KV, int G, int D, int T, long csb, long csh, long cst, float scale, int threads) { \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long task = 0; task < (long)B * KV; task++) {                                                           \
        long b = task / KV, h = task % KV;                                                                        \
        const float *qh = q + task * G * D;                                                                       \
        const CT *kh = kc + b * csb + h * csh, *vh = vc + b * csb + h * csh;                                     \
        const float *bb = bias + b * (long)(T + 1);                                                               \
        int T1 = T + 1, TP = (T1 + 7) & ~7;                                                                       \
        size_t bytes = sizeof(float) * ((size_t)G * TP + (size_t)BLK * D + (size_t)G * D + 64);                   \
        float *s = (float *)aligned_alloc(32, (bytes + 31) & ~(size_t)31);                                        \
        float *buf = s + (size_t)G * TP, *acc = buf + (size_t)BLK * D;                                            \
        /* scores: 4 columns against up to 3 heads at a time */                                                   \
        for (int t0 = 0; t0 < T1; t0 += BLK) {                                                                    \
            int n = T1 - t0 < BLK ? T1 - t0 : BLK, np = (n + 7) & ~7;                                             \
            const float *kb = buf;  /* (D apart either way: in place only where the cache's columns are) */      \
            if (DIRECT && cst == D && t0 + np <= T) {                                                             \
                kb = (const float *)(kh + (long)t0 * cst);                                                        \
            } else {                                                                                              \
                for (int j = 0; j < np; j++) {                                                                    \
                    int t = t0 + j; float *row = buf + (size_t)j * D;                                             \
                    if (j >= n) memset(row, 0, sizeof(float) * D);                                                \
                    else { COLUMN(row, kh, kn + task * D, t, T, cst, D, CT, WIDEN) }                              \
                }                                                                                                 \
            }                                                                                                     \
            for (int g0 = 0; g0 < G; g0 += 3) {                                                                   \
                int gc = G - g0 < 3 ? G - g0 : 3;                                                                 \
                const float *qg = qh + (size_t)g0 * D;                                                            \
                float *sg = s + (size_t)g0 * TP + t0;                                                             \
                for (int j0 = 0; j0 < np; j0 += 4) {                                                              \
                    if (gc == 3) score4_3(qg, D, kb + j0 * D, D, sg + j0, TP);                                  \
                    else if (gc == 2) score4_2(qg, D, kb + j0 * D, D, sg + j0, TP);                             \
                    else score4_1(qg, D, kb + j0 * D, D, sg + j0, TP);                                          \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        float inv[64];                                                                                            \
        softmax_rows(s, TP, G, T1, bb, scale, inv);                                                               \
        memset(acc, 0, sizeof(float) * (size_t)G * D);                                                            \
        /* weighted sums: 32 values of a column for up to 3 heads at a time */                                    \
        for (int t0 = 0; t0 < T1; t0 += BLK) {                                                                    \
            int n = T1 - t0 < BLK ? T1 - t0 : BLK;                                                                \
            const float *vb = buf;                                                                                \
            if (DIRECT && cst == D && t0 + n <= T) {                                                              \
                vb = (const float *)(vh + (long)t0 * cst);                                                        \
            } else {                                                                                              \
                for (int j = 0; j < n; j++) {                                                                     \
                    int t = t0 + j; float *row = buf + (size_t)j * D;                                             \
                    COLUMN(row, vh, vn + task * D, t, T, cst, D, CT, WIDEN)                                       \
                }                                                                                                 \
            }                                                                                                     \
            for (int g0 = 0; g0 < G; g0 += 3) {                                                                   \
                int gc = G - g0 < 3 ? G - g0 : 3;                                                                 \
                const float *pg = s + (size_t)g0 * TP + t0;                                                       \
                for (int d0 = 0; d0 < D; d0 += 32) {                                                              \
                    float *ag = acc + (size_t)g0 * D + d0;                                                        \
                    if (gc == 3) pv32_3(ag, D, pg, TP, vb + d0, D, n);                                           \
                    else if (gc == 2) pv32_2(ag, D, pg, TP, vb + d0, D, n);                                      \
                    else pv32_1(ag, D, pg, TP, vb + d0, D, n);                                                   \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
        normalize(out + task * G * D, acc, inv, G, D);                                                            \
        free(s);                                                                                                  \
    }                                                                                                             \
}

SIMPLE(simple_f32, float, widen)
SIMPLE(simple_bf16, uint16_t, widen_bf16)
BLOCKED(blocked_f32, float, widen, 1)
BLOCKED(blocked_bf16, uint16_t, widen_bf16, 0)

#define ENTRY(NAME, CT, SUFFIX)                                                                                   \
void NAME(const float *q, const CT *kc, const CT *vc, const float *bias, const float *kn, const float *vn,        \
          float *out, int B, int KV, int G, int D, int T, long csb, long csh, long cst, float scale, int threads) { \
    (D % 64 == 0 ? blocked_##SUFFIX : simple_##SUFFIX)(q, kc, vc, bias, kn, vn, out, B, KV, G, D, T, csb, csh, cst, \
                                                       scale, threads);                                           \
}
ENTRY(strop_attend_f32, float, f32)
ENTRY(strop_attend_bf16, uint16_t, bf16)
"""
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


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, version, _cpu()]).encode()).hexdigest()[:20]
    target = cache_dir() / f"attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src, lib = Path(tmp) / "attention.c", Path(tmp) / "attention.so"
        src.write_text(SOURCE)
        run = subprocess.run([compiler, *FLAGS, str(src), "-o", str(lib)], capture_output=True, text=True, timeout=120)
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
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _state["reason"] = f"the attention kernel did not build: {err}"
        return
    for name in ("strop_attend_f32", "strop_attend_bf16"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = _ARGS, None
    _state["lib"] = lib


def why_unavailable() -> str:
    """'' when the kernel is built and loaded (built now if needed), else why not."""
    with _lock:
        if not _state:
            _load()
    return _state.get("reason", "")


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
