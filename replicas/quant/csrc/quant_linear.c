/* y = x @ W.T with W kept quantized: the weights are read as they are stored.
 *
 * Why: decode at small batches reads every weight once per token, so its time is
 * the weights' bytes over the memory bandwidth. A 4-bit weight is an eighth of a
 * float32 one. Dequantizing in registers and multiplying in float would be bound by
 * arithmetic instead; so, as the fastest CPU engines do, the activations are
 * quantized too (int8, one scale per 32 values) and each 32-value group becomes an
 * integer dot product (maddubs on AVX2, vpdpbusd with AVX512-VNNI).
 *
 * Weight layouts (replicas/quant/layouts.py builds them):
 *   u4: per row K/2 bytes; group g (32 values) is 16 bytes whose low nibbles are
 *       values 32g..32g+15 and high nibbles 32g+16..32g+31 (llama.cpp's Q4 order).
 *       value = scale[g] * code + min[g], code in 0..15.
 *   s8: per row K bytes of signed codes; value = scale[g] * code (+ min[g] if given);
 *       groups of 32 or 16 values.
 * Scales and mins: one per group, float16 or float32 (float16 where the source's
 * values are exactly float16, as Q4_0/Q4_1/Q5_x/Q8_0's are).
 *
 * Activations: block of 32: d = max|x| / 127, q = round(x / d); per 16 values the
 * sum of q times d, so a group's min term is min * sum(x) without another pass.
 *
 * Portable: the scalar paths compute the same integer dot products; the library
 * is built with -march=native, so a CPU gets the paths its flags allow.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QBLOCK 32
/* weight rows a thread takes at a time: enough to amortise the scheduling, few
 * enough that every thread gets a share of a 576-row matrix */
#define ROWS_PER_TASK 16
/* activation rows dotted against one loaded weight group */
#define MTILE 4

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (x.u >> 16) | 0x40u;
    return (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* IEEE half -> float, exact (normals, subnormals, inf, NaN) */
static inline __attribute__((always_inline)) float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  /* subnormal: normalise */
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    union { uint32_t u; float f; } x;
    x.u = bits;
    return x.f;
#endif
}

static inline __attribute__((always_inline)) float load_scale(const void *p, int64_t i, int half) {
    return half ? f16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- activations ------------------------------------------------------- */

/* One block of 32 values: codes, d, and d * sum per 16 values. */
static void quantize_block(const void *x, int x_bf16, int64_t offset, int8_t *q, float *d_out,
                           float *sums_out) {
    float v[QBLOCK];
    if (x_bf16) {
        const uint16_t *xb = (const uint16_t *)x + offset;
        for (int i = 0; i < QBLOCK; i++) v[i] = bf16_to_f32(xb[i]);
    } else {
        memcpy(v, (const float *)x + offset, sizeof v);
    }
    float amax = 0.0f;
    for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int s0 = 0, s1 = 0;
    for (int i = 0; i < QBLOCK; i++) {
        const int c = (int)lrintf(v[i] * inv);
        q[i] = (int8_t)c;
        if (i < 16) s0 += c; else s1 += c;
    }
    *d_out = d;
    sums_out[0] = d * (float)s0;
    sums_out[1] = d * (float)s1;
}

typedef struct {
    int8_t *q;     /* M * K */
    float *d;      /* M * K/32 */
    float *sums;   /* M * K/16 */
} QuantizedActs;

static __thread void *scratch = NULL;
static __thread size_t scratch_bytes = 0;

static int acts_alloc(QuantizedActs *a, int64_t M, int64_t K) {
    const size_t nq = (size_t)(M * K), nb = (size_t)(M * K / QBLOCK);
    const size_t need = ((nq + 63) & ~(size_t)63) + nb * sizeof(float) * 3;
    if (need > scratch_bytes) {
        free(scratch);
        scratch = malloc(need);
        scratch_bytes = scratch ? need : 0;
        if (!scratch) return -1;
    }
    a->q = (int8_t *)scratch;
    a->d = (float *)((char *)scratch + ((nq + 63) & ~(size_t)63));
    a->sums = a->d + nb;
    return 0;
}

/* ---- one weight row against up to MTILE activation rows ----------------- */

#if defined(__AVX2__)
static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __attribute__((always_inline)) float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* codes_u4: the u4 layout, else s8; group: 32, or 16 (s8 only); mins may be NULL. */
static inline __attribute__((always_inline)) void row_dot(
        const uint8_t *w, const void *scales, const void *mins, int64_t row, int half,
        int codes_u4, int64_t group, const QuantizedActs *a, int64_t m0, int mt, int64_t K,
        float *res) {
    const int64_t nblk = K / QBLOCK, ngroups = K / group;
    const int64_t sbase = row * ngroups;
#if defined(__AVX2__)
    __m256 acc[MTILE];
    float minacc[MTILE];
    for (int r = 0; r < mt; r++) { acc[r] = _mm256_setzero_ps(); minacc[r] = 0.0f; }
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nblk; b++) {
        __m256i wv;
        if (codes_u4) {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + b * 16));
            wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                  _mm_and_si128(bytes, low4));
        } else {
            wv = _mm256_loadu_si256((const __m256i *)(w + b * 32));
        }
        const __m256i wabs = codes_u4 ? wv : _mm256_sign_epi8(wv, wv);
        float s0, s1, mn0 = 0.0f, mn1 = 0.0f;
        if (group == 32) {
            s0 = s1 = load_scale(scales, sbase + b, half);
            if (mins) mn0 = mn1 = load_scale(mins, sbase + b, half);
        } else {
            s0 = load_scale(scales, sbase + 2 * b, half);
            s1 = load_scale(scales, sbase + 2 * b + 1, half);
            if (mins) { mn0 = load_scale(mins, sbase + 2 * b, half);
                        mn1 = load_scale(mins, sbase + 2 * b + 1, half); }
        }
        for (int r = 0; r < mt; r++) {
            const int64_t m = m0 + r;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + m * K + b * 32));
            /* NOTE: signed codes: |w| times x with w's sign, so maddubs' unsigned side is |w| */
            if (!codes_u4) xv = _mm256_sign_epi8(xv, wv);
            const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wabs, xv));
            const float dx = a->d[m * nblk + b];
            const __m256 scale = _mm256_set_m128(_mm_set1_ps(s1 * dx), _mm_set1_ps(s0 * dx));
            acc[r] = _mm256_fmadd_ps(dot, scale, acc[r]);
            if (mins) {
                const float *sums = a->sums + m * 2 * nblk + 2 * b;
                minacc[r] += mn0 * sums[0] + mn1 * sums[1];
            }
        }
    }
    for (int r = 0; r < mt; r++) res[r] = hsum(acc[r]) + minacc[r];
#else
    for (int r = 0; r < mt; r++) res[r] = 0.0f;
    for (int64_t b = 0; b < nblk; b++) {
        int8_t wq[QBLOCK];
        if (codes_u4) {
            for (int j = 0; j < 16; j++) {
                wq[j] = (int8_t)(w[b * 16 + j] & 0x0f);
                wq[j + 16] = (int8_t)(w[b * 16 + j] >> 4);
            }
        } else {
            memcpy(wq, w + b * 32, QBLOCK);
        }
        float s0, s1, mn0 = 0.0f, mn1 = 0.0f;
        if (group == 32) {
            s0 = s1 = load_scale(scales, sbase + b, half);
            if (mins) mn0 = mn1 = load_scale(mins, sbase + b, half);
        } else {
            s0 = load_scale(scales, sbase + 2 * b, half);
            s1 = load_scale(scales, sbase + 2 * b + 1, half);
            if (mins) { mn0 = load_scale(mins, sbase + 2 * b, half);
                        mn1 = load_scale(mins, sbase + 2 * b + 1, half); }
        }
        for (int r = 0; r < mt; r++) {
            const int64_t m = m0 + r;
            const int8_t *xq = a->q + m * K + b * 32;
            int32_t p0 = 0, p1 = 0;
            for (int j = 0; j < 16; j++) p0 += (int32_t)wq[j] * xq[j];
            for (int j = 16; j < 32; j++) p1 += (int32_t)wq[j] * xq[j];
            const float dx = a->d[m * nblk + b];
            res[r] += (s0 * dx) * (float)p0 + (s1 * dx) * (float)p1;
            if (mins) {
                const float *sums = a->sums + m * 2 * nblk + 2 * b;
                res[r] += mn0 * sums[0] + mn1 * sums[1];
            }
        }
    }
#endif
}

/* Specialised copies of row_dot, so the per-group branches fold away. */
#define ROW_DOT_VARIANT(NAME, HALF, U4, GROUP)                                              \
    static void NAME(const uint8_t *w, const void *s, const void *mn, int64_t row,           \
                     const QuantizedActs *a, int64_t m0, int mt, int64_t K, float *res) {    \
        row_dot(w, s, mn, row, HALF, U4, GROUP, a, m0, mt, K, res);                          \
    }
ROW_DOT_VARIANT(dot_u4_f16, 1, 1, 32)
ROW_DOT_VARIANT(dot_u4_f32, 0, 1, 32)
ROW_DOT_VARIANT(dot_s8_f16, 1, 0, 32)
ROW_DOT_VARIANT(dot_s8_f32, 0, 0, 32)
ROW_DOT_VARIANT(dot_s8g16_f16, 1, 0, 16)
ROW_DOT_VARIANT(dot_s8g16_f32, 0, 0, 16)

typedef void (*RowDot)(const uint8_t *, const void *, const void *, int64_t,
                       const QuantizedActs *, int64_t, int, int64_t, float *);

static RowDot pick_row_dot(int codes_u4, int64_t group, int half) {
    if (codes_u4) return half ? dot_u4_f16 : dot_u4_f32;
    if (group == 16) return half ? dot_s8g16_f16 : dot_s8g16_f32;
    return half ? dot_s8_f16 : dot_s8_f32;
}

/* ---- entry points ------------------------------------------------------ */

static int layout_ok(int codes_u4, int64_t group, int64_t K) {
    return K % QBLOCK == 0 && (group == 32 || (group == 16 && !codes_u4));
}


/* out (M, N) = x (M, K) @ W.T (no bias: the caller adds it), row m of the output at
 * out + m * out_stride elements, so parts of a fused layer write their own columns.
 * Returns 0, or
 * -1 for shapes the layout cannot hold (K not a multiple of 32, a group other than
 * 32, or 16 with u4), -2 when scratch memory cannot be had. */
int quant_linear(const void *x, int x_bf16, int64_t M, int64_t K,
                 const uint8_t *codes, int codes_u4, const void *scales, const void *mins,
                 int scales_half, int64_t group, void *out, int out_bf16, int64_t N,
                 int64_t out_stride, int num_threads) {
    if (!layout_ok(codes_u4, group, K) || M < 0 || N < 0) return -1;
    if (num_threads < 1) num_threads = 1;
    QuantizedActs a;
    if (acts_alloc(&a, M, K)) return -2;
    const int64_t nblk = K / QBLOCK, row_bytes = codes_u4 ? K / 2 : K;
    const RowDot dot = pick_row_dot(codes_u4, group, scales_half);
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M * nblk; i++) {
            quantize_block(x, x_bf16, i * QBLOCK, a.q + i * QBLOCK, a.d + i, a.sums + 2 * i);
        }
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS_PER_TASK) {
            const int64_t n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
            float res[MTILE];
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *w = codes + n * row_bytes;
                for (int64_t m0 = 0; m0 < M; m0 += MTILE) {
                    const int mt = (int)(M - m0 < MTILE ? M - m0 : MTILE);
                    dot(w, scales, mins, n, &a, m0, mt, K, res);
                    for (int r = 0; r < mt; r++) {
                        const int64_t at = (m0 + r) * out_stride + n;
                        if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(res[r]);
                        else ((float *)out)[at] = res[r];
                    }
                }
            }
        }
    }
    return 0;
}

/* One weight row as floats (or bfloat16, rounded to nearest even): scale * code,
 * plus min where given. */
static void dequant_row(const uint8_t *codes, int codes_u4, const void *scales, const void *mins,
                        int half, int64_t group, int64_t row, int64_t K, void *out, int out_bf16) {
    const int64_t ngroups = K / group, row_bytes = codes_u4 ? K / 2 : K;
    const uint8_t *w = codes + row * row_bytes;
    for (int64_t k = 0; k < K; k++) {
        int code;
        if (codes_u4) {
            const int64_t b = k / QBLOCK, j = k % QBLOCK;
            const uint8_t byte = w[b * 16 + (j & 15)];
            code = j < 16 ? (byte & 0x0f) : (byte >> 4);
        } else {
            code = (int8_t)w[k];
        }
        const int64_t g = row * ngroups + k / group;
        float v = load_scale(scales, g, half) * (float)code;
        if (mins) v += load_scale(mins, g, half);
        if (out_bf16) ((uint16_t *)out)[k] = f32_to_bf16(v);
        else ((float *)out)[k] = v;
    }
}

/* out (N, K) = every weight row, as dequant_row writes it. Returns -1 for a layout
 * it cannot hold. */
int quant_dequantize(const uint8_t *codes, int codes_u4, const void *scales, const void *mins,
                     int scales_half, int64_t group, int64_t N, int64_t K, void *out,
                     int out_bf16, int num_threads) {
    if (!layout_ok(codes_u4, group, K)) return -1;
    if (num_threads < 1) num_threads = 1;
    const size_t row_out = (size_t)K * (out_bf16 ? 2 : 4);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++)
        dequant_row(codes, codes_u4, scales, mins, scales_half, group, n, K,
                    (char *)out + n * row_out, out_bf16);
    return 0;
}

/* out (M, K) = weight rows `ids` (an embedding lookup). Returns -1 for a layout it
 * cannot hold, -3 for an id outside [0, N). */
int quant_gather_rows(const uint8_t *codes, int codes_u4, const void *scales, const void *mins,
                      int scales_half, int64_t group, int64_t N, int64_t K, const int64_t *ids,
                      int64_t M, void *out, int out_bf16) {
    if (!layout_ok(codes_u4, group, K)) return -1;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= N) return -3;
    const size_t row_out = (size_t)K * (out_bf16 ? 2 : 4);
    for (int64_t m = 0; m < M; m++)
        dequant_row(codes, codes_u4, scales, mins, scales_half, group, ids[m], K,
                    (char *)out + m * row_out, out_bf16);
    return 0;
}
