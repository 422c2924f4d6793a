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
   a decode step or a check reads the key rows as they are (a copy would cost more than it saves). A row's
   arithmetic (dot products, softmax, weighted sums) is in attention_rows.h; this file lays out the work. */

#include "attention_rows.h"

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

/* A decode step reads each row's keys and values from memory, the step's weights having pushed them out of the
   caches, and the hardware's prefetchers alone left it waiting: the tiles' loops over keys and values ask for the
   rows AHEAD bytes further on, into L2. `bench kernels --context 150,1024,4096 --against` the build before (9 heads
   of 64 over 3 kv heads, keys and values rotated past L3, 2-vCPU EPYC; docs/benchmarks.md): a decode step's
   attention 0.75-0.94x the time at 1k cached tokens, 0.67-0.88x at 4k, the same bits. The AVX2 build's rows, one or
   two at a time, read a kv head's keys once per row: there the hints cost more than they saved (1.1-1.2x the time
   for checks), and it has none. */
#define AHEAD 8192
/* The rows of a tile that asks: a decode step's (its kv head's query heads) and a check's, a full tile. Tiles of a
   prefill's 64 rows and more a kv head read keys laid out in blocks, and do not ask. Checks asked only from 8 rows
   down while a step's products asked for every request's cached keys and values ahead (block_forward.c); since
   those stop at 1 MiB a layer, a single request's check over a long context reads them here (2-vCPU Xeon, `bench
   step --positions 3,5,7`, the two builds alternating: 0.85-0.99x the time at 1400 and 3000 cached tokens, the
   same within the noise at 450; the needle answers of `bench speculative --prompts 5` 2.08-2.21x faster with
   drafts, 1.88-1.97x before). */
#define FETCH_ROWS 16

/* rows from .. from + count - 1 of `rows` (D values each) asked for, where all are below n. Inlined always: gcc
   sees no effect in a function that only prefetches, and dropped the calls of a plain inline one at -O2. */
static inline __attribute__((always_inline)) void fetch_rows(const float *rows, int64_t from, int64_t count,
                                                               int64_t n, int64_t D) {
#ifdef KVA_AVX2
    if (from + count > n) return;
    const char *at = (const char *)(rows + from * D);
    for (int64_t line = 0; line < 4 * count * D; line += 64) _mm_prefetch(at + line, _MM_HINT_T1);
#else
    (void)rows, (void)from, (void)count, (void)n, (void)D;
#endif
}

/* keys j .. j + 7 of n are being scored: the eight AHEAD bytes on */
static inline __attribute__((always_inline)) void fetch_keys(const float *k, int64_t j, int64_t n,
                                                               int64_t D) {
    fetch_rows(k, j + AHEAD / (4 * D), 8, n, D);
}

/* value row j of n is being added: every second one, the two AHEAD bytes on */
static inline __attribute__((always_inline)) void fetch_values(const float *v, int64_t j, int64_t n,
                                                                 int64_t D) {
    if (!(j & 1)) fetch_rows(v, j + AHEAD / (4 * D), 2, n, D);
}

#define TILE 16 /* query rows of one kv head whose scores are computed together, a block of keys read once for all */

#ifdef KVA_AVX2

#ifdef __AVX512F__
/* weighted_sum_fixed for R rows of one head without a mask, row g attending keys 0 .. n[g] - 1 with the weights
   p + g * stride: each row's sums the very same multiply-adds and adds, in the same order, as alone; the rows share
   each value row's reads (asked for ahead where `fetch`: the first group of a tile, which reads them from memory) */
static inline __attribute__((always_inline)) void weighted_sum_rows(float *acc, const float *p, int64_t stride,
                                                                    const row_view *w, const int64_t *n, const int R,
                                                                    const int D, float *totals, int fetch) {
    __m512 a[16];
    int64_t most = 0;
    const int64_t ahead = AHEAD / (4 * D);
    for (int g = 0; g < R; g++) totals[g] = 0.0f, most = n[g] > most ? n[g] : most;
    for (int x = 0; x < R * (D / 16); x++) a[x] = _mm512_setzero_ps();
    for (int64_t j = 0; j < most; j++) {
        if (fetch) fetch_values(j + ahead < w->shared ? w->lv : w->v, j, most, D);
        const float *vj = (j < w->shared ? w->lv : w->v) + j * D; /* the same bits either way */
#pragma GCC unroll 4
        for (int g = 0; g < R; g++) {
            if (j >= n[g]) continue;
            totals[g] += p[g * stride + j];
            const __m512 pv = _mm512_set1_ps(p[g * stride + j]);
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++)
                a[g * (D / 16) + c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + 16 * c), a[g * (D / 16) + c]);
        }
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
        for (int64_t j = 0; j + 8 <= most; j += 8) {
            /* the tile's rows read one kv head's keys: its first w[0].shared also where another request reads them */
            if (R <= FETCH_ROWS) fetch_keys(j + 8 + AHEAD / (4 * D) <= w[0].shared ? w[0].lk : w[0].k, j, most, D);
            const float *keys = (j + 8 <= w[0].shared ? w[0].lk : w[0].k) + j * D; /* the same bits either way */
            for (int g = 0; g < R; g++)
                if (j + 8 <= w[g].span) dot8_f32(w[g].q, keys, D, job->scale, scores + g * width + j);
        }
    for (int g = 0; g < R; g++) {
        float *row = scores + g * width;
        for (int64_t j = D % 16 == 0 ? w[g].span / 8 * 8 : 0; j < w[g].span; j++)
            if (!(w[g].mask ? !w[g].mask[j] : j > w[g].last)) row[j] = dot_f32(w[g].q, w[g].k + j * D, D) * job->scale;
    }
}

#ifdef __AVX512F__
/* weighted_sum_rows for the `count` (1-4) rows from g, with the number of rows a constant of each call */
static void weighted_sums_of(float *acc, const float *p, int64_t stride, const row_view *vb, const int64_t *n,
                             int count, int64_t D, float *totals, int fetch) {
    if (D == 64) {
        switch (count) {
        case 1: weighted_sum_rows(acc, p, stride, vb, n, 1, 64, totals, fetch); return;
        case 2: weighted_sum_rows(acc, p, stride, vb, n, 2, 64, totals, fetch); return;
        case 3: weighted_sum_rows(acc, p, stride, vb, n, 3, 64, totals, fetch); return;
        default: weighted_sum_rows(acc, p, stride, vb, n, 4, 64, totals, fetch); return;
        }
    }
    if (count == 1) weighted_sum_rows(acc, p, stride, vb, n, 1, 128, totals, fetch);
    else weighted_sum_rows(acc, p, stride, vb, n, 2, 128, totals, fetch);
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
                /* the values asked for ahead by a decode step's tile, in its first group */
                weighted_sums_of(acc, scores + g * width, width, &w[g], n, count, D, totals,
                                 g == 0 && R <= FETCH_ROWS && !w[0].kt);
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
   [nq[s], H, D] at out[s]. Each row is computed as kvb_attention computes it alone. Where `shared` is not NULL,
   request s's first shared[s] keys and values are also at lead_k[s], lead_v[s] (kv heads lead_stride[s] apart),
   bit for bit: another request's cache, which requests whose prompts begin alike read in turn while it is in
   cache, where each would read its own copy from memory (the caller checks the bits: block_forward.py). Returns
   0, or -2 when scratch memory cannot be had. */
int kvb_attention_segments(int64_t count, const float *const *q, const float *const *k, const float *const *v,
                           const int64_t *head_stride, const int64_t *nq, const int64_t *nk, float *const *out,
                           int64_t H, int64_t KVH, int64_t D, float scale, int threads, const float *const *lead_k,
                           const float *const *lead_v, const int64_t *lead_stride, const int64_t *shared) {
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
        if (shared && shared[s] > 0)
            job.lk = lead_k[s], job.lv = lead_v[s], job.lead_stride = lead_stride[s], job.shared = shared[s];
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
