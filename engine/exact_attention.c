/* Attention one query row at a time, keys in position order: a row's result depends on its query and on the keys
   and values it attends, never on how many other rows are computed with it, how the prompt was cut into forwards,
   or the thread count (engine/exact_attention.py). float32 throughout; each dot product and each weighted sum runs
   in a fixed order of its dimension, the softmax sums over keys in position order; its exponentials are this
   library's own (own_exp.h: the same bits in a vector lane as alone; libm's expf, one call per key, was a fifth
   of a 1k-token prefill). Changing any of this changes KV: gguf_blocks.ATTENTION_NUMERICS is in the fingerprint.
   How the work is laid out changes no bit: the rows that read one kv head (its query heads' rows: 3 in a decode
   step of a model with 3 query heads per kv head, 15 in a check of 5 tokens) are computed as a tile, each block of
   keys read once for all of them while it is in L1, and the weighted sums of up to 4 rows in one pass over the
   values. A forward of many rows first lays each kv head's keys out in blocks of 16 (value d of 16 keys together);
   a decode step or a check reads the key rows as they are (a copy would cost more than it saves). */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* engine/weights/thread_pool.c */
typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx);
void kvb_parallel_segments(int64_t count, const int64_t *first, kvb_task fn, void *ctxs, size_t size, int threads);
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVA_AVX2 1
#endif
#include "own_exp.h"

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    float total = 0.0f;
#ifdef KVA_AVX2
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; d + 16 <= n; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    for (; d + 8 <= n; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    const __m256 s = _mm256_add_ps(s0, s1);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    total = _mm_cvtss_f32(x);
#endif
    for (; d < n; d++) total += a[d] * b[d];
    return total;
}

#ifdef KVA_AVX2
/* out[t] = dot_f32(q, k + t * D, D) * scale for 8 keys t (D a multiple of 16), the same bits: each key's two
   chains of lanes as in dot_f32, then dot_f32's reduction (high half onto low, then lanes 2 and 3 onto 0 and 1,
   then those two) for the 8 keys at once by shuffles, one key per lane at the end */
static inline __attribute__((always_inline)) void dot8_f32(const float *q, const float *k, int64_t D, float scale,
                                                             float *out) {
    __m256 a[8]; /* key t: its S = s0 + s1 of dot_f32 */
#ifdef __AVX512F__
    __m512 s[8]; /* lane l < 8: dot_f32's s0 lane l; lane 8 + l: its s1 lane l (the same multiply-adds) */
    for (int t = 0; t < 8; t++) s[t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int t = 0; t < 8; t++) s[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + t * D + d), s[t]);
    }
    for (int t = 0; t < 8; t++)
        a[t] = _mm256_add_ps(_mm512_castps512_ps256(s[t]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s[t]), 1)));
#else
    __m256 s0[8], s1[8];
    for (int t = 0; t < 8; t++) s0[t] = s1[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + d), q1 = _mm256_loadu_ps(q + d + 8);
        for (int t = 0; t < 8; t++) {
            s0[t] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k + t * D + d), s0[t]);
            s1[t] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k + t * D + d + 8), s1[t]);
        }
    }
    for (int t = 0; t < 8; t++) a[t] = _mm256_add_ps(s0[t], s1[t]);
#endif
    __m256 x[4]; /* keys 2i, 2i + 1: lanes 0-3 and 4-7, each lane l the key's S_l + S_l+4 */
    for (int i = 0; i < 4; i++)
        x[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    __m256 y[2]; /* per 128-bit half, two keys' (x0 + x2, x1 + x3) */
    for (int i = 0; i < 2; i++)
        y[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lanes: keys 0 2 4 6 | 1 3 5 7 */
    const __m256 total = _mm256_add_ps(_mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm256_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m256 scaled = _mm256_mul_ps(total, _mm256_set1_ps(scale));
    _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(scaled, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

/* Keys in blocks of 16, a block [D][16] (value d of its 16 keys together), for many query rows: out[t] =
   dot_f32(q, key t, D) * scale for the block's 16 keys t, the same bits (D a multiple of 16). dot_f32 sums value d
   into chain d mod 16 (its s0 lanes 0-7, s1 lanes 0-7), each chain in order of d, then adds chain l and l + 8 (S_l),
   then S_l and S_l+4, then lanes 0 + 2 and 1 + 3, then those two: here chain c is a vector over the 16 keys, so
   the same multiply-adds and adds run with one key per lane and no shuffles. */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void dot16_blocked(const float *q, const float *kt, const int D,
                                                                float scale, float *out) {
    __m512 c[16];
    for (int l = 0; l < 16; l++) c[l] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16)
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++)
            c[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[d + l]), _mm512_loadu_ps(kt + 16 * (d + l)), c[l]);
    for (int l = 0; l < 8; l++) c[l] = _mm512_add_ps(c[l], c[l + 8]);
    for (int l = 0; l < 4; l++) c[l] = _mm512_add_ps(c[l], c[l + 4]);
    const __m512 total = _mm512_add_ps(_mm512_add_ps(c[0], c[2]), _mm512_add_ps(c[1], c[3]));
    _mm512_storeu_ps(out, _mm512_mul_ps(total, _mm512_set1_ps(scale)));
}
#elif defined(KVA_AVX2)
static inline __attribute__((always_inline)) void dot16_blocked(const float *q, const float *kt, const int D,
                                                                float scale, float *out) {
    for (int half = 0; half < 2; half++) { /* keys 0-7, then 8-15, eight per vector; chains 0-7, then 8-15 */
        __m256 lo[8], hi[8];
        for (int l = 0; l < 8; l++) lo[l] = hi[l] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 16)
#pragma GCC unroll 8
            for (int l = 0; l < 8; l++)
                lo[l] = _mm256_fmadd_ps(_mm256_set1_ps(q[d + l]), _mm256_loadu_ps(kt + 16 * (d + l) + 8 * half), lo[l]);
        for (int d = 0; d < D; d += 16)
#pragma GCC unroll 8
            for (int l = 0; l < 8; l++)
                hi[l] = _mm256_fmadd_ps(_mm256_set1_ps(q[d + 8 + l]), _mm256_loadu_ps(kt + 16 * (d + 8 + l) + 8 * half),
                                        hi[l]);
        for (int l = 0; l < 8; l++) lo[l] = _mm256_add_ps(lo[l], hi[l]);
        for (int l = 0; l < 4; l++) lo[l] = _mm256_add_ps(lo[l], lo[l + 4]);
        const __m256 total = _mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3]));
        _mm256_storeu_ps(out + 8 * half, _mm256_mul_ps(total, _mm256_set1_ps(scale)));
    }
}
#endif

static inline void add_scaled(float *acc, float p, const float *x, int64_t n) { /* acc += p * x */
    int64_t d = 0;
#ifdef KVA_AVX2
    const __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d),
                                                                         _mm256_loadu_ps(acc + d)));
#endif
    for (; d < n; d++) acc[d] += p * x[d];
}

/* p[j] = exp(p[j] - top) for j < n, in place; the same bits for a j whichever way it is reached */
static inline void exp_shifted(float *p, int64_t n, float top) {
    int64_t j = 0;
#ifdef __AVX512F__
    const __m512 t16 = _mm512_set1_ps(top);
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(p + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), t16)));
#endif
#ifdef KVA_AVX2
    const __m256 t = _mm256_set1_ps(top);
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(p + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), t)));
#endif
    for (; j < n; j++) p[j] = exp_one(p[j] - top);
}

/* acc (D values) = sum over the attended keys j, in position order, of p[j] * v_j, and the return value the sum of
   those p[j] in position order: each value's sum the same multiply-adds as add_scaled's (a lane's chain of fused
   multiply-adds is the same in a vector of 8 or of 16), held in registers for the head sizes models use (64, 128) */
static inline __attribute__((always_inline)) float weighted_sum_fixed(float *acc, const float *p, const float *vb,
                                                                      const uint8_t *mi, int64_t nk, int64_t last,
                                                                      const int D) {
    float total = 0.0f;
#if defined(__AVX512F__)
    __m512 a[8];
    for (int c = 0; c < D / 16; c++) a[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        if (mi ? !mi[j] : j > last) continue;
        total += p[j];
        const __m512 pv = _mm512_set1_ps(p[j]);
        for (int c = 0; c < D / 16; c++) a[c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vb + j * D + 16 * c), a[c]);
    }
    for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(acc + 16 * c, a[c]);
#elif defined(KVA_AVX2)
    __m256 a[16];
    for (int c = 0; c < D / 8; c++) a[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        if (mi ? !mi[j] : j > last) continue;
        total += p[j];
        const __m256 pv = _mm256_set1_ps(p[j]);
        for (int c = 0; c < D / 8; c++) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vb + j * D + 8 * c), a[c]);
    }
    for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(acc + 8 * c, a[c]);
#else
    memset(acc, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j < nk; j++)
        if (!(mi ? !mi[j] : j > last)) {
            total += p[j];
            add_scaled(acc, p[j], vb + j * D, D);
        }
#endif
    return total;
}

static float weighted_sum(float *acc, const float *p, const float *vb, const uint8_t *mi, int64_t nk, int64_t last,
                          int64_t D) {
    if (D == 64) return weighted_sum_fixed(acc, p, vb, mi, nk, last, 64);
    if (D == 128) return weighted_sum_fixed(acc, p, vb, mi, nk, last, 128);
    float total = 0.0f;
    memset(acc, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j < nk; j++)
        if (!(mi ? !mi[j] : j > last)) {
            total += p[j];
            add_scaled(acc, p[j], vb + j * D, D);
        }
    return total;
}

#if defined(KVA_AVX2)
/* weighted_sum_fixed for two rows of one head without a mask, attending keys 0 .. n1 - 1 and 0 .. n2 - 1
   (n1 <= n2): each row's sums the very same multiply-adds and adds, in the same order, as alone; the two rows'
   chains interleaved share the loads of v and hide each other's latency (one row's chains wait on their own
   previous multiply-add at every key). Returns the rows' totals in t[0], t[1]. */
static inline __attribute__((always_inline)) void weighted_sum_pair(float *acc1, float *acc2, const float *p1,
                                                                    const float *p2, const float *vb, int64_t n1,
                                                                    int64_t n2, const int D, float t[2]) {
    float total1 = 0.0f, total2 = 0.0f;
#if defined(__AVX512F__)
    __m512 a1[8], a2[8];
    for (int c = 0; c < D / 16; c++) a1[c] = a2[c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n2; j++) {
        const __m512 pv2 = _mm512_set1_ps(p2[j]);
        total2 += p2[j];
        if (j < n1) {
            const __m512 pv1 = _mm512_set1_ps(p1[j]);
            total1 += p1[j];
            for (int c = 0; c < D / 16; c++) {
                const __m512 vv = _mm512_loadu_ps(vb + j * D + 16 * c);
                a1[c] = _mm512_fmadd_ps(pv1, vv, a1[c]);
                a2[c] = _mm512_fmadd_ps(pv2, vv, a2[c]);
            }
        } else {
            for (int c = 0; c < D / 16; c++) a2[c] = _mm512_fmadd_ps(pv2, _mm512_loadu_ps(vb + j * D + 16 * c), a2[c]);
        }
    }
    for (int c = 0; c < D / 16; c++) {
        _mm512_storeu_ps(acc1 + 16 * c, a1[c]);
        _mm512_storeu_ps(acc2 + 16 * c, a2[c]);
    }
#else
    __m256 a1[16], a2[16];
    for (int c = 0; c < D / 8; c++) a1[c] = a2[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n2; j++) {
        const __m256 pv2 = _mm256_set1_ps(p2[j]);
        total2 += p2[j];
        if (j < n1) {
            const __m256 pv1 = _mm256_set1_ps(p1[j]);
            total1 += p1[j];
            for (int c = 0; c < D / 8; c++) {
                const __m256 vv = _mm256_loadu_ps(vb + j * D + 8 * c);
                a1[c] = _mm256_fmadd_ps(pv1, vv, a1[c]);
                a2[c] = _mm256_fmadd_ps(pv2, vv, a2[c]);
            }
        } else {
            for (int c = 0; c < D / 8; c++) a2[c] = _mm256_fmadd_ps(pv2, _mm256_loadu_ps(vb + j * D + 8 * c), a2[c]);
        }
    }
    for (int c = 0; c < D / 8; c++) {
        _mm256_storeu_ps(acc1 + 8 * c, a1[c]);
        _mm256_storeu_ps(acc2 + 8 * c, a2[c]);
    }
#endif
    t[0] = total1, t[1] = total2;
}
#endif

/* out [B, nq, H, D] = softmax(scale * q k^T, masked) v for q [B, H, nq, D] (contiguous), k and v [B, KVH, nk, D]
   with rows of D contiguous values D apart and the given batch and head strides (a cache's views need no copy),
   query head h reading kv head h / (H / KVH). mask: uint8 [B, mask_heads, nq, nk] (nonzero: attend; mask_heads 1
   or H), or NULL: with `causal` query i attends keys 0 .. nk - nq + i, else every key. A row that attends no key
   is 0. Returns 0, or -2 when scratch memory cannot be had. */
typedef struct {
    const float *q, *k, *v;
    int64_t kv_batch_stride, kv_head_stride;
    const uint8_t *mask;
    int64_t mask_heads;
    int causal;
    float *out;
    int64_t H, nq, nk, D, group;
    float scale;
    _Atomic int status;
    float *kt; /* the keys in blocks of 16 (dot16_blocked), [B, KVH, blocks, D, 16], or NULL: key rows as given */
    int64_t KVH, blocks;
} attention_job;

/* What row r reads and writes: its query, its kv head's keys (as rows, and as blocks where job->kt holds them) and
   values, its mask row (NULL: none), its last attended key, the keys that may be attended (span: every key under a
   mask, else those up to the last; the rest are never read) and its output */
typedef struct {
    const float *q, *k, *v, *kt;
    const uint8_t *mask;
    int64_t last, span;
    float *out;
} row_view;

static row_view row_of(const attention_job *job, int64_t r) {
    const int64_t H = job->H, nq = job->nq, nk = job->nk, D = job->D;
    const int64_t b = r / (H * nq), h = (r / nq) % H, i = r % nq, kv = h / job->group;
    const int64_t at = b * job->kv_batch_stride + kv * job->kv_head_stride;
    row_view w;
    w.q = job->q + r * D, w.k = job->k + at, w.v = job->v + at;
    w.kt = job->kt ? job->kt + (b * job->KVH + kv) * job->blocks * 16 * D : NULL;
    w.mask = job->mask ? job->mask + ((b * job->mask_heads + (job->mask_heads > 1 ? h : 0)) * nq + i) * nk : NULL;
    w.last = job->causal ? nk - nq + i : nk - 1;
    w.span = w.mask ? nk : (w.last + 1 < nk ? w.last + 1 : nk);
    w.out = job->out + ((b * nq + i) * H + h) * D;
    return w;
}

#ifdef KVA_AVX2
static inline void scores_of_block(const float *q, const float *block, int64_t D, float scale, float *out) {
    if (D == 64) dot16_blocked(q, block, 64, scale, out);
    else if (D == 128) dot16_blocked(q, block, 128, scale, out);
    else dot16_blocked(q, block, (int)D, scale, out);
}
#endif

/* scores[j] = scale * q . k_j for the keys j < span that may be attended (from blocks: whole blocks) */
static void row_scores(const attention_job *job, const row_view *w, float *scores) {
    const int64_t D = job->D, span = w->span;
    int64_t j = 0;
#ifdef KVA_AVX2
    if (w->kt)
        for (; j < span; j += 16) scores_of_block(w->q, w->kt + j * D, D, job->scale, scores + j);
    else if (D % 16 == 0)
        for (; j + 8 <= span; j += 8) dot8_f32(w->q, w->k + j * D, D, job->scale, scores + j);
#endif
    for (; j < span; j++) /* the rest one at a time */
        if (!(w->mask ? !w->mask[j] : j > w->last)) scores[j] = dot_f32(w->q, w->k + j * D, D) * job->scale;
}

/* The scores of a row made its weights in place: exp(score_j - the row's largest) for j < span (masked keys 0);
   0 when the row attends no key */
static int row_softmax(const row_view *w, float *scores) {
    const int64_t span = w->span;
    float top = -INFINITY;
    int any = 0;
    int64_t j = 0;
    if (w->mask) {
        for (j = 0; j < span; j++) {
            if (!w->mask[j]) {
                scores[j] = -INFINITY; /* weight 0 */
                continue;
            }
            if (!any || scores[j] > top) top = scores[j];
            any = 1;
        }
    } else if (span > 0) { /* every key up to span attended: the largest score, in four chains of 8 lanes */
        any = 1;
        top = scores[0];
#ifdef KVA_AVX2
        __m256 lanes = _mm256_set1_ps(top), more = lanes, third = lanes, fourth = lanes;
        for (; j + 32 <= span; j += 32) {
            lanes = _mm256_max_ps(_mm256_loadu_ps(scores + j), lanes);
            more = _mm256_max_ps(_mm256_loadu_ps(scores + j + 8), more);
            third = _mm256_max_ps(_mm256_loadu_ps(scores + j + 16), third);
            fourth = _mm256_max_ps(_mm256_loadu_ps(scores + j + 24), fourth);
        }
        lanes = _mm256_max_ps(_mm256_max_ps(lanes, more), _mm256_max_ps(third, fourth));
        for (; j + 8 <= span; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(scores + j), lanes);
        float lane[8];
        _mm256_storeu_ps(lane, lanes);
        for (int l = 0; l < 8; l++) top = lane[l] > top ? lane[l] : top;
#endif
        for (; j < span; j++) top = scores[j] > top ? scores[j] : top;
    }
    /* exp over every score up to span (then summed, the attended ones, in position order, with the weighted sum) */
    if (any) exp_shifted(scores, span, top);
    return any;
}

static int row_weights(const attention_job *job, const row_view *w, float *scores) {
    row_scores(job, w, scores);
    return row_softmax(w, scores);
}

static void write_row(const row_view *w, const float *acc, float total, int64_t D) {
    for (int64_t d = 0; d < D; d++) w->out[d] = acc[d] / total;
}

/* Rows one or two at a time (keys as rows: decode, a few rows); `more`: the second row's scores (AVX2 pairs) */
static void rows_alone(const attention_job *job, int64_t first, int64_t end, float *scores, float *more,
                       float *acc) {
    const int64_t D = job->D;
    (void)more; /* unused in a portable build */
    for (int64_t r = first; r < end; r++) {
        const row_view w = row_of(job, r);
        const int any = row_weights(job, &w, scores);
#ifdef KVA_AVX2
        /* the next row of the same head, causal and unmasked: both weighted sums in one pass over v */
        if (!w.mask && (D == 64 || D == 128) && r + 1 < end && (r + 1) % job->nq && any && w.last >= 0) {
            const row_view w2 = row_of(job, r + 1);
            if (row_weights(job, &w2, more)) {
                float totals[2];
                if (D == 64) weighted_sum_pair(acc, acc + D, scores, more, w.v, w.last + 1, w2.last + 1, 64, totals);
                else weighted_sum_pair(acc, acc + D, scores, more, w.v, w.last + 1, w2.last + 1, 128, totals);
                write_row(&w, acc, totals[0], D);
                write_row(&w2, acc + D, totals[1], D);
                r++;
                continue;
            }
        }
#endif
        if (!any) {
            memset(w.out, 0, (size_t)D * sizeof(float));
            continue;
        }
        write_row(&w, acc, weighted_sum(acc, scores, w.v, w.mask, job->nk, w.last, D), D);
    }
}

#define TILE 16 /* query rows of one kv head whose scores are computed together, a block of keys read once for all */

#ifdef KVA_AVX2

#ifdef __AVX512F__
/* weighted_sum_fixed for R rows of one head without a mask, row g attending keys 0 .. n[g] - 1 with the weights
   p + g * stride: each row's sums the very same multiply-adds and adds, in the same order, as alone; the rows share
   each value row's reads */
static inline __attribute__((always_inline)) void weighted_sum_rows(float *acc, const float *p, int64_t stride,
                                                                    const float *vb, const int64_t *n, const int R,
                                                                    const int D, float *totals) {
    __m512 a[16];
    int64_t most = 0;
    for (int g = 0; g < R; g++) totals[g] = 0.0f, most = n[g] > most ? n[g] : most;
    for (int x = 0; x < R * (D / 16); x++) a[x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < most; j++)
#pragma GCC unroll 4
        for (int g = 0; g < R; g++) {
            if (j >= n[g]) continue;
            totals[g] += p[g * stride + j];
            const __m512 pv = _mm512_set1_ps(p[g * stride + j]);
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++)
                a[g * (D / 16) + c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vb + j * D + 16 * c), a[g * (D / 16) + c]);
        }
    for (int x = 0; x < R * (D / 16); x++) _mm512_storeu_ps(acc + 16 * x, a[x]);
}
#endif

/* How many rows from r form a tile: up to TILE rows of [r, end) that read one kv head (of one or more of its query
   heads: rows r are ordered by batch, query head, query, so a kv head's rows are consecutive) */
static int tile_rows(const attention_job *job, int64_t r, int64_t end) {
    const int64_t per_kv = job->group * job->nq, left = per_kv - r % per_kv;
    const int64_t R = end - r < TILE ? end - r : TILE;
    return (int)(left < R ? left : R);
}

/* row_scores for the R rows of a tile, a block of keys read once for all of them (block outer, rows inner: the
   block stays in L1): blocks of 16 from job->kt, else 8 key rows at a time by dot8_f32, the rest of each row's keys
   one at a time. Each score is the same function of its query and key as in row_scores. */
static void tile_scores(const attention_job *job, const row_view *w, int R, int64_t most, float *scores,
                        int64_t width) {
    const int64_t D = job->D;
    if (w[0].kt) {
        for (int64_t j = 0; j < most; j += 16)
            for (int g = 0; g < R; g++)
                if (j < w[g].span) scores_of_block(w[g].q, w[g].kt + j * D, D, job->scale, scores + g * width + j);
        return;
    }
    if (D % 16 == 0)
        for (int64_t j = 0; j + 8 <= most; j += 8)
            for (int g = 0; g < R; g++)
                if (j + 8 <= w[g].span) dot8_f32(w[g].q, w[g].k + j * D, D, job->scale, scores + g * width + j);
    for (int g = 0; g < R; g++) {
        float *row = scores + g * width;
        for (int64_t j = D % 16 == 0 ? w[g].span / 8 * 8 : 0; j < w[g].span; j++)
            if (!(w[g].mask ? !w[g].mask[j] : j > w[g].last)) row[j] = dot_f32(w[g].q, w[g].k + j * D, D) * job->scale;
    }
}

#ifdef __AVX512F__
/* weighted_sum_rows for the `count` (1-4) rows from g, with the number of rows a constant of each call */
static void weighted_sums_of(float *acc, const float *p, int64_t stride, const float *vb, const int64_t *n,
                             int count, int64_t D, float *totals) {
    if (D == 64) {
        switch (count) {
        case 1: weighted_sum_rows(acc, p, stride, vb, n, 1, 64, totals); return;
        case 2: weighted_sum_rows(acc, p, stride, vb, n, 2, 64, totals); return;
        case 3: weighted_sum_rows(acc, p, stride, vb, n, 3, 64, totals); return;
        default: weighted_sum_rows(acc, p, stride, vb, n, 4, 64, totals); return;
        }
    }
    if (count == 1) weighted_sum_rows(acc, p, stride, vb, n, 1, 128, totals);
    else weighted_sum_rows(acc, p, stride, vb, n, 2, 128, totals);
}
#endif

/* Rows in tiles of up to TILE rows of one kv head (tile_rows): each block of keys read once for the tile's scores
   (tile_scores), the values once for a group of rows (up to 4 rows of 64 values, 2 of 128) */
static void rows_tiled(const attention_job *job, int64_t first, int64_t end, float *scores, int64_t width,
                       float *acc) {
    const int64_t D = job->D;
    row_view w[TILE];
    int any[TILE];
    for (int64_t r = first; r < end;) {
        const int R = tile_rows(job, r, end);
        int64_t most = 0;
        for (int g = 0; g < R; g++) w[g] = row_of(job, r + g), most = w[g].span > most ? w[g].span : most;
        tile_scores(job, w, R, most, scores, width);
        for (int g = 0; g < R; g++) any[g] = row_softmax(&w[g], scores + g * width);
        for (int g = 0; g < R;) {
#ifdef __AVX512F__
            const int G = D == 64 ? 4 : D == 128 ? 2 : 0;
            int count = 0; /* the rows from g, up to G, that attend some key and have no mask */
            while (count < G && g + count < R && !w[g + count].mask && any[g + count]) count++;
            if (count) {
                int64_t n[4];
                float totals[4];
                for (int x = 0; x < count; x++) n[x] = w[g + x].span;
                weighted_sums_of(acc, scores + g * width, width, w[g].v, n, count, D, totals);
                for (int x = 0; x < count; x++) write_row(&w[g + x], acc + x * D, totals[x], D);
                g += count;
                continue;
            }
#endif
            if (!any[g]) memset(w[g].out, 0, (size_t)D * sizeof(float));
            else write_row(&w[g], acc, weighted_sum(acc, scores + g * width, w[g].v, w[g].mask, job->nk, w[g].last, D),
                           D);
            g++;
        }
        r += R;
    }
}
#endif

/* Tiles (rows_tiled) where the keys are in blocks, and wherever this build has AVX-512 (its weighted sums of up to
   4 rows); else rows one or two at a time (rows_alone: AVX2's pairs, the portable build) */
#if defined(KVA_AVX2) && defined(__AVX512F__)
#define TILED(job) 1
#elif defined(KVA_AVX2)
#define TILED(job) ((job)->kt != NULL)
#else
#define TILED(job) 0
#endif

static void attention_rows(void *ctx, int64_t first, int64_t end) {
    attention_job *job = ctx;
    const int64_t width = 16 * (job->nk / 16 + 1); /* a row's scores, whole blocks of 16 */
    const int64_t rows = TILED(job) ? (end - first < TILE ? end - first : TILE) : 2;
    float *scores = malloc((size_t)(rows * width) * sizeof(float));
    float *acc = malloc((size_t)(4 * job->D) * sizeof(float));
    if (!scores || !acc) atomic_store(&job->status, -2);
#ifdef KVA_AVX2
    else if (TILED(job)) rows_tiled(job, first, end, scores, width, acc);
#endif
    else rows_alone(job, first, end, scores, scores + width, acc);
    free(scores);
    free(acc);
}

/* job->kt's blocks [first, end) of all (batch, kv head)s: block i of a kv head holds its keys 16i .. 16i + 15
   (past the last key: 0) */
static void block_keys(void *ctx, int64_t first, int64_t end) {
    attention_job *job = ctx;
    const int64_t D = job->D;
    for (int64_t i = first; i < end; i++) {
        const int64_t at = i / job->blocks, block = i % job->blocks, b = at / job->KVH, kv = at % job->KVH;
        const float *keys = job->k + b * job->kv_batch_stride + kv * job->kv_head_stride;
        float *kt = job->kt + i * 16 * D;
        for (int64_t t = 0; t < 16; t++) {
            const int64_t j = 16 * block + t;
            for (int64_t d = 0; d < D; d++) kt[16 * d + t] = j < job->nk ? keys[j * D + d] : 0.0f;
        }
    }
}

/* Query rows per kv head from which the keys are laid out in blocks first. Measured on the 135M model at 1k
   context on a Xeon (AVX-512, two FMA units), before tiles spanned a kv head's query heads: a 5-token check (15
   rows) cost 1.71x a one-token step with the blocks, 1.63x without; a 1k prefill's attention was 1.4x faster with
   them. On an EPYC (Zen 4), tiles over the key rows are 4-12% faster than the blocks at 64 and 1k rows: the copy
   and the tiles' shuffle-free sums come out about even there. */
#define BLOCKED_FROM 64

/* Query rows times keys below which one thread computes a call's rows: the pool's hand-off costs more than the
   split saves. In a decode step the keys and values come from memory (the step's weights have pushed them out of
   the caches), and a second thread halves the wait: one request decoding alone on the embedded model (9 query
   heads, 3 kv heads of 64; 2-vCPU EPYC, the eight-question batching benchmark's answers, ~30-110 cached tokens,
   one process alternating the settings) spent 124 ms of a 1.46 s round in attention with calls below 2048 on one
   thread, 93 ms below 512, 77 ms below 128 (the round 1.35 s). A microbenchmark that calls attention over the same
   keys again and again (kept in cache) shows the opposite: 60 cached tokens 5.1 us on one thread, 6.4 on two. */
#define SPLIT_FROM 128

static int threads_for(int64_t rows_times_keys, int threads) { return rows_times_keys < SPLIT_FROM ? 1 : threads; }

/* job->kt for a job whose rows per kv head reach BLOCKED_FROM (left NULL where its memory cannot be had: the key
   rows are read as they are, slower, the same bits) */
static void lay_out_keys(attention_job *job, int64_t B, int threads) {
#ifdef KVA_AVX2
    if (job->D % 16 == 0 && job->nq * job->group >= BLOCKED_FROM && job->nk > 0) {
        job->kt = malloc((size_t)(B * job->KVH * job->blocks * 16 * job->D) * sizeof(float));
        if (job->kt) kvb_parallel(B * job->KVH * job->blocks, threads, block_keys, job);
    }
#else
    (void)job, (void)B, (void)threads;
#endif
}

int kvb_attention(const float *q, const float *k, const float *v, int64_t kv_batch_stride, int64_t kv_head_stride,
                  const uint8_t *mask, int64_t mask_heads, int causal, float *out, int64_t B, int64_t H, int64_t KVH,
                  int64_t nq, int64_t nk, int64_t D, float scale, int threads) {
    attention_job job = {q, k, v, kv_batch_stride, kv_head_stride, mask, mask_heads, causal, out, H, nq, nk, D,
                         H / KVH, scale, 0, NULL, KVH, (nk + 15) / 16};
    lay_out_keys(&job, B, threads);
    kvb_parallel(B * H * nq, threads_for(B * H * nq * nk, threads), attention_rows, &job);
    free(job.kt);
    return atomic_load(&job.status);
}

/* Causal attention of `count` requests' new rows in one parallel call (a batched step: one row each, or a
   newcomer's prompt piece), each over its own keys: request s's queries [H, nq[s], D] at q[s], its keys and values
   [KVH, nk[s] (the last nq[s] its new positions), D] at k[s], v[s], kv heads head_stride[s] apart, its output
   [nq[s], H, D] at out[s]. Each row is computed as kvb_attention computes it alone. Returns 0, or -2 when
   scratch memory cannot be had. */
int kvb_attention_segments(int64_t count, const float *const *q, const float *const *k, const float *const *v,
                           const int64_t *head_stride, const int64_t *nq, const int64_t *nk, float *const *out,
                           int64_t H, int64_t KVH, int64_t D, float scale, int threads) {
    attention_job *jobs = calloc((size_t)count, sizeof(attention_job));
    int64_t *first = malloc((size_t)(count + 1) * sizeof(int64_t));
    if (!jobs || !first) {
        free(jobs);
        free(first);
        return -2;
    }
    int64_t work = 0;
    first[0] = 0;
    for (int64_t s = 0; s < count; s++) {
        attention_job job = {q[s], k[s], v[s], 0, head_stride[s], NULL, 1, 1, out[s], H, nq[s], nk[s], D, H / KVH,
                             scale, 0, NULL, KVH, (nk[s] + 15) / 16};
        jobs[s] = job;
        lay_out_keys(&jobs[s], 1, threads);
        first[s + 1] = first[s] + H * nq[s];
        work += H * nq[s] * nk[s];
    }
    kvb_parallel_segments(count, first, attention_rows, jobs, sizeof(attention_job), threads_for(work, threads));
    int status = 0;
    for (int64_t s = 0; s < count; s++) {
        if (atomic_load(&jobs[s].status)) status = atomic_load(&jobs[s].status);
        free(jobs[s].kt);
    }
    free(jobs);
    free(first);
    return status;
}
