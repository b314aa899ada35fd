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
 * Activations: per 16 values two int8 codes (see quantize_block), so a dot is two
 * integer dots; per 32 the sum of the values as coded, so a group's min term is
 * min * sum(x) without another pass.
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define WIDE512 1
#endif
/* weight rows a thread takes at a time: enough to amortise the scheduling, few
 * enough that every thread gets a share of a 576-row matrix */
#define ROWS_PER_TASK 16

/* A quantized weight as kernel.py's ctypes Structure mirrors it. */
typedef struct {
    const uint8_t *codes;   /* u4: (N, K/2) bytes; s8: (N, K) signed bytes */
    const void *scales;     /* (N, K/group), float16 or float32 */
    const void *mins;       /* like scales, or NULL; only with groups of 32 */
    int64_t out_features;   /* N */
    int64_t in_features;    /* K */
    int64_t group;          /* 32, or 16 (s8 only) */
    int32_t codes_u4;
    int32_t scales_half;
} QuantWeight;

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

typedef struct {
    int8_t *q;     /* M * K codes */
    int8_t *lo;    /* M * K second codes (the rest of each value) */
    float *d;      /* M * K/16 scales, one per 16 values */
    float *sums;   /* M * K/32: per block of 32, the sum of its values as quantized */
    int64_t K, nblk;
} Acts;

/* One block of 32 values, per 16 values: d = max|x| / 127, hi = round(x / d), and
 * the rest in a second code, lo = round((x - d * hi) * 256 / d): x = d/256 * (256 hi
 * + lo) to about 1/65,000 of the largest of the 16, where one code alone keeps 1/254
 * (measured: a near-tie of the trained model's first answer flipped). Stored: d/256
 * per 16, and the sum of the values as coded per 32, for the min term. */
static void quantize_block(const void *x, int x_bf16, int64_t offset, int8_t *hi, int8_t *lo,
                           float *d_out, float *sum_out) {
    float v[QBLOCK];
    if (x_bf16) {
        const uint16_t *xb = (const uint16_t *)x + offset;
        for (int i = 0; i < QBLOCK; i++) v[i] = bf16_to_f32(xb[i]);
    } else {
        memcpy(v, (const float *)x + offset, sizeof v);
    }
    float total = 0.0f;
    for (int h = 0; h < 2; h++) {
        const float *vh = v + 16 * h;
        float amax = 0.0f;
        for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(vh[i]));
        const float d = amax / 127.0f;
        const float inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 16; i++) {
            const int c = (int)lrintf(vh[i] * inv);
            int r = (int)lrintf((vh[i] - d * (float)c) * inv * 256.0f);
            r = r > 127 ? 127 : (r < -127 ? -127 : r);
            hi[16 * h + i] = (int8_t)c;
            lo[16 * h + i] = (int8_t)r;
            sum += 256 * c + r;
        }
        d_out[h] = d / 256.0f;
        /* NOTE: the codes' sum, not the values': the min term then pairs the same
         * rounded activations as the codes' dot */
        total += d_out[h] * (float)sum;
    }
    *sum_out = total;
}

static __thread void *scratch = NULL;
static __thread size_t scratch_bytes = 0;

static int acts_alloc(Acts *a, int64_t M, int64_t K) {
    const size_t nq = (size_t)(M * K), nb = (size_t)(M * K / QBLOCK);
    const size_t codes = (nq + 63) & ~(size_t)63;
    const size_t need = 2 * codes + nb * sizeof(float) * 3;
    if (need > scratch_bytes) {
        free(scratch);
        scratch = malloc(need);
        scratch_bytes = scratch ? need : 0;
        if (!scratch) return -1;
    }
    a->q = (int8_t *)scratch;
    a->lo = (int8_t *)scratch + codes;
    a->d = (float *)((char *)scratch + 2 * codes);
    a->sums = a->d + 2 * nb;
    a->K = K;
    a->nblk = K / QBLOCK;
    return 0;
}

/* ---- tiles: R weight rows against MR activation rows --------------------- */

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

/* 8 finite floats -> bfloat16, rounded to nearest even (weights are finite) */
static inline __attribute__((always_inline)) __m128i narrow8(__m256 v) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    return (__m128i)_mm256_cvtneps_pbh(v);
#else
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
#endif
}
#endif

/* sum over the row's groups of min * (sum of the quantized values): the mins' share */
static inline __attribute__((always_inline)) float min_term(const QuantWeight *w, int half,
                                                            int64_t row, const float *sums,
                                                            int64_t ngroups) {
    int64_t g = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; g + 8 <= ngroups; g += 8) {
        const int64_t at = row * ngroups + g;
        const __m256 mn = half
            ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w->mins + at)))
            : _mm256_loadu_ps((const float *)w->mins + at);
        acc = _mm256_fmadd_ps(mn, _mm256_loadu_ps(sums + g), acc);
    }
    total = hsum(acc);
#endif
    for (; g < ngroups; g++) total += load_scale(w->mins, row * ngroups + g, half) * sums[g];
    return total;
}

static inline __attribute__((always_inline)) void tile(
        const QuantWeight *w, const int U4, const int HALF, const int G16, const int R,
        const int MR, int64_t row0, const Acts *a, int64_t m0, float *res) {
    const int64_t K = a->K, nblk = a->nblk, ngroups = K / (G16 ? 16 : 32);
    const int64_t row_bytes = U4 ? K / 2 : K;
#if defined(__AVX2__)
    __m256 acc[4 * 4];
    for (int i = 0; i < R * MR; i++) acc[i] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0f);
    int64_t b = 0;
#if defined(WIDE512)
    /* NOTE: two blocks an iteration in 512-bit registers: half the instructions of
     * the 256-bit loop below, which then takes an odd last block */
    __m512 acc5[4 * 4];
    for (int i = 0; i < R * MR; i++) acc5[i] = _mm512_setzero_ps();
    const __m512i idx16 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (; b + 2 <= nblk; b += 2) {
        __m512i wv[4];
        __m512 sv[4];
        __mmask64 negative[4];
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w->codes + (row0 + r) * row_bytes;
            /* NOTE: a few cache lines ahead of the loads: the rows stream from memory */
            _mm_prefetch((const char *)(wr + R * row_bytes + b * (U4 ? 16 : 32)), _MM_HINT_T0);
            if (U4) {
                const __m256i bytes = _mm256_loadu_si256((const __m256i *)(wr + b * 16));
                const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi8(0x0f));
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0f));
                /* [b low, b+1 low, b high, b+1 high] -> value order [b low, b high, b+1 low, b+1 high] */
                const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
                wv[r] = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
            } else {
                const __m512i codes = _mm512_loadu_si512((const void *)(wr + b * 32));
                negative[r] = _mm512_movepi8_mask(codes);
                wv[r] = _mm512_abs_epi8(codes);
            }
            const int64_t sg = (row0 + r) * ngroups + (G16 ? 2 * b : b);
            if (G16) {
                const __m128 s4 = _mm_set_ps(load_scale(w->scales, sg + 3, HALF),
                                             load_scale(w->scales, sg + 2, HALF),
                                             load_scale(w->scales, sg + 1, HALF),
                                             load_scale(w->scales, sg, HALF));
                sv[r] = _mm512_permutexvar_ps(idx16, _mm512_castps128_ps512(s4));
            } else {
                sv[r] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(load_scale(w->scales, sg, HALF))),
                                           _mm256_set1_ps(load_scale(w->scales, sg + 1, HALF)), 1);
            }
        }
        for (int m = 0; m < MR; m++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(a->q + (m0 + m) * K + b * 32));
            const __m512i xl = _mm512_loadu_si512((const void *)(a->lo + (m0 + m) * K + b * 32));
            /* NOTE: the four scales of these 64 values, one per 16 (4 int32 lanes) */
            const __m512 dxv = _mm512_permutexvar_ps(idx16, _mm512_castps128_ps512(
                _mm_loadu_ps(a->d + 2 * ((m0 + m) * nblk + b))));
            for (int r = 0; r < R; r++) {
                /* NOTE: signed codes: |w| times x with w's sign */
                const __m512i xs = U4 ? xv : _mm512_mask_sub_epi8(xv, negative[r], _mm512_setzero_si512(), xv);
                const __m512i ls = U4 ? xl : _mm512_mask_sub_epi8(xl, negative[r], _mm512_setzero_si512(), xl);
                /* 256 * (w . hi) + (w . lo) */
                const __m512i dots = _mm512_add_epi32(
                    _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], xs), 8),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], ls));
                const __m512 dot = _mm512_cvtepi32_ps(dots);
                acc5[r * MR + m] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dxv), sv[r], acc5[r * MR + m]);
            }
        }
    }
    for (int i = 0; i < R * MR; i++)
        acc[i] = _mm256_add_ps(_mm512_castps512_ps256(acc5[i]), _mm512_extractf32x8_ps(acc5[i], 1));
#endif
    for (; b < nblk; b++) {
        __m256i wv[4], wabs[4];
        float s0[4], s1[4];
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w->codes + (row0 + r) * row_bytes;
            if (U4) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                wv[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                         _mm_and_si128(bytes, low4));
                wabs[r] = wv[r];
            } else {
                wv[r] = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
                /* NOTE: |w| on the unsigned side of the product, w's sign moved onto x */
                wabs[r] = _mm256_sign_epi8(wv[r], wv[r]);
            }
            const int64_t sg = (row0 + r) * ngroups + (G16 ? 2 * b : b);
            s0[r] = load_scale(w->scales, sg, HALF);
            s1[r] = G16 ? load_scale(w->scales, sg + 1, HALF) : s0[r];
        }
        for (int m = 0; m < MR; m++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + m) * K + b * 32));
            const __m256i xl = _mm256_loadu_si256((const __m256i *)(a->lo + (m0 + m) * K + b * 32));
            const float *dx = a->d + 2 * ((m0 + m) * nblk + b);
            for (int r = 0; r < R; r++) {
                const __m256i xs = U4 ? xv : _mm256_sign_epi8(xv, wv[r]);
                const __m256i ls = U4 ? xl : _mm256_sign_epi8(xl, wv[r]);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(
                    _mm256_slli_epi32(dot_u8s8(wabs[r], xs), 8), dot_u8s8(wabs[r], ls)));
                const __m256 scale = _mm256_set_m128(_mm_set1_ps(s1[r] * dx[1]),
                                                     _mm_set1_ps(s0[r] * dx[0]));
                acc[r * MR + m] = _mm256_fmadd_ps(dot, scale, acc[r * MR + m]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MR; m++) res[r * MR + m] = hsum(acc[r * MR + m]);
#else
    for (int i = 0; i < R * MR; i++) res[i] = 0.0f;
    for (int64_t b = 0; b < nblk; b++) {
        for (int r = 0; r < R; r++) {
            const uint8_t *wr = w->codes + (row0 + r) * row_bytes;
            int8_t wq[QBLOCK];
            if (U4) {
                for (int j = 0; j < 16; j++) {
                    wq[j] = (int8_t)(wr[b * 16 + j] & 0x0f);
                    wq[j + 16] = (int8_t)(wr[b * 16 + j] >> 4);
                }
            } else {
                memcpy(wq, wr + b * 32, QBLOCK);
            }
            const int64_t sg = (row0 + r) * ngroups + (G16 ? 2 * b : b);
            const float s0 = load_scale(w->scales, sg, HALF);
            const float s1 = G16 ? load_scale(w->scales, sg + 1, HALF) : s0;
            for (int m = 0; m < MR; m++) {
                const int8_t *xq = a->q + (m0 + m) * K + b * 32;
                const int8_t *xl = a->lo + (m0 + m) * K + b * 32;
                int32_t p0 = 0, p1 = 0;
                for (int j = 0; j < 16; j++) p0 += (int32_t)wq[j] * (256 * xq[j] + xl[j]);
                for (int j = 16; j < 32; j++) p1 += (int32_t)wq[j] * (256 * xq[j] + xl[j]);
                const float *dx = a->d + 2 * ((m0 + m) * nblk + b);
                res[r * MR + m] += (s0 * dx[0]) * (float)p0 + (s1 * dx[1]) * (float)p1;
            }
        }
    }
#endif
    if (w->mins) {
        for (int r = 0; r < R; r++)
            for (int m = 0; m < MR; m++)
                res[r * MR + m] += min_term(w, HALF, row0 + r, a->sums + (m0 + m) * nblk, ngroups);
    }
}

static inline __attribute__((always_inline)) void store(void *out, int out_bf16, int64_t at,
                                                        float v) {
    if (out_bf16) ((uint16_t *)out)[at] = f32_to_bf16(v);
    else ((float *)out)[at] = v;
}

/* Output columns [n0, n1) for every activation row: 4 weight rows a tile when there
 * is one activation row (decode), 2 weight x 4 activation rows otherwise; then
 * what is left over, one by one. */
static inline __attribute__((always_inline)) void rows_task(
        const QuantWeight *w, const int U4, const int HALF, const int G16, const Acts *a,
        int64_t M, int64_t n0, int64_t n1, void *out, int out_bf16, int64_t ldo) {
    float res[16];
    int64_t n = n0;
    if (M == 1) {
        for (; n + 4 <= n1; n += 4) {
            tile(w, U4, HALF, G16, 4, 1, n, a, 0, res);
            for (int r = 0; r < 4; r++) store(out, out_bf16, n + r, res[r]);
        }
    } else {
        for (; n + 2 <= n1; n += 2) {
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) {
                tile(w, U4, HALF, G16, 2, 4, n, a, m, res);
                for (int r = 0; r < 2; r++)
                    for (int i = 0; i < 4; i++)
                        store(out, out_bf16, (m + i) * ldo + n + r, res[r * 4 + i]);
            }
            for (; m < M; m++) {
                tile(w, U4, HALF, G16, 2, 1, n, a, m, res);
                for (int r = 0; r < 2; r++) store(out, out_bf16, m * ldo + n + r, res[r]);
            }
        }
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            tile(w, U4, HALF, G16, 1, 1, n, a, m, res);
            store(out, out_bf16, m * ldo + n, res[0]);
        }
}

typedef void (*RowsTask)(const QuantWeight *, const Acts *, int64_t, int64_t, int64_t, void *,
                         int, int64_t);

/* Specialised copies, so every layout test folds away inside the loops. */
#define ROWS_VARIANT(NAME, U4, HALF, G16)                                                  \
    static void NAME(const QuantWeight *w, const Acts *a, int64_t M, int64_t n0, int64_t n1, \
                     void *out, int out_bf16, int64_t ldo) {                                \
        rows_task(w, U4, HALF, G16, a, M, n0, n1, out, out_bf16, ldo);                      \
    }
ROWS_VARIANT(rows_u4_f16, 1, 1, 0)
ROWS_VARIANT(rows_u4_f32, 1, 0, 0)
ROWS_VARIANT(rows_s8_f16, 0, 1, 0)
ROWS_VARIANT(rows_s8_f32, 0, 0, 0)
ROWS_VARIANT(rows_s8g16_f16, 0, 1, 1)
ROWS_VARIANT(rows_s8g16_f32, 0, 0, 1)

static RowsTask pick_rows_task(const QuantWeight *w) {
    if (w->codes_u4) return w->scales_half ? rows_u4_f16 : rows_u4_f32;
    if (w->group == 16) return w->scales_half ? rows_s8g16_f16 : rows_s8g16_f32;
    return w->scales_half ? rows_s8_f16 : rows_s8_f32;
}

/* One block's 32 weights as floats: scale * code, plus min where given. */
static inline __attribute__((always_inline)) void block_values(const QuantWeight *qw, int64_t row,
                                                               int64_t b, float *v) {
    const int64_t K = qw->in_features, per_block = QBLOCK / qw->group;
    const uint8_t *w = qw->codes + row * (qw->codes_u4 ? K / 2 : K);
    int8_t codes[QBLOCK];
    if (qw->codes_u4) {
#if defined(__AVX2__)
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + b * 16));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        _mm_storeu_si128((__m128i *)codes, _mm_and_si128(bytes, low4));
        _mm_storeu_si128((__m128i *)(codes + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
#else
        for (int j = 0; j < 16; j++) {
            codes[j] = (int8_t)(w[b * 16 + j] & 0x0f);
            codes[j + 16] = (int8_t)(w[b * 16 + j] >> 4);
        }
#endif
    } else {
        memcpy(codes, w + b * QBLOCK, QBLOCK);
    }
    /* NOTE: groups of 16 take the block's two halves; of 32, one scale for both */
    const int64_t g = row * (K / qw->group) + b * per_block;
    const float s0 = load_scale(qw->scales, g, qw->scales_half);
    const float s1 = per_block == 2 ? load_scale(qw->scales, g + 1, qw->scales_half) : s0;
    const float m0 = qw->mins ? load_scale(qw->mins, g, qw->scales_half) : 0.0f;
    const float m1 = qw->mins && per_block == 2 ? load_scale(qw->mins, g + 1, qw->scales_half) : m0;
#if defined(__AVX2__)
    for (int j = 0; j < QBLOCK; j += 8) {
        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + j))));
        _mm256_storeu_ps(v + j, j < 16 ? _mm256_fmadd_ps(_mm256_set1_ps(s0), c, _mm256_set1_ps(m0))
                                       : _mm256_fmadd_ps(_mm256_set1_ps(s1), c, _mm256_set1_ps(m1)));
    }
#else
    for (int j = 0; j < 16; j++) v[j] = s0 * (float)codes[j] + m0;
    for (int j = 16; j < QBLOCK; j++) v[j] = s1 * (float)codes[j] + m1;
#endif
}

/* One block's 32 codes as two vectors of 16 int32 (values 0..15 and 16..31). */
#if defined(WIDE512)
static inline __attribute__((always_inline)) void block_codes16(const QuantWeight *qw,
                                                                const uint8_t *w, int64_t b,
                                                                __m512i *lo, __m512i *hi) {
    if (qw->codes_u4) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + b * 16));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        *lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, low4));
        *hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
    } else {
        *lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + b * 32)));
        *hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + b * 32 + 16)));
    }
}
#endif

/* One weight row as floats (or bfloat16, rounded to nearest even). */
static void dequant_row(const QuantWeight *qw, int64_t row, void *out, int out_bf16) {
    const int64_t K = qw->in_features, nblk = K / QBLOCK;
#if defined(WIDE512)
    /* NOTE: 16 values a vector, no trip through memory: this runs once per weight
     * per batch step (quant_gemm), so its cost is the batch path's overhead */
    const int64_t per_block = QBLOCK / qw->group, ngroups = K / qw->group;
    const uint8_t *w = qw->codes + row * (qw->codes_u4 ? K / 2 : K);
    for (int64_t b = 0; b < nblk; b++) {
        __m512i lo, hi;
        block_codes16(qw, w, b, &lo, &hi);
        const int64_t g = row * ngroups + b * per_block;
        const float s0 = load_scale(qw->scales, g, qw->scales_half);
        const float s1 = per_block == 2 ? load_scale(qw->scales, g + 1, qw->scales_half) : s0;
        const float m0 = qw->mins ? load_scale(qw->mins, g, qw->scales_half) : 0.0f;
        const float m1 = qw->mins && per_block == 2 ? load_scale(qw->mins, g + 1, qw->scales_half) : m0;
        const __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s0), _mm512_set1_ps(m0));
        const __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s1), _mm512_set1_ps(m1));
        if (out_bf16) {
#if defined(__AVX512BF16__)
            _mm512_storeu_si512((uint16_t *)out + b * QBLOCK, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
#else
            _mm_storeu_si128((__m128i *)((uint16_t *)out + b * QBLOCK), narrow8(_mm512_castps512_ps256(v0)));
            _mm_storeu_si128((__m128i *)((uint16_t *)out + b * QBLOCK + 8), narrow8(_mm512_extractf32x8_ps(v0, 1)));
            _mm_storeu_si128((__m128i *)((uint16_t *)out + b * QBLOCK + 16), narrow8(_mm512_castps512_ps256(v1)));
            _mm_storeu_si128((__m128i *)((uint16_t *)out + b * QBLOCK + 24), narrow8(_mm512_extractf32x8_ps(v1, 1)));
#endif
        } else {
            _mm512_storeu_ps((float *)out + b * QBLOCK, v0);
            _mm512_storeu_ps((float *)out + b * QBLOCK + 16, v1);
        }
    }
#else
    for (int64_t b = 0; b < nblk; b++) {
        float v[QBLOCK];
        block_values(qw, row, b, v);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + b * QBLOCK;
#if defined(__AVX2__)
            for (int j = 0; j < QBLOCK; j += 8)
                _mm_storeu_si128((__m128i *)(o + j), narrow8(_mm256_loadu_ps(v + j)));
#else
            for (int j = 0; j < QBLOCK; j++) o[j] = f32_to_bf16(v[j]);
#endif
        } else {
            memcpy((float *)out + b * QBLOCK, v, sizeof v);
        }
    }
#endif
}

/* ---- batches: weight tiles dequantized into L1, float arithmetic ----------- */

/* a tile: GEMM_NR weight rows x up to GEMM_MR activation rows, as many accumulators
 * as the registers hold (32 zmm: 4 x 6; 16 ymm: 4 x 4, measured faster than 4 x 2) */
#define GEMM_NR 4
#define GEMM_MR 6
#define GEMM_MR_BF16 6
#define GEMM_MR_F32 4

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define GEMM_BF16_DOT 1
/* bfloat16 activations against a tile of weights already rounded to bfloat16 (as a
 * bfloat16 model's are): 32 products a vdpbf16ps, float32 sums. wt: nr rows of K. */
static inline __attribute__((always_inline)) void gemm_tile_bf16(
        const uint16_t *wt, const uint16_t *x, int64_t K, const int nr, int64_t m0,
        const int mr, float *res) {
    __m512 acc[GEMM_NR][GEMM_MR];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += QBLOCK) {
        __m512bh wv[GEMM_NR];
        for (int r = 0; r < nr; r++) wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(wt + r * K + k));
        for (int m = 0; m < mr; m++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + m) * K + k));
            for (int r = 0; r < nr; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv[r], xv);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) res[r * GEMM_MR + m] = _mm512_reduce_add_ps(acc[r][m]);
}
#endif

/* float32 activations (bfloat16 ones widened first where there is no vdpbf16ps)
 * against a tile of float32 weights. */
static inline __attribute__((always_inline)) void gemm_tile_f32(
        const float *wt, const float *x, int64_t K, const int nr, int64_t m0, const int mr,
        float *res) {
#if defined(__AVX2__)
    __m256 acc[GEMM_NR][GEMM_MR];
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[GEMM_NR];
        for (int r = 0; r < nr; r++) wv[r] = _mm256_loadu_ps(wt + r * K + k);
        for (int m = 0; m < mr; m++) {
            const __m256 xv = _mm256_loadu_ps(x + (m0 + m) * K + k);
            for (int r = 0; r < nr; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) res[r * GEMM_MR + m] = hsum(acc[r][m]);
#else
    for (int r = 0; r < nr; r++)
        for (int m = 0; m < mr; m++) {
            float sum = 0.0f;
            for (int64_t k = 0; k < K; k++) sum += wt[r * K + k] * x[(m0 + m) * K + k];
            res[r * GEMM_MR + m] = sum;
        }
#endif
}

static __thread float *widened = NULL;
static __thread size_t widened_floats = 0;

/* ---- entry points ------------------------------------------------------ */

static int weight_ok(const QuantWeight *w) {
    return w->in_features % QBLOCK == 0 && w->in_features > 0 && w->out_features >= 0
        && (w->group == 32 || (w->group == 16 && !w->codes_u4 && !w->mins));
}

/* out (M, N) = x (M, K) @ W.T (no bias: the caller adds it), row m of the output at
 * out + m * out_stride elements, so parts of a fused layer write their own columns.
 * Returns 0, -1 for a weight the layouts cannot hold (K not a multiple of 32, groups
 * of 16 with u4 codes or with mins), -2 when scratch memory cannot be had. */
int quant_linear(const void *x, int x_bf16, int64_t M, const QuantWeight *w, void *out,
                 int out_bf16, int64_t out_stride, int num_threads) {
    if (!weight_ok(w) || M < 0) return -1;
    if (num_threads < 1) num_threads = 1;
    Acts a;
    if (acts_alloc(&a, M, w->in_features)) return -2;
    const RowsTask task = pick_rows_task(w);
    const int64_t N = w->out_features, nblk = a.nblk;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < M * nblk; i++)
            quantize_block(x, x_bf16, i * QBLOCK, a.q + i * QBLOCK, a.lo + i * QBLOCK, a.d + 2 * i,
                           a.sums + i);
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += ROWS_PER_TASK) {
            const int64_t n1 = n0 + ROWS_PER_TASK < N ? n0 + ROWS_PER_TASK : N;
            task(w, &a, M, n0, n1, out, out_bf16, out_stride);
        }
    }
    return 0;
}

/* out (M, N) = x (M, K) @ W.T like quant_linear, for batches: GEMM_NR weight rows
 * at a time are dequantized into a small buffer that stays in cache and multiplied
 * with every activation row in float (bfloat16 dot products where the CPU has
 * them), so no dequantized copy of the whole matrix is ever written. Returns 0, -1 for a weight
 * the layouts cannot hold, -2 when scratch memory cannot be had. */
int quant_gemm(const void *x, int x_bf16, int64_t M, const QuantWeight *w, void *out,
               int out_bf16, int64_t out_stride, int num_threads) {
    if (!weight_ok(w) || M < 0) return -1;
    if (num_threads < 1) num_threads = 1;
    const int64_t N = w->out_features, K = w->in_features;
    const float *xf = (const float *)x;
    int use_bf16_dot = 0;
#if defined(GEMM_BF16_DOT)
    use_bf16_dot = x_bf16;
#endif
    if (x_bf16 && !use_bf16_dot) {
        const size_t need = (size_t)(M * K);
        if (need > widened_floats) {
            free(widened);
            widened = (float *)malloc(need * sizeof(float));
            widened_floats = widened ? need : 0;
            if (!widened) return -2;
        }
        for (size_t i = 0; i < need; i++) widened[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = widened;
    }
    const size_t tile_bytes = (size_t)GEMM_NR * K * (use_bf16_dot ? 2 : 4);
    const int mstep = use_bf16_dot ? GEMM_MR_BF16 : GEMM_MR_F32;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* NOTE: one weight tile at a time, dequantized once into this buffer (L1/L2)
         * and dotted with every activation row from there */
        void *tile = malloc(tile_bytes);
        if (!tile) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += GEMM_NR) {
            if (!tile) continue;
            const int nr = (int)(N - n0 < GEMM_NR ? N - n0 : GEMM_NR);
            for (int r = 0; r < nr; r++)
                dequant_row(w, n0 + r, (char *)tile + (size_t)r * K * (use_bf16_dot ? 2 : 4),
                            use_bf16_dot);
            float res[GEMM_NR * GEMM_MR];
            for (int64_t m0 = 0; m0 < M; m0 += mstep) {
                const int mr = (int)(M - m0 < mstep ? M - m0 : mstep);
                /* NOTE: full tiles with constant sizes, so their loops unroll into registers */
                const int full = nr == GEMM_NR && mr == mstep;
#if defined(GEMM_BF16_DOT)
                if (use_bf16_dot && full)
                    gemm_tile_bf16((const uint16_t *)tile, (const uint16_t *)x, K, GEMM_NR, m0, GEMM_MR_BF16, res);
                else if (use_bf16_dot)
                    gemm_tile_bf16((const uint16_t *)tile, (const uint16_t *)x, K, nr, m0, mr, res);
                else
#endif
                if (full) gemm_tile_f32((const float *)tile, xf, K, GEMM_NR, m0, GEMM_MR_F32, res);
                else gemm_tile_f32((const float *)tile, xf, K, nr, m0, mr, res);
                for (int r = 0; r < nr; r++)
                    for (int m = 0; m < mr; m++)
                        store(out, out_bf16, (m0 + m) * out_stride + n0 + r, res[r * GEMM_MR + m]);
            }
        }
        free(tile);
    }
    if (failed) return -2;
    return 0;
}

/* out (N, K) = every weight row, as dequant_row writes it; -1 for a weight the
 * layouts cannot hold. */
int quant_dequantize(const QuantWeight *w, void *out, int out_bf16, int num_threads) {
    if (!weight_ok(w)) return -1;
    if (num_threads < 1) num_threads = 1;
    const size_t row_out = (size_t)w->in_features * (out_bf16 ? 2 : 4);
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < w->out_features; n++)
        dequant_row(w, n, (char *)out + n * row_out, out_bf16);
    return 0;
}

/* out (M, K) = weight rows `ids` (an embedding lookup); -1 for a weight the layouts
 * cannot hold, -3 for an id outside [0, N). */
int quant_gather_rows(const QuantWeight *w, const int64_t *ids, int64_t M, void *out,
                      int out_bf16) {
    if (!weight_ok(w)) return -1;
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= w->out_features) return -3;
    const size_t row_out = (size_t)w->in_features * (out_bf16 ? 2 : 4);
    for (int64_t m = 0; m < M; m++)
        dequant_row(w, ids[m], (char *)out + m * row_out, out_bf16);
    return 0;
}
