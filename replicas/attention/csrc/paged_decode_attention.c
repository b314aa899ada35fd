/* Decode attention straight over the paged KV cache, for the CPU backend.
 *
 * One query token per sequence attends to its first seq_lens[b] cached tokens; a
 * row of length 0 (padding of a fixed-size batch) reads nothing and gets zeros.
 * Layout as in replicas/attention/base.py: caches are (num_blocks, block_size,
 * num_kv_heads, head_dim), float32 (paged_decode_attention) or bfloat16
 * (paged_decode_attention_bf16); q and out are (B, num_heads, head_dim) float32, or
 * bfloat16 beside a bfloat16 cache (paged_decode_attention_bf16_io: each row widens
 * into float32 scratch and the result narrows back, rounded to nearest even as
 * torch's copy would, so the model's bfloat16 q and output need no copies).
 *
 * Why a kernel: torch needs the scattered blocks gathered into a dense padded copy
 * before SDPA can run, and that copy costs more memory traffic than the attention
 * itself. Here each sequence's blocks are read in place, once for K and once for
 * V, each whole block (all KV heads) at a time, with the next block prefetched,
 * since blocks sit at random places and the hardware prefetcher cannot guess them.
 * A bfloat16 cache halves that traffic; its values widen to float32 as they load
 * (but for q.K's dot-product instructions, below).
 *
 * One parallel task per sequence; the softmax is exact (max-subtracted, float32
 * accumulation), as SDPA computes it.
 *
 * Where the CPU has AVX-512 (the library is built with -march=native) and heads are
 * 64 wide, two paths are written with intrinsics, since the compiler's own code
 * spent most of its time elsewhere: P.V keeps up to four q heads' output rows in
 * registers over a block's tokens (the portable loop loads and stores them once per
 * token), and with AVX512-BF16 a bfloat16 q (paged_decode_attention_bf16_io) meets
 * bfloat16 K rows in dot-product instructions, without widening either, four tokens
 * at a time so that one reduction tree sums four scores. The products are exact in
 * float32, as the widened ones are, but for denormal bfloat16 values, which the
 * instruction reads as zeros; a block's last n % 4 tokens go one at a time, summed
 * by the same reduction tree. Other CPUs and head sizes take the portable loops;
 * prefetching is the same on every CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* NOTE: into L2, not L1 (locality 2, not 3): the few L1 miss buffers capped how many
 * of a random block's lines were in flight, and the kernel read the cache at half
 * the rate a sequential read reaches. */
static inline void prefetch(const char *p, int64_t num_bytes) {
    for (int64_t i = 0; i < num_bytes; i += 64)  /* one cache line */
        __builtin_prefetch(p + i, 0, 2);
}

/* Element i of a cache row, as float32; `bf16` is a compile-time constant below. */
static inline __attribute__((always_inline)) float kv_at(const char *row, int64_t i,
                                                         const int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } x;
        x.u = (uint32_t)((const uint16_t *)row)[i] << 16;
        return x.f;
    }
    return ((const float *)row)[i];
}

#if defined(__AVX512F__)
/* 16 elements of a cache row from element i, as float32 */
static inline __attribute__((always_inline)) __m512 load16(const char *row, int64_t i,
                                                          const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i))), 16));
    return _mm512_loadu_ps((const float *)row + i);
}

/* PV over one block's n tokens for one KV group of G heads of size 64: the group's
 * output rows stay in registers across the block's tokens (read and written once
 * per block, not once per token). */
static inline __attribute__((always_inline)) void pv_group64(
        const char *restrict vg, int64_t n, int64_t tok_bytes, const float *restrict pg,
        int64_t L, float *restrict og, const char *next, int64_t bs, const int G, const int bf16) {
    __m512 acc[4][4];
    for (int j = 0; j < G; j++)
        for (int c = 0; c < 4; c++) acc[j][c] = _mm512_loadu_ps(og + j * 64 + c * 16);
    for (int64_t u = 0; u < n; u++) {
        const char *vh = vg + u * tok_bytes;
        if (next != NULL)  /* the next block, a token's rows at a time (see attend_one_impl) */
            prefetch(next + u * tok_bytes, u + 1 < n ? tok_bytes : (bs - u) * tok_bytes);
        __m512 v[4];
        for (int c = 0; c < 4; c++) v[c] = load16(vh, c * 16, bf16);
        for (int j = 0; j < G; j++) {
            const __m512 p = _mm512_set1_ps(pg[j * L + u]);
            for (int c = 0; c < 4; c++) acc[j][c] = _mm512_fmadd_ps(p, v[c], acc[j][c]);
        }
    }
    for (int j = 0; j < G; j++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(og + j * 64 + c * 16, acc[j][c]);
}
#endif

#if defined(__AVX512BF16__)
/* The sums of four 16-lane vectors, as four lanes: one reduction tree for all four
 * instead of one per vector. */
static inline __attribute__((always_inline)) __m128 sum4(__m512 a, __m512 b, __m512 c,
                                                        __m512 d) {
#define HALVES(x) _mm256_add_ps(_mm512_castps512_ps256(x), \
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))
    const __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b));
    const __m256 cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* q.K for T (4 or 1) tokens' rows of one KV group (bfloat16, head size 64): each q
 * head's T scores land in st[hh * L .. + T - 1], summed by one tree either way, so a
 * score does not depend on whether its token fell in a group of four. */
static inline __attribute__((always_inline)) void qk_group64(
        const char *restrict kg, int64_t tok_bytes, const uint16_t *restrict qg, int64_t group,
        float *restrict st, int64_t L, float scale, const int T) {
    __m512bh k[4][2];
    for (int t = 0; t < T; t++) {
        k[t][0] = (__m512bh)_mm512_loadu_si512((const void *)(kg + t * tok_bytes));
        k[t][1] = (__m512bh)_mm512_loadu_si512((const void *)(kg + t * tok_bytes + 64));
    }
    const __m128 s = _mm_set1_ps(scale);
    for (int64_t j = 0; j < group; j++) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512((const void *)(qg + j * 64));
        const __m512bh q1 = (__m512bh)_mm512_loadu_si512((const void *)(qg + j * 64 + 32));
        __m512 acc[4];
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, k[t][0]), q1,
                                      k[t][1]);
        if (T == 4)
            _mm_storeu_ps(st + j * L, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), s));
        else
            st[j * L] = _mm_cvtss_f32(sum4(acc[0], acc[0], acc[0], acc[0])) * scale;
    }
}
#endif

/* NOTE: always inlined into the (element type, head size) pairs below, so that with
 * both compile-time constants the compiler unrolls the head_dim loops into whole
 * vector registers. Heads are walked by KV group (each group's q heads read one K/V
 * row), with no division in the loops. Offsets are in bytes (elem = 2 or 4). q16 is
 * the same q as bfloat16 where the caller has it (else NULL). */
static inline __attribute__((always_inline)) void attend_one_impl(
        const float *restrict q, const char *restrict k_cache, const char *restrict v_cache,
        const int32_t *restrict table, int64_t L, float *restrict out, float *restrict scores,
        int64_t h, int64_t kvh, const int64_t d, int64_t bs, float scale, const int bf16,
        const uint16_t *restrict q16) {
    (void)q16;  /* read only with AVX512-BF16 */
    const int64_t elem = bf16 ? 2 : 4;
    const int64_t group = h / kvh;
    const int64_t tok_bytes = kvh * d * elem;
    const int64_t block_bytes = bs * tok_bytes;
    const int64_t num_blocks = (L + bs - 1) / bs;

    prefetch(k_cache + (int64_t)table[0] * block_bytes, block_bytes);
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const char *kb = k_cache + (int64_t)table[blk] * block_bytes;
        /* NOTE: the next block (or the first V block) is prefetched a token's rows
         * at a time, spread over this block's tokens: a whole block at once
         * overflows the prefetch queue, which then drops most of it */
        const char *next = blk + 1 < num_blocks ? k_cache + (int64_t)table[blk + 1] * block_bytes
                                                : v_cache + (int64_t)table[0] * block_bytes;
        const int64_t n = (blk + 1) * bs <= L ? bs : L - blk * bs;
        int64_t u = 0;
#if defined(__AVX512BF16__)
        if (bf16 && q16 != NULL && d == 64)
            for (; u + 4 <= n; u += 4) {
                prefetch(next + u * tok_bytes, u + 4 < n ? 4 * tok_bytes : (bs - u) * tok_bytes);
                for (int64_t g = 0; g < kvh; g++)
                    qk_group64(kb + u * tok_bytes + g * d * elem, tok_bytes, q16 + g * group * 64,
                               group, scores + g * group * L + blk * bs + u, L, scale, 4);
            }
#endif
        for (; u < n; u++) {
            const char *kt = kb + u * tok_bytes;
            prefetch(next + u * tok_bytes, u + 1 < n ? tok_bytes : (bs - u) * tok_bytes);
            float *st = scores + blk * bs + u;
#if defined(__AVX512BF16__)
            if (bf16 && q16 != NULL && d == 64) {
                for (int64_t g = 0; g < kvh; g++)
                    qk_group64(kt + g * d * elem, tok_bytes, q16 + g * group * 64, group,
                               st + g * group * L, L, scale, 1);
                continue;
            }
#endif
            for (int64_t g = 0; g < kvh; g++) {
                const char *kh = kt + g * d * elem;
                for (int64_t j = 0; j < group; j++) {
                    const int64_t hh = g * group + j;
                    const float *qh = q + hh * d;
                    float acc = 0.f;
                    for (int64_t i = 0; i < d; i++) acc += qh[i] * kv_at(kh, i, bf16);
                    st[hh * L] = acc * scale;
                }
            }
        }
    }
    for (int64_t hh = 0; hh < h; hh++) {
        float *s = scores + hh * L;
        float m = s[0];
        for (int64_t t = 1; t < L; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; t++) s[t] *= inv;
    }
    memset(out, 0, sizeof(float) * h * d);
    for (int64_t blk = 0; blk < num_blocks; blk++) {
        const char *vb = v_cache + (int64_t)table[blk] * block_bytes;
        const char *next = blk + 1 < num_blocks ? v_cache + (int64_t)table[blk + 1] * block_bytes
                                                : NULL;
        const int64_t n = (blk + 1) * bs <= L ? bs : L - blk * bs;
#if defined(__AVX512F__)
        if (d == 64 && group >= 1) {
            /* up to four of a group's q heads at a time in registers */
            for (int64_t g = 0; g < kvh; g++) {
                const char *vg = vb + g * d * elem;
                for (int64_t j0 = 0; j0 < group; j0 += 4) {
                    const char *pf = g == 0 && j0 == 0 ? next : NULL;
                    const float *pg = scores + (g * group + j0) * L + blk * bs;
                    float *og = out + (g * group + j0) * d;
                    switch (group - j0 < 4 ? group - j0 : 4) {
                        case 1: pv_group64(vg, n, tok_bytes, pg, L, og, pf, bs, 1, bf16); break;
                        case 2: pv_group64(vg, n, tok_bytes, pg, L, og, pf, bs, 2, bf16); break;
                        case 3: pv_group64(vg, n, tok_bytes, pg, L, og, pf, bs, 3, bf16); break;
                        case 4: pv_group64(vg, n, tok_bytes, pg, L, og, pf, bs, 4, bf16); break;
                    }
                }
            }
            continue;
        }
#endif
        for (int64_t u = 0; u < n; u++) {
            const char *vt = vb + u * tok_bytes;
            if (next != NULL)
                prefetch(next + u * tok_bytes, u + 1 < n ? tok_bytes : (bs - u) * tok_bytes);
            const float *pt = scores + blk * bs + u;
            for (int64_t g = 0; g < kvh; g++) {
                const char *vh = vt + g * d * elem;
                for (int64_t j = 0; j < group; j++) {
                    const int64_t hh = g * group + j;
                    const float p = pt[hh * L];
                    float *oh = out + hh * d;
                    for (int64_t i = 0; i < d; i++) oh[i] += p * kv_at(vh, i, bf16);
                }
            }
        }
    }
}

#define ATTEND_ONE(NAME, BF16)                                                              \
    static void NAME(const float *q, const char *k_cache, const char *v_cache,              \
                     const int32_t *table, int64_t L, float *out, float *scores, int64_t h, \
                     int64_t kvh, int64_t d, int64_t bs, float scale,                      \
                     const uint16_t *q16) {                                                 \
        if (d == 64)                                                                        \
            attend_one_impl(q, k_cache, v_cache, table, L, out, scores, h, kvh, 64, bs,     \
                            scale, BF16, q16);                                              \
        else if (d == 128)                                                                  \
            attend_one_impl(q, k_cache, v_cache, table, L, out, scores, h, kvh, 128, bs,    \
                            scale, BF16, q16);                                              \
        else                                                                                \
            attend_one_impl(q, k_cache, v_cache, table, L, out, scores, h, kvh, d, bs,      \
                            scale, BF16, q16);                                              \
    }
ATTEND_ONE(attend_one_f32, 0)
ATTEND_ONE(attend_one_bf16, 1)

typedef void (*attend_fn)(const float *, const char *, const char *, const int32_t *, int64_t,
                          float *, float *, int64_t, int64_t, int64_t, int64_t, float,
                          const uint16_t *);

static inline uint16_t narrow_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* Returns 0, or -1 when a scratch allocation failed (out is then incomplete).
 * io_bf16: q and out are bfloat16 (else float32). */
static int run(attend_fn attend, const void *q, const char *k_cache, const char *v_cache,
               const int32_t *block_tables, const int32_t *seq_lens, void *out, int64_t B,
               int64_t h, int64_t kvh, int64_t d, int64_t bs, int64_t table_width, float scale,
               int num_threads, const int io_bf16) {
    const int64_t row = h * d;
    const int64_t io_elem = io_bf16 ? 2 : 4;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads) reduction(|:failed)
    {
        float *scores = NULL;
        int64_t capacity = 0;
        /* NOTE: a widened q row, then the float32 output row */
        float *rows = io_bf16 ? malloc(sizeof(float) * 2 * row) : NULL;
        if (io_bf16 && rows == NULL) failed = 1;
        #pragma omp for schedule(dynamic, 4)
        for (int64_t b = 0; b < B; b++) {
            const int64_t L = seq_lens[b];
            char *out_b = (char *)out + b * row * io_elem;
            if (L <= 0) {
                memset(out_b, 0, io_elem * row);
                continue;
            }
            if (h * L > capacity) {
                free(scores);
                capacity = 2 * h * L;
                scores = malloc(sizeof(float) * capacity);
                if (scores == NULL) { capacity = 0; failed = 1; continue; }
            }
            if (!io_bf16) {
                attend((const float *)q + b * row, k_cache, v_cache,
                       block_tables + b * table_width, L, (float *)out_b, scores, h, kvh, d,
                       bs, scale, NULL);
                continue;
            }
            if (rows == NULL) continue;
            const char *q_b = (const char *)q + b * row * io_elem;
            for (int64_t i = 0; i < row; i++) rows[i] = kv_at(q_b, i, 1);
            attend(rows, k_cache, v_cache, block_tables + b * table_width, L, rows + row,
                   scores, h, kvh, d, bs, scale, (const uint16_t *)q_b);
            for (int64_t i = 0; i < row; i++) ((uint16_t *)out_b)[i] = narrow_bf16(rows[row + i]);
        }
        free(rows);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Whether the kernel may run on these tables: 0, or 1 when a row's length is
 * negative or beyond its table (width * bs tokens), or 2 when a block a row reads
 * (its first ceil(len / bs) entries) is outside the cache's num_blocks.
 * NOTE: one pass in C, once per layer: the same checks as torch reductions were
 * eight operator calls and four host syncs per layer. */
int check_decode_inputs(const int32_t *block_tables, const int32_t *seq_lens, int64_t B,
                        int64_t bs, int64_t table_width, int64_t num_blocks) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        if (L < 0 || L > table_width * bs) return 1;
        const int32_t *table = block_tables + b * table_width;
        for (int64_t i = 0; i < (L + bs - 1) / bs; i++)
            if (table[i] < 0 || table[i] >= num_blocks) return 2;
    }
    return 0;
}

int paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                           const int32_t *block_tables, const int32_t *seq_lens, float *out,
                           int64_t B, int64_t h, int64_t kvh, int64_t d, int64_t bs,
                           int64_t table_width, float scale, int num_threads) {
    return run(attend_one_f32, q, (const char *)k_cache, (const char *)v_cache, block_tables,
               seq_lens, out, B, h, kvh, d, bs, table_width, scale, num_threads, 0);
}

int paged_decode_attention_bf16(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                const int32_t *block_tables, const int32_t *seq_lens, float *out,
                                int64_t B, int64_t h, int64_t kvh, int64_t d, int64_t bs,
                                int64_t table_width, float scale, int num_threads) {
    return run(attend_one_bf16, q, (const char *)k_cache, (const char *)v_cache, block_tables,
               seq_lens, out, B, h, kvh, d, bs, table_width, scale, num_threads, 0);
}

int paged_decode_attention_bf16_io(const uint16_t *q, const uint16_t *k_cache,
                                   const uint16_t *v_cache, const int32_t *block_tables,
                                   const int32_t *seq_lens, uint16_t *out, int64_t B, int64_t h,
                                   int64_t kvh, int64_t d, int64_t bs, int64_t table_width,
                                   float scale, int num_threads) {
    return run(attend_one_bf16, q, (const char *)k_cache, (const char *)v_cache, block_tables,
               seq_lens, out, B, h, kvh, d, bs, table_width, scale, num_threads, 1);
}
