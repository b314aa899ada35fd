/* The elementwise work of a Llama decoder layer in bfloat16, for CPUs.
 *
 * Why a kernel: in bfloat16 torch runs each of these steps as its own operator
 * (widen, square, mean, rsqrt, scale, narrow, weight; rotate-half's slices, negation
 * and concatenation; SiLU, then the product), each a pass over the rows with a
 * bfloat16 result written and read back. Here each is one pass per row.
 *
 * The rounding is torch's: every step that torch ends in a bfloat16 tensor ends here
 * in a bfloat16 value (round to nearest even), so the results are torch's bit for
 * bit, except where float32 sums in another order (the RMSNorm mean) or exp and the
 * vectorised division differ in their last bit (SiLU): then an intermediate can round
 * one bfloat16 step away, and the product after it up to two; and for denormals
 * (below). -ffast-math divides by a reciprocal, which flushes below 2**-126: where
 * 1 + exp(-v) passes 2**126 (v from about -87.3 to -88.7) SiLU gives -0 instead of
 * a value under 2e-36 on some CPUs (AVX2 without AVX-512).
 *
 * Row-major, contiguous rows; rows split across `num_threads` OpenMP threads
 * (torch's pool: see replicas/attention/native_kernels.py).
 *
 * With AVX512-BF16 (the library is built with -march=native) sixteen values narrow
 * in one instruction (vcvtneps2bf16: nearest even, NaN quieted, as narrow() below),
 * where narrow()'s integer rounding took most of these loops' time. The instruction
 * turns float32 denormals (below 1.2e-38) into zeros of the same sign: no bfloat16
 * activation of a layer is that small in practice, and where one is, the result is
 * one of those zeros instead of a denormal.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

/* NOTE: below this many elements a thread team costs more than it saves */
#define PARALLEL_MIN_ELEMENTS 32768
/* exp(-v) overflows float32 below this; torch's v / (1 + inf) is then -0 */
#define SILU_ZERO_BELOW (-88.72f)

static inline __attribute__((always_inline)) float widen(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}

/* Round to nearest even, as torch narrows float32 to bfloat16 (NaN stays NaN). */
static inline __attribute__((always_inline)) uint16_t narrow(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    /* NOTE: both results, then a select: a branch would keep the loops scalar */
    const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (x.u >> 16) | 0x40u;
    return (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

#if defined(__AVX512BF16__)
#define VEC 16
static inline __attribute__((always_inline)) __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* narrow, then widen back: the float32 value of its bfloat16 rounding */
static inline __attribute__((always_inline)) __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

static inline __attribute__((always_inline)) void store16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(x));
}
#else
#define VEC 0  /* no vector loops: the scalar ones do every element */
#endif

/* out = weight * bf16(h * rsqrt(mean(h^2) + eps)), h = x, or bf16(x + residual)
 * written to sum_out (the residual stream's next value) when residual is given. */
void rms_norm_bf16(const uint16_t *x, const uint16_t *residual, uint16_t *sum_out,
                   const uint16_t *weight, uint16_t *out, int64_t T, int64_t D, float eps,
                   int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * D >= PARALLEL_MIN_ELEMENTS) \
        schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *h = x + t * D;
        if (residual != 0) {
            const uint16_t *r = residual + t * D;
            uint16_t *s = sum_out + t * D;
            int64_t i = 0;
#if VEC
            for (; i + VEC <= D; i += VEC)
                store16(s + i, _mm512_add_ps(widen16(h + i), widen16(r + i)));
#endif
            for (; i < D; i++) s[i] = narrow(widen(h[i]) + widen(r[i]));
            h = s;
        }
        float sum_sq = 0.0f;
        for (int64_t i = 0; i < D; i++) {
            const float v = widen(h[i]);
            sum_sq += v * v;
        }
        /* NOTE: -ffast-math (needed for glibc's vectorised expf) would turn 1 / sqrt
         * into an approximate rsqrt: the empty asm keeps an exact sqrt and division,
         * as torch's (whose mean multiplies by 1 / D, as this one compiles to) */
        float root = sqrtf(sum_sq * (1.0f / (float)D) + eps);
        __asm__("" : "+x"(root));
        const float scale = 1.0f / root;
        uint16_t *o = out + t * D;
        int64_t i = 0;
#if VEC
        for (; i + VEC <= D; i += VEC)
            store16(o + i, _mm512_mul_ps(widen16(weight + i),
                                         round16(_mm512_mul_ps(widen16(h + i),
                                                               _mm512_set1_ps(scale)))));
#endif
        for (; i < D; i++)
            o[i] = narrow(widen(weight[i]) * widen(narrow(widen(h[i]) * scale)));
    }
}

/* NOTE: an explicit zero where exp overflows: -ffast-math divides by an approximate
 * reciprocal, and that of infinity gives 0 * inf = NaN */
static inline __attribute__((always_inline)) float silu_of(float v) {
    return v < SILU_ZERO_BELOW ? -0.0f : v / (1.0f + expf(-v));
}

#define SILU_CHUNK 256

/* out[t] = bf16(bf16(silu(gate)) * up), gate and up the halves of gate_up[t]. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int64_t I,
                   int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_MIN_ELEMENTS) \
        schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * 2 * I;
        const uint16_t *u = g + I;
        uint16_t *o = out + t * I;
        /* NOTE: SiLU in float32 by the compiler's own vector loop (glibc's vector
         * expf), a chunk at a time into scratch; with AVX512-BF16 the roundings and
         * the product in vector instructions */
        float silu[SILU_CHUNK];
        for (int64_t i0 = 0; i0 < I; i0 += SILU_CHUNK) {
            const int64_t n = I - i0 < SILU_CHUNK ? I - i0 : SILU_CHUNK;
            for (int64_t i = 0; i < n; i++) silu[i] = silu_of(widen(g[i0 + i]));
            int64_t i = 0;
#if VEC
            for (; i + VEC <= n; i += VEC)
                store16(o + i0 + i, _mm512_mul_ps(round16(_mm512_loadu_ps(silu + i)),
                                                  widen16(u + i0 + i)));
#endif
            for (; i < n; i++) o[i0 + i] = narrow(widen(narrow(silu[i])) * widen(u[i0 + i]));
        }
    }
}

/* Rotary embedding (rotate-half layout) of the q and k heads at the front of each
 * qkv row (row_stride elements apart), written to contiguous q (T, num_heads, d) and
 * k (T, num_kv_heads, d): y = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)),
 * cos and sin (T, d) in bfloat16. */
void rotary_bf16(const uint16_t *qkv, int64_t row_stride, const uint16_t *cos_table,
                 const uint16_t *sin_table, uint16_t *q_out, uint16_t *k_out, int64_t T,
                 int64_t num_heads, int64_t num_kv_heads, int64_t d, int num_threads) {
    const int64_t half = d / 2;
    const int64_t heads = num_heads + num_kv_heads;
    #pragma omp parallel for num_threads(num_threads) \
        if (T * heads * d >= PARALLEL_MIN_ELEMENTS) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *c = cos_table + t * d, *s = sin_table + t * d;
        for (int64_t j = 0; j < heads; j++) {
            const uint16_t *x = qkv + t * row_stride + j * d;
            uint16_t *y = j < num_heads ? q_out + (t * num_heads + j) * d
                                        : k_out + (t * num_kv_heads + j - num_heads) * d;
#if VEC
            if (half % VEC == 0) {
                for (int64_t i = 0; i < half; i += VEC) {
                    const __m512 lo = widen16(x + i), hi = widen16(x + i + half);
                    store16(y + i, _mm512_add_ps(round16(_mm512_mul_ps(lo, widen16(c + i))),
                                                 round16(_mm512_mul_ps(
                                                     _mm512_xor_ps(hi, _mm512_set1_ps(-0.0f)),
                                                     widen16(s + i)))));
                    store16(y + i + half,
                            _mm512_add_ps(round16(_mm512_mul_ps(hi, widen16(c + i + half))),
                                          round16(_mm512_mul_ps(lo, widen16(s + i + half)))));
                }
                continue;
            }
#endif
            for (int64_t i = 0; i < half; i++) {
                const float a = widen(narrow(widen(x[i]) * widen(c[i])));
                const float b = widen(narrow(-widen(x[i + half]) * widen(s[i])));
                y[i] = narrow(a + b);
            }
            for (int64_t i = half; i < d; i++) {
                const float a = widen(narrow(widen(x[i]) * widen(c[i])));
                const float b = widen(narrow(widen(x[i - half]) * widen(s[i])));
                y[i] = narrow(a + b);
            }
        }
    }
}
