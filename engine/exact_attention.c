/* Attention one query row at a time, keys in position order: a row's result depends on its query and on the keys
   and values it attends, never on how many other rows are computed with it, how the prompt was cut into forwards,
   or the thread count (engine/exact_attention.py). float32 throughout; each dot product and each weighted sum runs
   in a fixed order of its dimension, the softmax sums over keys in position order; its exponentials are this
   file's own (exp_one, exp8: the same bits in a vector lane as alone; libm's expf, one call per key, was a fifth
   of a 1k-token prefill). Changing any of this changes KV: gguf_blocks.ATTENTION_NUMERICS is in the fingerprint. */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* engine/weights/thread_pool.c */
typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx);
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVA_AVX2 1
#endif

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

static inline void add_scaled(float *acc, float p, const float *x, int64_t n) { /* acc += p * x */
    int64_t d = 0;
#ifdef KVA_AVX2
    const __m256 pv = _mm256_set1_ps(p);
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + d),
                                                                         _mm256_loadu_ps(acc + d)));
#endif
    for (; d < n; d++) acc[d] += p * x[d];
}

/* exp(x) for x <= 0 (a score minus the row's largest), the same bits in every lane and in exp_one: x = n ln2 + r
   (n = nearest integer to x / ln2, ln2 in two parts), exp(r) by a degree-6 polynomial in r (Horner, fused
   multiply-adds), times 2^n built in the exponent field; below -87.33 (about where exp leaves the normal
   floats): 0. Within 3 ulp of exp. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_FLOOR -87.33f
static const float exp_poly[7] = {1.0f, 1.0f, 0.5f, 1.6666665459e-1f, 4.1666641831e-2f, 8.3333803341e-3f,
                                  1.3887316255e-3f};

static inline float exp_one(float x) {
    if (!(x >= EXP_FLOOR)) return 0.0f;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float e = exp_poly[6];
    for (int i = 5; i >= 0; i--) e = fmaf(e, r, exp_poly[i]);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return e * scale;
}

#ifdef KVA_AVX2
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR)); /* masked to 0 below; keeps 2^n in range */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 e = _mm256_set1_ps(exp_poly[6]);
    for (int i = 5; i >= 0; i--) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(exp_poly[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(bits)), keep);
}
#endif

/* p[j] = exp(p[j] - top) for j < n, in place; the same bits for a j whichever way it is reached */
static inline void exp_shifted(float *p, int64_t n, float top) {
    int64_t j = 0;
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
} attention_job;

/* Row r's weights: scores[j] = exp(score_j - the row's largest) for the keys j < *span (masked ones 0), row r's
   query, key and value bases and its last attended key in *qi, *kb, *vb, *mi, *last; 0 when the row attends no key */
static int row_weights(const attention_job *job, int64_t r, float *scores, const float **kb, const float **vb,
                       const uint8_t **mi_out, int64_t *last_out, int64_t *span_out) {
    const int64_t H = job->H, nq = job->nq, nk = job->nk, D = job->D;
    const int64_t b = r / (H * nq), h = (r / nq) % H, i = r % nq, kv = h / job->group;
    const int64_t at = b * job->kv_batch_stride + kv * job->kv_head_stride;
    const float *qi = job->q + r * D;
    *kb = job->k + at, *vb = job->v + at;
    const uint8_t *mi = job->mask ? job->mask + ((b * job->mask_heads + (job->mask_heads > 1 ? h : 0)) * nq + i) * nk
                                  : 0;
    const int64_t last = job->causal ? nk - nq + i : nk - 1;
    /* the keys that may be attended: every key under a mask, else those up to the last (the rest are never read) */
    const int64_t span = mi ? nk : (last + 1 < nk ? last + 1 : nk);
    *mi_out = mi, *last_out = last, *span_out = span;
    float top = -INFINITY;
    int any = 0;
    int64_t j = 0;
#ifdef KVA_AVX2
    if (D % 16 == 0)
        for (; j + 8 <= span; j += 8) dot8_f32(qi, *kb + j * D, D, job->scale, scores + j);
#endif
    for (; j < span; j++) /* the rest one at a time; then masks and the largest, in order */
        if (!(mi ? !mi[j] : j > last)) scores[j] = dot_f32(qi, *kb + j * D, D) * job->scale;
    if (mi) {
        for (j = 0; j < span; j++) {
            if (!mi[j]) {
                scores[j] = -INFINITY; /* weight 0 */
                continue;
            }
            if (!any || scores[j] > top) top = scores[j];
            any = 1;
        }
    } else if (span > 0) { /* every key up to span attended: the largest score, 8 lanes at a time */
        any = 1;
        top = scores[0];
        j = 0;
#ifdef KVA_AVX2
        __m256 lanes = _mm256_set1_ps(top);
        for (; j + 8 <= span; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(scores + j), lanes);
        float lane[8];
        _mm256_storeu_ps(lane, lanes);
        for (int l = 0; l < 8; l++) top = lane[l] > top ? lane[l] : top;
#endif
        for (; j < span; j++) top = scores[j] > top ? scores[j] : top;
    }
    /* the weights: exp over every score up to the last attended key (then summed, the attended ones, in position
       order, with the weighted sum) */
    if (any) exp_shifted(scores, span, top);
    return any;
}

static void attention_rows(void *ctx, int64_t first, int64_t end) {
    attention_job *job = ctx;
    const int64_t H = job->H, nq = job->nq, nk = job->nk, D = job->D;
    float *scores = malloc((size_t)(nk > 0 ? 2 * nk : 2) * sizeof(float)), *more = scores + (nk > 0 ? nk : 1);
    float *acc = malloc((size_t)(2 * D) * sizeof(float));
    if (!scores || !acc) {
        atomic_store(&job->status, -2);
        free(scores);
        free(acc);
        return;
    }
    for (int64_t r = first; r < end; r++) {
        const int64_t b = r / (H * nq), h = (r / nq) % H, i = r % nq;
        float *o = job->out + ((b * nq + i) * H + h) * D;
        const float *kb, *vb;
        const uint8_t *mi;
        int64_t last, span;
        const int any = row_weights(job, r, scores, &kb, &vb, &mi, &last, &span);
#ifdef KVA_AVX2
        /* the next row of the same head, causal and unmasked: both weighted sums in one pass over v */
        if (!mi && (D == 64 || D == 128) && r + 1 < end && i + 1 < nq && any && last >= 0) {
            const float *kb2, *vb2;
            const uint8_t *mi2;
            int64_t last2, span2;
            if (row_weights(job, r + 1, more, &kb2, &vb2, &mi2, &last2, &span2)) {
                float *o2 = job->out + ((b * nq + i + 1) * H + h) * D;
                float totals[2];
                if (D == 64) weighted_sum_pair(acc, acc + D, scores, more, vb, last + 1, last2 + 1, 64, totals);
                else weighted_sum_pair(acc, acc + D, scores, more, vb, last + 1, last2 + 1, 128, totals);
                for (int64_t d = 0; d < D; d++) o[d] = acc[d] / totals[0];
                for (int64_t d = 0; d < D; d++) o2[d] = acc[D + d] / totals[1];
                r++;
                continue;
            }
        }
#endif
        if (!any) {
            memset(o, 0, (size_t)D * sizeof(float));
            continue;
        }
        const float total = weighted_sum(acc, scores, vb, mi, nk, last, D);
        for (int64_t d = 0; d < D; d++) o[d] = acc[d] / total;
    }
    free(scores);
    free(acc);
}

int kvb_attention(const float *q, const float *k, const float *v, int64_t kv_batch_stride, int64_t kv_head_stride,
                  const uint8_t *mask, int64_t mask_heads, int causal, float *out, int64_t B, int64_t H, int64_t KVH,
                  int64_t nq, int64_t nk, int64_t D, float scale, int threads) {
    attention_job job = {q, k, v, kv_batch_stride, kv_head_stride, mask, mask_heads, causal, out, H, nq, nk, D,
                         H / KVH, scale, 0};
    kvb_parallel(B * H * nq, threads, attention_rows, &job);
    return atomic_load(&job.status);
}
