/* Attention one query row at a time, keys in position order: a row's result depends on its query and on the keys
   and values it attends, never on how many other rows are computed with it, how the prompt was cut into forwards,
   or the thread count (engine/exact_attention.py). float32 throughout; each dot product and each weighted sum runs
   in a fixed order of its dimension, the softmax sums over keys in position order. */

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
            if (mi ? !mi[j] : j > last) continue;
            const float s = dot_f32(qi, kb + j * D, D) * scale;
            scores[j] = s;
            if (!any || s > top) top = s;
            any = 1;
        }
        memset(o, 0, (size_t)D * sizeof(float));
        if (!any) continue;
        memset(acc, 0, (size_t)D * sizeof(float));
        float total = 0.0f;
        for (int64_t j = 0; j < nk; j++) {
            if (mi ? !mi[j] : j > last) continue;
            const float p = expf(scores[j] - top);
            total += p;
            add_scaled(acc, p, vb + j * D, D);
        }
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
