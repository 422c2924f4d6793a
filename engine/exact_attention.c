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

/* engine/thread_pool.c */
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

/* acc (D values) = sum over the attended keys j, in position order, of p[j] * v_j: each value's sum the same
   multiply-adds as add_scaled's, held in registers for the head sizes models use (64, 128) */
static inline __attribute__((always_inline)) void weighted_sum_fixed(float *acc, const float *p, const float *vb,
                                                                      const uint8_t *mi, int64_t nk, int64_t last,
                                                                      const int D) {
#ifdef KVA_AVX2
    __m256 a[16];
    for (int c = 0; c < D / 8; c++) a[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        if (mi ? !mi[j] : j > last) continue;
        const __m256 pv = _mm256_set1_ps(p[j]);
        for (int c = 0; c < D / 8; c++) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vb + j * D + 8 * c), a[c]);
    }
    for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(acc + 8 * c, a[c]);
#else
    memset(acc, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j < nk; j++)
        if (!(mi ? !mi[j] : j > last)) add_scaled(acc, p[j], vb + j * D, D);
#endif
}

static void weighted_sum(float *acc, const float *p, const float *vb, const uint8_t *mi, int64_t nk, int64_t last,
                         int64_t D) {
    if (D == 64) return weighted_sum_fixed(acc, p, vb, mi, nk, last, 64);
    if (D == 128) return weighted_sum_fixed(acc, p, vb, mi, nk, last, 128);
    memset(acc, 0, (size_t)D * sizeof(float));
    for (int64_t j = 0; j < nk; j++)
        if (!(mi ? !mi[j] : j > last)) add_scaled(acc, p[j], vb + j * D, D);
}

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

static void attention_rows(void *ctx, int64_t first, int64_t end) {
    attention_job *job = ctx;
    const float *q = job->q, *k = job->k, *v = job->v;
    const uint8_t *mask = job->mask;
    const int64_t kv_batch_stride = job->kv_batch_stride, kv_head_stride = job->kv_head_stride;
    const int64_t mask_heads = job->mask_heads, H = job->H, nq = job->nq, nk = job->nk, D = job->D;
    const int64_t group = job->group;
    const int causal = job->causal;
    const float scale = job->scale;
    float *out = job->out;
    float *scores = malloc((size_t)(nk > 0 ? nk : 1) * sizeof(float));
    float *acc = malloc((size_t)D * sizeof(float));
    if (!scores || !acc) {
        atomic_store(&job->status, -2);
        free(scores);
        free(acc);
        return;
    }
    for (int64_t r = first; r < end; r++) {
        const int64_t b = r / (H * nq), h = (r / nq) % H, i = r % nq, kv = h / group;
        const int64_t at = b * kv_batch_stride + kv * kv_head_stride;
        const float *qi = q + r * D, *kb = k + at, *vb = v + at;
        const uint8_t *mi = mask ? mask + ((b * mask_heads + (mask_heads > 1 ? h : 0)) * nq + i) * nk : 0;
        const int64_t last = causal ? nk - nq + i : nk - 1;
        float *o = out + ((b * nq + i) * H + h) * D;
        float top = -INFINITY;
        int any = 0;
        for (int64_t j = 0; j < nk; j++) {
            if (mi ? !mi[j] : j > last) {
                scores[j] = -INFINITY; /* weight 0 */
                continue;
            }
            const float s = dot_f32(qi, kb + j * D, D) * scale;
            scores[j] = s;
            if (!any || s > top) top = s;
            any = 1;
        }
        memset(o, 0, (size_t)D * sizeof(float));
        if (!any) continue;
        /* the weights: exp over every score up to the last attended key, then the attended ones summed in
           position order */
        const int64_t span = mi ? nk : last + 1;
        exp_shifted(scores, span, top);
        float total = 0.0f;
        for (int64_t j = 0; j < span; j++)
            if (mi ? mi[j] : 1) total += scores[j];
        weighted_sum(acc, scores, vb, mi, nk, last, D);
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
