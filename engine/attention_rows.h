/* The arithmetic of attention one query row at a time (engine/exact_attention.c; its comment says what it
   promises): each row's dot products, softmax and weighted sums, whichever way exact_attention.c lays out the
   work of a call. */

#ifndef KVB_ATTENTION_ROWS_H
#define KVB_ATTENTION_ROWS_H

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

static inline float weighted_sum(float *acc, const float *p, const float *vb, const uint8_t *mi, int64_t nk,
                                int64_t last, int64_t D) {
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
    /* B = 1 only: the first `shared` keys and values are also at lk and lv (kv heads lead_stride apart), another
       request's cache holding the very same bits, read there where the rows' tiles take them (NULL: none) */
    const float *lk, *lv;
    int64_t lead_stride, shared;
} attention_job;

/* What row r reads and writes: its query, its kv head's keys (as rows, and as blocks where job->kt holds them) and
   values, its mask row (NULL: none), its last attended key, the keys that may be attended (span: every key under a
   mask, else those up to the last; the rest are never read) and its output */
typedef struct {
    const float *q, *k, *v, *kt;
    const uint8_t *mask;
    int64_t last, span;
    float *out;
    const float *lk, *lv; /* its kv head's first `shared` keys and values, the same bits elsewhere (else k, v, 0) */
    int64_t shared;
} row_view;

static inline row_view row_of(const attention_job *job, int64_t r) {
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
    w.lk = job->lk ? job->lk + kv * job->lead_stride : w.k;
    w.lv = job->lv ? job->lv + kv * job->lead_stride : w.v;
    w.shared = job->lk && job->lv ? job->shared : 0;
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
static inline void row_scores(const attention_job *job, const row_view *w, float *scores) {
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
static inline int row_softmax(const row_view *w, float *scores) {
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

static inline int row_weights(const attention_job *job, const row_view *w, float *scores) {
    row_scores(job, w, scores);
    return row_softmax(w, scores);
}

static inline void write_row(const row_view *w, const float *acc, float total, int64_t D) {
    for (int64_t d = 0; d < D; d++) w->out[d] = acc[d] / total;
}

#endif
