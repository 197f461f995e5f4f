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

/* exp_le0 in vectors of W bits: FLOOR rounds down, KEEP(x, v) is v where x >= -87.3 and 0 elsewhere */
#define EXP_LE0(W, FLOOR, KEEP)                                                                                     \
static inline __m##W exp_le0_##W(__m##W x) {                                                                        \
    __m##W c = _mm##W##_max_ps(x, _mm##W##_set1_ps(-87.3f));                                                        \
    __m##W n = FLOOR(_mm##W##_fmadd_ps(c, _mm##W##_set1_ps(1.44269504088896341f), _mm##W##_set1_ps(0.5f)));        \
    __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), c);                                            \
    r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(2.12194440e-4f), r);                                                  \
    __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                                                  \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                                               \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                                               \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                                               \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                                               \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                                               \
    p = _mm##W##_add_ps(_mm##W##_fmadd_ps(_mm##W##_mul_ps(p, r), r, r), _mm##W##_set1_ps(1.0f));                   \
    __m##W##i e = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23);  \
    return KEEP(x, _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(e)));                                                \
}
#define KEEP256(x, v) _mm256_and_ps(_mm256_cmp_ps((x), _mm256_set1_ps(-87.3f), _CMP_GE_OQ), (v))
#define FLOOR512(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define KEEP512(x, v) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask((x), _mm512_set1_ps(-87.3f), _CMP_GE_OQ), (v))

#if defined(__AVX2__) && defined(__FMA__)
EXP_LE0(256, _mm256_floor_ps, KEEP256)
static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
static inline float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
/* softmax_rows 8 lanes at a time; the row is padded to a multiple of 8 (stride), its tail with -inf */
static void softmax8(float *s, long stride, int G, int T1, const float *bias, float scale, float *inv) {
    __m256 sc = _mm256_set1_ps(scale);
    int T8 = T1 & ~7, TP = (T1 + 7) & ~7;
    for (int g = 0; g < G; g++) {
        float *sg = s + g * stride;
        for (int t = T1; t < TP; t++) sg[t] = -INFINITY;
        __m256 m = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        int t = 0;
        for (; t < T8; t += 8) {
            __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(sg + t), sc, _mm256_loadu_ps(bias + t));
            _mm256_storeu_ps(sg + t, x);
            m = _mm256_max_ps(m, x);
        }
        float mt = hmax8(m);
        for (; t < T1; t++) { sg[t] = sg[t] * scale + bias[t]; mt = sg[t] > mt ? sg[t] : mt; }
        __m256 mv = _mm256_set1_ps(mt);
        for (t = 0; t < TP; t += 8) {
            __m256 e = exp_le0_256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            _mm256_storeu_ps(sg + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        inv[g] = 1.0f / hsum8(sum);
    }
}
#define SOFTMAX_BLOCKED softmax8
#else
#define SOFTMAX_BLOCKED softmax_rows
#endif

/* a kernel's signature: q (B, KV, G, D) contiguous; the caches' columns csb, csh, cst apart by row, head, column */
#define SIGNATURE(NAME, CT)                                                                                        \
void NAME(const float *q, const CT *kc, const CT *vc, const float *bias, const float *kn, const float *vn,        \
          float *out, int B, int KV, int G, int D, int T, long csb, long csh, long cst, float scale, int threads)
/* a kernel's tasks over torch's threads, one per row b and key/value head h: its queries and caches */
#define TASKS(CT)                                                                                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                                             \
    for (long task = 0; task < (long)B * KV; task++) {                                                           \
        long b = task / KV, h = task % KV;                                                                        \
        const float *qh = q + task * G * D;                                                                       \
        const CT *kh = kc + b * csb + h * csh, *vh = vc + b * csb + h * csh;

#define SIMPLE(NAME, CT, WIDEN)                                                                                   \
SIGNATURE(NAME, CT) {                                                                                             \
    TASKS(CT)                                                                                                     \
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
SIGNATURE(NAME, CT) {                                                                                             \
    TASKS(CT)                                                                                                     \
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
        SOFTMAX_BLOCKED(s, TP, G, T1, bb, scale, inv);                                                               \
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

#if defined(__AVX512F__)
/* AVX-512: 16 lanes, 32 registers. A cache column is read in place (bf16 widened in registers) 16 values at a time,
   for up to 3 query heads and 8 columns at once (24 accumulators); each head's 8 scores are then summed across
   lanes by one shuffle tree. The weighted sums keep 64 values of D for up to 3 heads (12 accumulators). */
static inline __m512 ld16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
EXP_LE0(512, FLOOR512, KEEP512)
static void softmax16(float *s, long stride, int G, int T1, const float *bias, float scale, float *inv) {
    __m512 sc = _mm512_set1_ps(scale);
    for (int g = 0; g < G; g++) {
        float *sg = s + g * stride;
        __m512 m = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int t = 0; t < T1; t += 16) {
            __mmask16 k = T1 - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T1 - t)) - 1);
            __m512 x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, sg + t), sc, _mm512_maskz_loadu_ps(k, bias + t));
            _mm512_mask_storeu_ps(sg + t, k, x);
            m = _mm512_mask_max_ps(m, k, m, x);
        }
        __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        for (int t = 0; t < T1; t += 16) {
            __mmask16 k = T1 - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (T1 - t)) - 1);
            __m512 e = exp_le0_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + t), mv));
            _mm512_mask_storeu_ps(sg + t, k, e);
            sum = _mm512_mask_add_ps(sum, k, sum, e);
        }
        inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
    }
}

/* the lane sums of a[0..7], stored at s[0..7] */
static inline void sums8(float *s, const __m512 *a) {
    __m512 b[4], c[2];
    for (int i = 0; i < 4; i++)  /* [a(2i) 8 partials | a(2i+1) 8 partials] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* quarters: a(4i) a(4i+1) a(4i+2) a(4i+3), 4 partials each */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    __m512 d = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    d = _mm512_add_ps(d, _mm512_permute_ps(d, 0x4E));  /* quarter q: a(q), a(4+q), a(q), a(4+q) */
    __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm256_storeu_ps(s, _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, d)));
}
#define SCORE8_512(CT, SFX, GC)                                                                                     \
static inline void score8_##SFX##_##GC(const float *q, int D, const CT *k, long ks, float *s, long ss,          \
                                        const CT *nk) {                                                           \
    if (nk) for (int c = 0; c < 8; c++) for (int l = 0; l < D * (int)sizeof(CT); l += 64)                          \
        _mm_prefetch((const char *)(nk + c * ks) + l, _MM_HINT_T0);                                               \
    __m512 a[GC][8];                                                                                              \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 8; c++) a[g][c] = _mm512_setzero_ps();                       \
    for (int d = 0; d < D; d += 16) {                                                                             \
        __m512 qv[GC];                                                                                            \
        for (int g = 0; g < GC; g++) qv[g] = _mm512_loadu_ps(q + (size_t)g * D + d);                              \
        for (int c = 0; c < 8; c++) {                                                                             \
            __m512 kv = ld16_##SFX(k + c * ks + d);                                                               \
            for (int g = 0; g < GC; g++) a[g][c] = _mm512_fmadd_ps(qv[g], kv, a[g][c]);                           \
        }                                                                                                         \
    }                                                                                                             \
    for (int g = 0; g < GC; g++) sums8(s + g * ss, a[g]);                                                         \
}
#define SCORE1_512(CT, SFX)                                                                                         \
static inline void score1_##SFX(const float *q, int D, int GC, const CT *k, float *s, long ss) {                 \
    for (int g = 0; g < GC; g++) {                                                                                \
        __m512 a = _mm512_setzero_ps();                                                                           \
        for (int d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)g * D + d), ld16_##SFX(k + d), a); \
        s[g * ss] = _mm512_reduce_add_ps(a);                                                                      \
    }                                                                                                             \
}
/* GC heads' 64 values of D (acc, D apart per head) plus n columns (v, vs apart) weighted by p (ps apart per head) */
#define PV64_512(CT, SFX, GC)                                                                                       \
static inline void pv64_##SFX##_##GC(float *acc, int D, const float *p, long ps, const CT *v, long vs, int n,   \
                                      const CT *nv) {                                                             \
    __m512 a[GC][4];                                                                                              \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 4; c++) a[g][c] = _mm512_loadu_ps(acc + (size_t)g * D + 16 * c); \
    for (int j = 0; j < n; j++) {                                                                                 \
        if (nv) for (int l = 0; l < 64 * (int)sizeof(CT); l += 64) _mm_prefetch((const char *)(nv + j * vs) + l, _MM_HINT_T0); \
        __m512 pv[GC];                                                                                            \
        for (int g = 0; g < GC; g++) pv[g] = _mm512_set1_ps(p[g * ps + j]);                                       \
        for (int c = 0; c < 4; c++) {                                                                             \
            __m512 x = ld16_##SFX(v + j * vs + 16 * c);                                                           \
            for (int g = 0; g < GC; g++) a[g][c] = _mm512_fmadd_ps(pv[g], x, a[g][c]);                            \
        }                                                                                                         \
    }                                                                                                             \
    for (int g = 0; g < GC; g++) for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + (size_t)g * D + 16 * c, a[g][c]); \
}
#define KERNELS_512(CT, SFX) SCORE8_512(CT, SFX, 1) SCORE8_512(CT, SFX, 2) SCORE8_512(CT, SFX, 3) SCORE1_512(CT, SFX) \
    PV64_512(CT, SFX, 1) PV64_512(CT, SFX, 2) PV64_512(CT, SFX, 3)
KERNELS_512(float, f32)
KERNELS_512(uint16_t, bf16)

#define WIDE(NAME, CT, SFX)                                                                                        \
SIGNATURE(NAME, CT) {                                                                                             \
    TASKS(CT)                                                                                                     \
        long nb = (task + 1) / KV, nh = (task + 1) % KV;  /* the next task's columns, fetched meanwhile */        \
        const CT *nk = task + 1 < (long)B * KV ? kc + nb * csb + nh * csh : 0;                                    \
        const CT *nv = nk ? vc + nb * csb + nh * csh : 0;                                                         \
        const float *bb = bias + b * (long)(T + 1);                                                               \
        int T1 = T + 1, TP = (T1 + 15) & ~15;                                                                     \
        float *s = (float *)aligned_alloc(64, sizeof(float) * ((size_t)G * TP + (size_t)G * D + 16));             \
        float *acc = s + (size_t)G * TP;                                                                          \
        for (int g0 = 0; g0 < G; g0 += 3) {                                                                       \
            int gc = G - g0 < 3 ? G - g0 : 3, t = 0;                                                              \
            const float *qg = qh + (size_t)g0 * D;                                                                \
            float *sg = s + (size_t)g0 * TP;                                                                      \
            for (; t + 8 <= T; t += 8) {                                                                          \
                const CT *kt = kh + (long)t * cst, *nkt = nk ? nk + (long)t * cst : 0;                            \
                if (gc == 3) score8_##SFX##_3(qg, D, kt, cst, sg + t, TP, nkt);                                   \
                else if (gc == 2) score8_##SFX##_2(qg, D, kt, cst, sg + t, TP, nkt);                              \
                else score8_##SFX##_1(qg, D, kt, cst, sg + t, TP, nkt);                                           \
            }                                                                                                     \
            for (; t < T; t++) score1_##SFX(qg, D, gc, kh + (long)t * cst, sg + t, TP);                          \
            score1_f32(qg, D, gc, kn + task * D, sg + T, TP);  /* the step's own key */                           \
        }                                                                                                         \
        float inv[64];                                                                                            \
        softmax16(s, TP, G, T1, bb, scale, inv);                                                                  \
        memset(acc, 0, sizeof(float) * (size_t)G * D);                                                            \
        for (int g0 = 0; g0 < G; g0 += 3) {                                                                       \
            int gc = G - g0 < 3 ? G - g0 : 3;                                                                     \
            const float *pg = s + (size_t)g0 * TP;                                                                \
            for (int d0 = 0; d0 < D; d0 += 64) {                                                                  \
                float *ag = acc + (size_t)g0 * D + d0;                                                            \
                const CT *nvd = nv ? nv + d0 : 0;                                                                 \
                const float *own = vn + task * D + d0;  /* the step's own value: a column of its own */           \
                if (gc == 3) { pv64_##SFX##_3(ag, D, pg, TP, vh + d0, cst, T, nvd); pv64_f32_3(ag, D, pg + T, TP, own, D, 1, 0); } \
                else if (gc == 2) { pv64_##SFX##_2(ag, D, pg, TP, vh + d0, cst, T, nvd); pv64_f32_2(ag, D, pg + T, TP, own, D, 1, 0); } \
                else { pv64_##SFX##_1(ag, D, pg, TP, vh + d0, cst, T, nvd); pv64_f32_1(ag, D, pg + T, TP, own, D, 1, 0); } \
            }                                                                                                     \
        }                                                                                                         \
        normalize(out + task * G * D, acc, inv, G, D);                                                            \
        free(s);                                                                                                  \
    }                                                                                                             \
}
WIDE(wide_f32, float, f32)
WIDE(wide_bf16, uint16_t, bf16)
#else  /* without AVX-512: the blocked kernels */
#define wide_f32 blocked_f32
#define wide_bf16 blocked_bf16
#endif

SIMPLE(simple_f32, float, widen)
SIMPLE(simple_bf16, uint16_t, widen_bf16)
BLOCKED(blocked_f32, float, widen, 1)
BLOCKED(blocked_bf16, uint16_t, widen_bf16, 0)

#define ENTRY(NAME, CT, SUFFIX)                                                                                   \
SIGNATURE(NAME, CT) {                                                                                         \
    (D % 64 == 0 ? wide_##SUFFIX : simple_##SUFFIX)(q, kc, vc, bias, kn, vn, out, B, KV, G, D, T, csb, csh, cst, \
                                                       scale, threads);                                           \
}
ENTRY(strop_attend_f32, float, f32)
ENTRY(strop_attend_bf16, uint16_t, bf16)

/* which of the kernels above D % 64 == 0 runs: 16 (AVX-512's), 8 (AVX2's softmax), 0 (the compiler's vectors) */
int strop_attend_lanes(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 0;
#endif
}
