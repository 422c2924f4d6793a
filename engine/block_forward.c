/* A Llama-family decoder's layers in one call (engine/block_forward.py): RMS norms, block-kernel linears, rotary
   embedding, the cache write and attention one row at a time, SiLU gating and the residual adds, for m new
   positions after `start` cached ones. Every step is the function the module-by-module forward calls for it
   (kvb_rmsnorm, kvb_silu, kvb_linear's quantize + matmul, kvb_attention) or an elementwise float operation in
   the order PyTorch runs it (rotary: q * cos + rotate_half(q) * sin; residual: x + y), so the logits and the
   cache are bit for bit those of transformers' forward over the same modules: this is a faster way to the same
   numbers, never other numbers. Built with -ffp-contract=off (no fused multiply-adds outside the kernels' own). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "own_exp.h"

void kvb_quantize(const float *x, int64_t rows, int64_t k, int block, int8_t *q, float *d, void *sums, int threads);
int kvb_matmul_many(int count, const int *types, const uint8_t *const *w, const int64_t *n, int64_t k,
                    const int64_t *row_bytes, const int8_t *q, const float *d, const void *sums, int64_t m,
                    float *const *y, int threads, const char *const *fetch_at, const int64_t *fetch_bytes,
                    int64_t fetch_count, int64_t fetch_from, int64_t fetch_to);
int kvb_activation_block(int type);
int kvb_attention_segments(int64_t count, const float *const *q, const float *const *k, const float *const *v,
                           const int64_t *head_stride, const int64_t *nq, const int64_t *nk, float *const *out,
                           int64_t H, int64_t KVH, int64_t D, float scale, int threads, const float *const *lead_k,
                           const float *const *lead_v, const int64_t *lead_stride, const int64_t *shared);

/* out[r] = w * (x[r] / sqrt(mean(x[r]^2) + eps)), the mean's sum in a fixed order of the row (eight lanes, then
   the lanes in order, then the tail): a row's result does not depend on the other rows. */
void kvb_rmsnorm(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float lanes[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) lanes[j] += xr[i + j] * xr[i + j];
        float total = 0.0f;
        for (int j = 0; j < 8; j++) total += lanes[j];
        for (; i < n; i++) total += xr[i] * xr[i];
        const float inverse = 1.0f / sqrtf(total / (float)n + eps);
        for (i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inverse);
    }
}

/* out = x / (1 + exp(-x)), exp the library's own (own_exp.h; -x past EXP_CEIL: infinity, so -0 where silu is
   within 6e-37 of it): the same bits in a vector lane as alone */
static inline float silu_one(float x) {
    const float minus = -x;
    return x / (1.0f + (minus > EXP_CEIL ? INFINITY : exp_one(minus)));
}

void kvb_silu(const float *x, int64_t n, float *out) {
    int64_t i = 0;
#ifdef __AVX512F__
    const __m512 sign = _mm512_set1_ps(-0.0f), ceil = _mm512_set1_ps(EXP_CEIL), one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i), minus = _mm512_xor_ps(v, sign);
        const __m512 e = _mm512_mask_mov_ps(exp16(_mm512_min_ps(minus, ceil)),
                                            _mm512_cmp_ps_mask(minus, ceil, _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
        _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.0f), ceil = _mm256_set1_ps(EXP_CEIL), one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i), minus = _mm256_xor_ps(v, sign);
        const __m256 e = _mm256_blendv_ps(exp8(_mm256_min_ps(minus, ceil)), _mm256_set1_ps(INFINITY),
                                          _mm256_cmp_ps(minus, ceil, _CMP_GT_OQ));
        _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) out[i] = silu_one(x[i]);
}

/* The same two, rows split between the kernels' threads (a prefill's norms and gating were a single thread's
   work: SiLU over 1024 x 8960 values, 28 times, ~0.8 s of a 1.5B-shaped model's 1024-token prefill). Each value
   is computed by the same operations as above, whichever thread takes its row. */
typedef struct {
    const float *x, *w, *up;
    int64_t n;
    float eps, *out;
} rows_job;

typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx);

static void rmsnorm_rows(void *ctx, int64_t first, int64_t end) {
    const rows_job *j = ctx;
    kvb_rmsnorm(j->x + first * j->n, j->w, end - first, j->n, j->eps, j->out + first * j->n);
}

/* Values below which a row-wise step runs on the calling thread: a batched step's norms, roundings and gating
   over 8 rows of 576-1536 values take a few microseconds, about what handing half of them to another thread
   and waiting for it costs. */
#define SPLIT_VALUES 16384

static int threads_for(int64_t rows, int64_t n, int threads) {
    return rows > 1 && rows * n >= SPLIT_VALUES ? threads : 1;
}

static void rmsnorm_parallel(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out,
                             int threads) {
    rows_job job = {x, w, NULL, n, eps, out};
    kvb_parallel(rows, threads_for(rows, n, threads), rmsnorm_rows, &job);
}

/* out = silu(gate) * up, as kvb_silu and then the product (the one-call forward's gating) */
static void gating_rows(void *ctx, int64_t first, int64_t end) {
    const rows_job *j = ctx;
    const int64_t from = first * j->n, to = end * j->n;
    kvb_silu(j->x + from, to - from, j->out + from);
    for (int64_t i = from; i < to; i++) j->out[i] = j->out[i] * j->up[i];
}

static void gating_parallel(const float *gate, const float *up, int64_t rows, int64_t n, float *out, int threads) {
    rows_job job = {gate, NULL, up, n, 0.0f, out};
    kvb_parallel(rows, threads_for(rows, n, threads), gating_rows, &job);
}

typedef struct {
    int64_t type, n, k, row_bytes;
    const uint8_t *w;
    const float *bias; /* [n] or NULL */
} kvb_weight;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    kvb_weight q, k, v, o, gate, up, down;
} kvb_layer;

typedef struct { /* one activation matrix rounded for a weight's activation block (32 or 256), made once */
    int block;
    int8_t *q;
    float *d;
    void *sums;
} rounded;

/* Where a forward's time goes (`bench batching --by-step`): seconds in each phase, summed over the forwards run while
   kvb_forward_timing(1) is on; one forward at a time (the sums are plain globals). Off, a phase's end is one test. */
enum { PHASE_PRODUCTS, PHASE_ROUNDING, PHASE_ATTENTION, PHASE_ROWS, PHASES };
static int timing;
static double phase_seconds[PHASES];

static double seconds_now(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* on: phases timed from now, their sums cleared; off: not timed */
void kvb_forward_timing(int on) {
    timing = on;
    memset(phase_seconds, 0, sizeof phase_seconds);
}

/* the sums so far, in seconds: the weights' products, the activations' rounding for them, attention (with the
   queries laid out and the new keys and values written), the row steps (norms, rotary, residual adds, gating) */
void kvb_forward_phases(double out[PHASES]) { memcpy(out, phase_seconds, sizeof phase_seconds); }

#define PHASE_END(phase, mark)                                                                                     \
    do {                                                                                                           \
        if (timing) {                                                                                              \
            const double now_ = seconds_now();                                                                     \
            phase_seconds[phase] += now_ - (mark);                                                                 \
            (mark) = now_;                                                                                         \
        }                                                                                                          \
    } while (0)

static void round_for(rounded *slot, const float *x, int64_t m, int64_t k, int block, int threads) {
    if (slot->block != block) {
        double mark = timing ? seconds_now() : 0.0;
        kvb_quantize(x, m, k, block, slot->q, slot->d, slot->sums, threads_for(m, k, threads));
        slot->block = block;
        if (timing) phase_seconds[PHASE_PRODUCTS] -= seconds_now() - mark; /* inside a product's phase */
        PHASE_END(PHASE_ROUNDING, mark);
    }
}

static void add_bias(const kvb_weight *w, int64_t m, float *y) {
    if (w->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < w->n; i++) y[r * w->n + i] = y[r * w->n + i] + w->bias[i];
}

/* Cached keys and values a step reads next (list_cached), asked for into L2 while products run: each product asks
   for the lines from .. to - 1 of their `lines` cache lines, its tasks a share each (kvb_matmul_many) */
typedef struct {
    const char **at;
    int64_t *bytes;
    int64_t count, lines;
} fetch_plan;

/* y[j] = x W[j]^T (+ bias) for `count` (1-3) weights of the same input x, x rounded once per activation block size
   in `slots` (two: 32 and 256): one parallel call where their activations round to the same block (q, k and v;
   gate and up: one hand-off between the threads instead of three or two), else one call each (the first asking
   for the lines). The same outputs either way. */
static int linears(int count, const kvb_weight *const *w, const float *x, rounded *slots, int64_t m,
                   float *const *y, int threads, const fetch_plan *plan, int64_t from, int64_t to) {
    const int block = kvb_activation_block((int)w[0]->type);
    int same = 1;
    for (int j = 0; j < count; j++) same = same && kvb_activation_block((int)w[j]->type) == block && w[j]->k == w[0]->k;
    for (int j = 0; j < count; j++) {
        const int many = same ? count - j : 1, block_j = kvb_activation_block((int)w[j]->type);
        int types[3];
        const uint8_t *weights[3];
        int64_t n[3], row_bytes[3];
        for (int i = 0; i < many; i++)
            types[i] = (int)w[j + i]->type, weights[i] = w[j + i]->w, n[i] = w[j + i]->n,
            row_bytes[i] = w[j + i]->row_bytes;
        rounded *slot = block_j == 32 ? &slots[0] : &slots[1];
        round_for(slot, x, m, w[j]->k, block_j, threads);
        const int asks = plan != NULL && j == 0 && from < to;
        const int status = kvb_matmul_many(many, types, weights, n, w[j]->k, row_bytes, slot->q, slot->d, slot->sums,
                                           m, y + j, threads, asks ? plan->at : NULL, asks ? plan->bytes : NULL,
                                           asks ? plan->count : 0, from, to);
        if (status) return status;
        for (int i = 0; i < many; i++) add_bias(w[j + i], m, y[j + i]);
        j += many - 1;
    }
    return 0;
}

/* x [m, heads, D] in place: x * cos + rotate_half(x) * sin, cos and sin [m, D] (rotate_half: the second half
   negated, then the first). */
static void rotate(float *x, const float *cos, const float *sin, int64_t m, int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    float turned[512];
    for (int64_t i = 0; i < m; i++)
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (i * heads + h) * D;
            const float *c = cos + i * D, *s = sin + i * D;
            for (int64_t d = 0; d < half; d++) turned[d] = -v[d + half], turned[d + half] = v[d];
            for (int64_t d = 0; d < D; d++) v[d] = v[d] * c[d] + turned[d] * s[d];
        }
}

static void *take(uint8_t **at, int64_t bytes) {
    void *p = *at;
    *at += (bytes + 63) / 64 * 64;
    return p;
}

typedef struct { /* one request's cache in one layer: buffers [kv_heads, capacity, head_dim] */
    float *keys, *values;
    int64_t head_stride; /* capacity * head_dim */
} kvb_cache;

/* Rows from which a step asks for the next layer's cached keys and values while this layer's o, gate, up and down
   products run. A decode step's attention reads them from memory (the step's weights have pushed them out of the
   caches) and waited on them: eight batched streams of the embedded model (2-vCPU EPYC, the benchmark's answers,
   one process alternating the builds) spent 57 ms of a round's 324 ms of layers in attention, 25 ms with the
   keys asked for ahead, the products taking 16 ms longer (302 ms in all). Asked for during the gate and up
   products alone, or the q, k and v products just before attention, the products lost most of the gain: those
   bursts of requests left them waiting. A step of few rows reads its weights from memory, and the keys compete
   with them: one row lost 68 ms in the products for 20 ms gained in attention. */
#define FETCH_FROM 4
/* A step's cached keys and values are asked for only up to this size a layer, all its requests together (~700
   tokens of the embedded model): requests in order, each whole or not at all. One long context is one stream per kv
   head that attention's own hints (exact_attention.c, AHEAD) and the hardware's prefetchers follow, and asked for
   all at once it took the memory the products' weights were coming through, or was pushed out of L2 before
   attention came to it. Measured on a 2-vCPU Xeon, the builds alternating:
   - a single request's check of 4 or 6 drafted tokens (`python -m bench step --positions 1,3,5,7`) took
     0.87-0.93x / 0.91-0.95x the time with 1400 cached tokens and 0.77-0.89x / 0.81-0.90x with 3000 when they were
     not asked for; 150 and 450 cached tokens and prefill pieces of 64 and 256 rows read the same within the noise;
   - eight batched requests over ~600 cached tokens each (`python -m bench batching --engine-only --document 600`,
     0.9 MB a request a layer), when this was a cap per request: the round's layers 1122-1131 ms, 891-911 ms with it
     for the step (no cap: 1187-1220 ms, nothing asked: 871-883); eight short chats (the same without --document)
     read the same with the cap, without it and with nothing asked (287-304 ms). */
#define FETCH_MOST_BYTES (1024 * 1024)

/* plan: layer l's cached keys and values (segments in order while the total stays within FETCH_MOST_BYTES, each
   kv head's positions before its new rows) */
static void list_cached(fetch_plan *plan, const kvb_cache *caches, int64_t n_layers, int64_t l, int64_t segments,
                        const int64_t *starts, const int64_t *shared, int64_t kv_heads, int64_t head_dim) {
    int64_t f = 0, total = 0;
    plan->lines = 0;
    for (int64_t s = 0; s < segments; s++) {
        const kvb_cache *c = &caches[s * n_layers + l];
        const int64_t bytes = 2 * kv_heads * 4 * starts[s] * head_dim;
        if (total + bytes > FETCH_MOST_BYTES || (shared && shared[s])) continue; /* long contexts: see above; a
                                                                                    lead's bits: asked for there */
        total += bytes;
        for (int64_t h = 0; h < kv_heads; h++, f += 2) {
            plan->at[f] = (const char *)(c->keys + h * c->head_stride);
            plan->at[f + 1] = (const char *)(c->values + h * c->head_stride);
            plan->bytes[f] = plan->bytes[f + 1] = 4 * starts[s] * head_dim;
            plan->lines += 2 * ((plan->bytes[f] + 63) / 64);
        }
    }
    plan->count = f;
}

/* The first position from start to stop at which two requests' caches (a[l], b[l] for the first n_layers layers)
   hold different bits in any key or value, stop where none do: requests that begin alike (kvb_decoder_packed's
   lead). Each kv head's rows are compared at once, and row by row only where they differ. */
int64_t kvb_same_until(const kvb_cache *a, const kvb_cache *b, int64_t n_layers, int64_t kv_heads, int64_t head_dim,
                       int64_t start, int64_t stop) {
    const size_t row = (size_t)head_dim * sizeof(float);
    for (int64_t l = 0; l < n_layers && start < stop; l++)
        for (int64_t h = 0; h < kv_heads && start < stop; h++)
            for (int which = 0; which < 2; which++) {
                const float *x = (which ? a[l].values : a[l].keys) + h * a[l].head_stride + start * head_dim;
                const float *y = (which ? b[l].values : b[l].keys) + h * b[l].head_stride + start * head_dim;
                if (memcmp(x, y, (size_t)(stop - start) * row) == 0) continue;
                for (int64_t j = 0; j < stop - start; j++)
                    if (memcmp(x + j * head_dim, y + j * head_dim, row)) {
                        stop = start + j;
                        break;
                    }
            }
    return stop;
}

/* Runs `n_layers` layers over x [m, hidden] (overwritten with the last layer's output): the rows of `segments`
   requests one after the other, segment s `rows[s]` rows at positions starts[s] .. starts[s] + rows[s] - 1 over its
   own cache (caches[s * n_layers + l] in layer l), each layer's
   keys and values for them written into that cache and attention computed per segment over its own keys. Every
   other step works per row, so a segment's outputs are those it gets alone. cos, sin [m, head_dim]: the model's
   rotary embedding at each row's position. `lead` and `shared` (both NULL, or both set): segment s's first
   shared[s] cached positions hold, in every layer, the very same bits as segment lead[s]'s (lead[s] < s, shared[s]
   at most both segments' starts; the caller has compared them), and its attention reads them there, where the
   segments before it have just read them (kvb_attention_segments). Returns 0, -1 for a weight type the kernel does
   not multiply, -2 when scratch memory cannot be had, -3 for shapes or leads it does not take. */
int kvb_decoder_packed(const kvb_layer *layers, int64_t n_layers, const kvb_cache *caches, int64_t segments,
                       const int64_t *rows, const int64_t *starts, float *x, int64_t m, int64_t hidden, int64_t heads,
                       int64_t kv_heads, int64_t head_dim, int64_t intermediate, const float *cos, const float *sin,
                       float eps, float scale, int threads, const int64_t *lead, const int64_t *shared) {
    if (head_dim > 512 || head_dim % 2 || heads % kv_heads || m <= 0 || segments <= 0 || (!lead != !shared))
        return -3;
    int64_t total = 0;
    for (int64_t s = 0; s < segments; s++) {
        if (rows[s] <= 0 || starts[s] < 0) return -3;
        if (shared && shared[s] && (shared[s] < 0 || lead[s] < 0 || lead[s] >= s || shared[s] > starts[s] ||
                                    shared[s] > starts[lead[s]]))
            return -3;
        total += rows[s];
    }
    if (total != m) return -3;
    const int64_t qn = heads * head_dim, kvn = kv_heads * head_dim, widest = hidden > intermediate ? hidden : intermediate;
    const int64_t bytes = 4 * m * (hidden + 3 * qn + 2 * kvn + 3 * intermediate) +
                          2 * (2 * m * widest + 8 * m * (widest / 16 + 1)) + 64 * 16;
    uint8_t *scratch = malloc((size_t)bytes), *at = scratch;
    /* per request: its queries, keys, values and output for the layer's attention call */
    float **seg_q = malloc((size_t)segments * 6 * sizeof(float *));
    int64_t *seg_stride = malloc((size_t)segments * 3 * sizeof(int64_t));
    fetch_plan plan = {malloc((size_t)(2 * segments * kv_heads) * sizeof(char *)),
                       malloc((size_t)(2 * segments * kv_heads) * sizeof(int64_t)), 0, 0};
    if (!scratch || !seg_q || !seg_stride || !plan.at || !plan.bytes) {
        free(scratch);
        free(seg_q);
        free(seg_stride);
        free(plan.at);
        free(plan.bytes);
        return -2;
    }
    float **seg_k = seg_q + segments, **seg_v = seg_k + segments, **seg_out = seg_v + segments;
    float **lead_k = seg_out + segments, **lead_v = lead_k + segments;
    int64_t *seg_nk = seg_stride + segments, *lead_stride = seg_nk + segments;
    float *normed = take(&at, 4 * m * hidden), *q = take(&at, 4 * m * qn), *q_heads = take(&at, 4 * m * qn);
    float *attended = take(&at, 4 * m * qn), *k = take(&at, 4 * m * kvn), *v = take(&at, 4 * m * kvn);
    float *gate = take(&at, 4 * m * intermediate), *up = take(&at, 4 * m * intermediate);
    float *mixed = take(&at, 4 * m * intermediate);
    rounded slots[2];
    for (int s = 0; s < 2; s++) {
        slots[s].q = take(&at, 2 * m * widest); /* int16 codes for the 32-value types */
        slots[s].d = take(&at, 4 * m * (widest / 16 + 1));
        slots[s].sums = take(&at, 4 * m * (widest / 16 + 1)); /* 8 bytes per 32 (kvb_sum32), 2 per 16 */
    }
    int status = 0;
    double mark = timing ? seconds_now() : 0.0;
    for (int64_t l = 0; l < n_layers && status == 0; l++) {
        const kvb_layer *L = &layers[l];
        rmsnorm_parallel(x, L->input_norm, m, hidden, eps, normed, threads);
        PHASE_END(PHASE_ROWS, mark);
        slots[0].block = slots[1].block = 0;
        const kvb_weight *qkv[3] = {&L->q, &L->k, &L->v};
        float *qkv_out[3] = {q, k, v};
        if (l == 0 && m >= FETCH_FROM)
            list_cached(&plan, caches, n_layers, 0, segments, starts, shared, kv_heads, head_dim);
        if ((status = linears(3, qkv, normed, slots, m, qkv_out, threads, &plan, 0, l == 0 ? plan.lines : 0))) break;
        PHASE_END(PHASE_PRODUCTS, mark);
        rotate(q, cos, sin, m, heads, head_dim);
        rotate(k, cos, sin, m, kv_heads, head_dim);
        PHASE_END(PHASE_ROWS, mark);
        for (int64_t s = 0, r0 = 0; s < segments; r0 += rows[s], s++) {
            const int64_t ms = rows[s], start = starts[s];
            float *keys = caches[s * n_layers + l].keys, *values = caches[s * n_layers + l].values;
            const int64_t stride = caches[s * n_layers + l].head_stride;
            for (int64_t i = 0; i < ms; i++) /* [ms, heads, D] -> [heads, ms, D] as attention reads queries */
                for (int64_t h = 0; h < heads; h++)
                    memcpy(q_heads + r0 * qn + (h * ms + i) * head_dim, q + ((r0 + i) * heads + h) * head_dim,
                           4 * head_dim);
            for (int64_t h = 0; h < kv_heads; h++)
                for (int64_t i = 0; i < ms; i++) {
                    memcpy(keys + h * stride + (start + i) * head_dim, k + ((r0 + i) * kv_heads + h) * head_dim,
                           4 * head_dim);
                    memcpy(values + h * stride + (start + i) * head_dim, v + ((r0 + i) * kv_heads + h) * head_dim,
                           4 * head_dim);
                }
            seg_q[s] = q_heads + r0 * qn, seg_k[s] = keys, seg_v[s] = values, seg_out[s] = attended + r0 * qn;
            seg_stride[s] = stride, seg_nk[s] = start + ms;
            const kvb_cache *led = &caches[(shared && shared[s] ? lead[s] : s) * n_layers + l];
            lead_k[s] = led->keys, lead_v[s] = led->values, lead_stride[s] = led->head_stride;
        }
        /* every request's rows in one parallel call: one call per request was ~250 hand-offs a step of 8 */
        status = kvb_attention_segments(segments, (const float *const *)seg_q, (const float *const *)seg_k,
                                        (const float *const *)seg_v, seg_stride, rows, seg_nk, seg_out, heads,
                                        kv_heads, head_dim, scale, threads, (const float *const *)lead_k,
                                        (const float *const *)lead_v, lead_stride, shared);
        PHASE_END(PHASE_ATTENTION, mark);
        if (status) break;
        slots[0].block = slots[1].block = 0;
        /* the next layer's cached keys and values, asked for while this layer's o, gate, up and down products run
           (each its share by its weights' size) */
        plan.lines = 0;
        if (l + 1 < n_layers && m >= FETCH_FROM)
            list_cached(&plan, caches, n_layers, l + 1, segments, starts, shared, kv_heads, head_dim);
        const double o_work = (double)L->o.n * L->o.k, gate_up_work = (double)(L->gate.n + L->up.n) * L->gate.k;
        const double work = o_work + gate_up_work + (double)L->down.n * L->down.k;
        const int64_t after_o = (int64_t)(plan.lines * (o_work / work));
        const int64_t after_gate_up = (int64_t)(plan.lines * ((o_work + gate_up_work) / work));
        const kvb_weight *o = &L->o;
        if ((status = linears(1, &o, attended, slots, m, &normed, threads, &plan, 0, after_o))) break;
        PHASE_END(PHASE_PRODUCTS, mark);
        for (int64_t i = 0; i < m * hidden; i++) x[i] = x[i] + normed[i];
        rmsnorm_parallel(x, L->post_norm, m, hidden, eps, normed, threads);
        PHASE_END(PHASE_ROWS, mark);
        slots[0].block = slots[1].block = 0;
        const kvb_weight *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {gate, up};
        if ((status = linears(2, gate_up, normed, slots, m, gate_up_out, threads, &plan, after_o, after_gate_up)))
            break;
        PHASE_END(PHASE_PRODUCTS, mark);
        gating_parallel(gate, up, m, intermediate, mixed, threads);
        PHASE_END(PHASE_ROWS, mark);
        slots[0].block = slots[1].block = 0;
        const kvb_weight *down = &L->down;
        if ((status = linears(1, &down, mixed, slots, m, &normed, threads, &plan, after_gate_up, plan.lines))) break;
        PHASE_END(PHASE_PRODUCTS, mark);
        for (int64_t i = 0; i < m * hidden; i++) x[i] = x[i] + normed[i];
        PHASE_END(PHASE_ROWS, mark);
    }
    free(scratch);
    free(seg_q);
    free(seg_stride);
    free(plan.at);
    free(plan.bytes);
    return status;
}
