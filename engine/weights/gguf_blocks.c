/* GGUF weight blocks times activations, as the file holds them: no conversion at load, no second rounding.

   Activations are rounded per block: for the K-quants to int8, as llama.cpp rounds its own (one float scale
   d = max|x| / 127 per 256 and the codes' sum per 16: layout A256); for the 32-value types to int16 (a scale
   d = max|x| / 32767 per 32, and per 32 the codes' sum s and d * s rounded to float: layout A32, kvb_sum32). int8 per 32, llama.cpp's rounding for those types,
   moved the embedded model's answers (its Q4_1 file answered "What is the capital of France?" with "L'Etoile,
   la Marseillaise", as llama.cpp does; int16 answers "Paris", as float and bfloat16 activations do), and
   _mm256_madd_epi16 multiplies int16 about as fast as int8 goes. A weight block's products with an activation
   block are then summed exactly in integers, and the float sums over blocks run in an order that depends only on the row's
   length: an output is the same whatever number of rows are multiplied together and however the rows are split
   between threads (batch-invariant by construction).

   Weight rows are the file's blocks, row after row (row_bytes apart):
     Q4_0  18 bytes / 32:  fp16 d, 16 bytes of nibbles (values 0-15 low, 16-31 high); w = d * (q - 8)
     Q4_1  20 bytes / 32:  fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m
     Q8_0  34 bytes / 32:  fp16 d, 32 int8; w = d * q
     Q4_K  144 bytes / 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
                            128 bytes of nibbles (each 32 bytes: sub-block 2j low, 2j+1 high);
                            w = d * sc * q - dmin * m
     Q6_K  210 bytes / 256: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales (one per 16),
                            fp16 d; w = d * sc * (q - 32)
   The tiles' layout, kvb_repack and kvb_dequantize (gguf-py's values bit for bit) are in gguf_layout.c, the
   K-quants' tiles in ktiles.c, what they share in gguf_blocks.h. */

#include "gguf_blocks.h"

/* ---- activations ---- */

/* fmaxf for a running largest (never NaN) and a value: the value where larger, so a NaN value is passed over as
   fmaxf passes it over; unlike fmaxf, inlined and vectorised (gcc calls libm's fmaxf for each value) */
static inline float largest(float sofar, float value) { return value > sofar ? value : sofar; }

/* the largest |x[i]| (NaN passed over: maxps returns its second operand, the running lanes, when the value is
   NaN), 16 or 8 lanes at once (one value at a time was a chain of dependent maxima, a third of a batched step's
   rounding time); a maximum of the same values in any order, so the same bits on every path */
static inline float largest_abs(const float *x, int n) {
    float amax = 0.0f;
    int i = 0;
#if defined(__AVX512F__)
    __m512 lanes = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) lanes = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), lanes);
    float held[16];
    _mm512_storeu_ps(held, lanes);
    for (int j = 0; j < 16; j++) amax = largest(amax, held[j]);
#elif defined(__AVX2__)
    __m256 lanes = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)), lanes);
    float held[8];
    _mm256_storeu_ps(held, lanes);
    for (int j = 0; j < 8; j++) amax = largest(amax, held[j]);
#endif
    for (; i < n; i++) amax = largest(amax, fabsf(x[i]));
    return amax;
}

static void quantize_block(const float *x, int n, int8_t *q, float *d) {
    const float amax = largest_abs(x, n);
    const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)(int)nearbyintf(x[i] * inverse);
    *d = scale;
}

static void quantize_block16(const float *x, int n, int16_t *q, float *d) {
    const float amax = largest_abs(x, n);
    const float scale = amax / 32767.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int16_t)(int)nearbyintf(x[i] * inverse);
    *d = scale;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* quantize_block16 for 32 values and their kvb_sum32, in vectors: the same maximum (largest_abs's lanes), scale
   and products; the codes converted in the current rounding mode as nearbyintf does and narrowed by dropping the
   high bits as the cast to int16_t does (vpmovdw, not saturating), summed from those int16 values: the same bits.
   A batched step's 8 rows of 1536 values took ~7 us a product one value at a time (rounded on one thread, while
   the other waits), a few tenths of a millisecond a step. */
static inline void quantize32_int16(const float *x, int16_t *q, float *d, kvb_sum32 *at) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const __m512 lanes = _mm512_max_ps(_mm512_abs_ps(b), _mm512_max_ps(_mm512_abs_ps(a), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(lanes); /* no NaN in the lanes: the same maximum in any order */
    const float scale = amax / 32767.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    const __m512 by = _mm512_set1_ps(inverse);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, by)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, by));
    _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(qa));
    _mm256_storeu_si256((__m256i *)(q + 16), _mm512_cvtepi32_epi16(qb));
    const __m512i as16 = _mm512_add_epi32(_mm512_srai_epi32(_mm512_slli_epi32(qa, 16), 16),
                                          _mm512_srai_epi32(_mm512_slli_epi32(qb, 16), 16));
    const int32_t sum = _mm512_reduce_add_epi32(as16);
    *d = scale;
    at->sum = sum;
    at->scaled = scale * (float)sum;
}
#endif

typedef struct {
    const float *x;
    int64_t k;
    int block;
    int8_t *q;
    float *d;
    void *sums;
} quantize_job;

static void quantize_rows(void *ctx, int64_t first, int64_t end) {
    const quantize_job *j = ctx;
    const float *x = j->x;
    const int64_t k = j->k, nb = k / j->block;
    const int block = j->block;
    int8_t *q = j->q;
    float *d = j->d;
    void *sums = j->sums;
    for (int64_t r = first; r < end; r++) {
        for (int64_t b = 0; b < nb; b++) {
            if (block == 32) {
                int16_t *qb = (int16_t *)q + r * k + b * 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                quantize32_int16(x + r * k + b * 32, qb, d + r * nb + b, (kvb_sum32 *)sums + r * nb + b);
                continue;
#endif
                quantize_block16(x + r * k + b * 32, 32, qb, d + r * nb + b);
                int32_t sum = 0;
                for (int i = 0; i < 32; i++) sum += qb[i];
                kvb_sum32 *at = (kvb_sum32 *)sums + r * nb + b;
                at->sum = sum;
                at->scaled = d[r * nb + b] * (float)sum; /* |sum| <= 32 * 32767 < 2^24: exact as a float */
            } else {
                int8_t *qb = q + r * k + b * block;
                quantize_block(x + r * k + b * block, block, qb, d + r * nb + b);
                for (int g = 0; g < 16; g++) {
                    int16_t sum = 0;
                    for (int i = 0; i < 16; i++) sum += qb[16 * g + i];
                    ((int16_t *)sums)[(r * nb + b) * 16 + g] = sum;
                }
            }
        }
    }
}

/* x [rows, k] -> codes q [rows, k] (int16 for block = 32, int8 for 256); block = 32: scales d [rows, k / 32] and
   sums (kvb_sum32) [rows, k / 32]; block = 256:
   scales d [rows, k / 256] and code sums per 16 (int16) [rows, k / 16]. */
void kvb_quantize(const float *x, int64_t rows, int64_t k, int block, int8_t *q, float *d, void *sums, int threads) {
    quantize_job job = {x, k, block, q, d, sums};
    kvb_parallel(rows, threads, quantize_rows, &job);
}

int kvb_supports(int type) {
    dot_fn dots[4];
    return kvb_dots_for(type, dots);
}

int kvb_activation_block(int type) { return activation_block(type % KVB_TILED); } /* type: + KVB_TILED or not */

#define ROWS_PER_TASK 16 /* weight rows a task takes: one 16-row tile where the type has tiles */

typedef struct {
    dot_fn dots[4];
    tile_fn tiles[MAX_ROWS]; /* by rows taken at once, or all NULL */
    const uint8_t *w, *acts, *sum_bytes;
    const float *d;
    int64_t n, k, nb, row_bytes, row, per_block, m;
    float *y;
    int amx_type; /* a K-quant held as tiles on a CPU with AMX: 16 activation rows at a time go there */
    const struct fetch_list *fetch; /* memory to ask for while the tasks run, or NULL (kvb_matmul_many) */
    int64_t first_task;             /* this job's first task among the call's */
} matmul_job;

/* Memory a caller reads next, asked for into L2 while a product's tasks run (kvb_matmul_many): `count` ranges of
   bytes[r] bytes at at[r], task t of the call's `tasks` asking for its share of their cache lines from .. from +
   lines - 1, in order. Prefetches only: no result depends on them. */
typedef struct fetch_list {
    const char *const *at;
    const int64_t *bytes;
    int64_t count, from, lines, tasks; /* the lines asked for: from .. from + lines - 1 of the ranges' */
} fetch_list;

/* Inlined always: gcc sees no effect in a function that only prefetches, and drops its calls. */
static inline __attribute__((always_inline)) void fetch_share(const fetch_list *f, int64_t t) {
    int64_t from = f->from + f->lines * t / f->tasks;
    const int64_t to = f->from + f->lines * (t + 1) / f->tasks;
    for (int64_t r = 0, before = 0; r < f->count && from < to; r++) {
        const int64_t lines = (f->bytes[r] + 63) / 64;
        for (; from < to && from < before + lines; from++) __builtin_prefetch(f->at[r] + 64 * (from - before), 0, 2);
        before += lines;
    }
}

/* The order of a product's work, for many activation rows (a prefill): the task's weight rows a chunk of about
   CHUNK_BYTES at a time (they stay in L2 while every activation row passes), and within a chunk the activation
   rows ROW_BLOCK at a time (one tile's rows: for k up to ~3000 their codes stay in L1 across the chunk's tasks). A
   tile broadcasts an activation's four codes to every multiply-add and reads each weight byte once, so the
   activations are the stream to keep close. Before, the rows went 64 at a time through all of a thread's tasks:
   the weights were read again from L3 or memory for every 64 rows, and a tile's activations came from L2. A prefill
   of 1024 tokens, 2-vCPU EPYC (Zen 4), the two orders alternating in one process: the 1.5B shape 5.80 s against
   6.11 s, the 7B shape (512 tokens) 13.6 s against 14.3 s. Rows 8 at a time through all tasks (no chunks) gave
   the 1.5B shape 0.89-0.97x but the 7B shape 1.0x: its weights do not fit in L3 and came from memory every 8
   rows. AMX takes 16 rows at a call, so there the rows stay 64 at a time (AMX_ROWS in ktiles.c). */
#define CHUNK_BYTES (256 * 1024)
#define ROW_BLOCK 8
#define AMX_BLOCK 64

/* task t's outputs for activation rows [from, upto) */
static inline void task_rows(const matmul_job *j, int64_t t, int64_t from, int64_t upto) {
    const int64_t n = j->n, nb = j->nb, row = j->row, per_block = j->per_block;
    const int64_t first = t * ROWS_PER_TASK, last = first + ROWS_PER_TASK < n ? first + ROWS_PER_TASK : n;
    int64_t i = from;
    if (j->amx_type && upto - i >= 16) { /* the same outputs as the tiles below give (ktiles.c) */
        const int64_t whole = (upto - i) / 16 * 16;
        if (kvb_ktile_amx(j->amx_type, j->w + first * j->row_bytes, nb, (const int8_t *)(j->acts + i * row),
                          j->d + i * nb, (const int32_t *)(j->sum_bytes + i * nb * per_block), j->k, whole,
                          j->y + i * n + first, n) == 0)
            i += whole;
    }
    if (j->tiles[0]) /* tiled: the task is one tile; as many rows at once as it has a kernel for, up to 8 */
        while (i < upto) {
            int rows = upto - i < MAX_ROWS ? (int)(upto - i) : MAX_ROWS;
            while (!j->tiles[rows - 1]) rows = rows > 4 ? 4 : rows - 1; /* 7 without its kernel: 4 + 3 */
            j->tiles[rows - 1](j->w + first * j->row_bytes, nb, (const int8_t *)(j->acts + i * row), j->d + i * nb,
                               (const int32_t *)(j->sum_bytes + i * nb * per_block), j->k, j->y + i * n + first, n);
            i += rows;
        }
    for (int size = 3; size >= 0; size--) /* weight rows one at a time: activation rows 8, then 4, 2, 1 */
        for (; i + (1 << size) <= upto; i += 1 << size)
            for (int64_t r = first; r < last; r++)
                j->dots[size](j->w + r * j->row_bytes, nb, (const int8_t *)(j->acts + i * row), j->d + i * nb,
                              j->sum_bytes + i * nb * per_block, j->k, j->y + i * n + r, n);
}

static void matmul_tasks(void *ctx, int64_t first_task, int64_t end_task) {
    const matmul_job *j = ctx;
    const int64_t block = j->amx_type ? AMX_BLOCK : ROW_BLOCK, task_bytes = ROWS_PER_TASK * j->row_bytes;
    const int64_t chunk = task_bytes > 0 && CHUNK_BYTES > task_bytes ? CHUNK_BYTES / task_bytes : 1; /* tasks */
    for (int64_t c0 = first_task; c0 < end_task; c0 += chunk) {
        const int64_t c1 = c0 + chunk < end_task ? c0 + chunk : end_task;
        for (int64_t from = 0; from < j->m; from += block)
            for (int64_t t = c0; t < c1; t++) {
                task_rows(j, t, from, from + block < j->m ? from + block : j->m);
                if (j->fetch && from == 0) fetch_share(j->fetch, j->first_task + t);
            }
    }
}

/* The job of y[m, n] = sum_k W[n, k] x[m, k] (see kvb_matmul); 0, or -1 for a type or layout this build does not
   multiply. */
static int matmul_job_for(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const int8_t *q,
                          const float *d, const void *sums, int64_t m, float *y, matmul_job *job) {
    const matmul_job empty = {{0}, {0}, w, (const uint8_t *)q, (const uint8_t *)sums, d, n, k, 0, row_bytes, 0, 0, m,
                              y, 0, NULL, 0};
    *job = empty;
    const int tiled = type >= KVB_TILED;
    type = tiled ? type - KVB_TILED : type;
    if (!kvb_dots_for(type, job->dots) || (tiled && (!kvb_tiles_for(type, job->tiles) || n % 16))) return -1;
    const int block = activation_block(type);
    job->nb = k / block;
    job->row = block == 32 ? 2 * k : k;            /* bytes of one activation row */
    job->per_block = block == 32 ? (int64_t)sizeof(kvb_sum32) : 32; /* bytes of sums per activation block */
    job->amx_type = tiled && block == 256 && m >= 16 && kvb_amx() ? type : 0;
    return 0;
}

/* y[m, n] = sum_k W[n, k] x[m, k], x as kvb_quantize made it for this type's activation block (q, d, sums); type
   + KVB_TILED: W held as tiles (kvb_repack). Returns 0, or -1 for a type or layout this build does not multiply.
   Output rows are split between threads in tasks of ROWS_PER_TASK weight rows; a task takes the activation rows
   up to eight at a time (a tile: any number from 1 to 8 where the type has a kernel for it; weight rows one at a
   time: 8, then 4, 2 and 1); a weight block is decoded once for the rows taken together, and each row's sums are
   the same however they are taken. */
int kvb_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const int8_t *q, const float *d,
               const void *sums, int64_t m, float *y, int threads) {
    matmul_job job;
    if (matmul_job_for(type, w, n, k, row_bytes, q, d, sums, m, y, &job)) return -1;
    kvb_parallel((n + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads, matmul_tasks, &job);
    return 0;
}

#define MAX_MANY 4
/* kvb_matmul for up to MAX_MANY weights of the same input (q, k and v; gate and up) in one parallel call: weight
   j (type types[j], n[j] x k, row_bytes[j] a row, at w[j]) into y[j] [m, n[j]], every type's activations rounded
   to the same block (q, d, sums). Each output is the one kvb_matmul gives. While the tasks run they ask for the
   cache lines fetch_from .. fetch_to - 1 of the fetch_count ranges (fetch_bytes[r] bytes at fetch_at[r]; none
   where fetch_count is 0), each task its share in order: memory the caller reads next (engine/block_forward.c:
   a batched step's cached keys and values, read by the next layer's attention), brought in while these products
   keep the cores busy. Returns 0, or -1 (nothing computed) for a type or layout this build does not multiply, or
   more than MAX_MANY weights. */
int kvb_matmul_many(int count, const int *types, const uint8_t *const *w, const int64_t *n, int64_t k,
                    const int64_t *row_bytes, const int8_t *q, const float *d, const void *sums, int64_t m,
                    float *const *y, int threads, const char *const *fetch_at, const int64_t *fetch_bytes,
                    int64_t fetch_count, int64_t fetch_from, int64_t fetch_to) {
    matmul_job jobs[MAX_MANY];
    int64_t first[MAX_MANY + 1] = {0}; /* weight j's tasks are first[j] .. first[j + 1] - 1 */
    if (count < 1 || count > MAX_MANY) return -1;
    for (int j = 0; j < count; j++) {
        if (matmul_job_for(types[j], w[j], n[j], k, row_bytes[j], q, d, sums, m, y[j], &jobs[j])) return -1;
        first[j + 1] = first[j] + (n[j] + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
    }
    const fetch_list fetch = {fetch_at, fetch_bytes, fetch_count, fetch_from, fetch_to - fetch_from, first[count]};
    for (int j = 0; j < count && fetch_count > 0 && fetch.lines > 0 && fetch.tasks > 0; j++)
        jobs[j].fetch = &fetch, jobs[j].first_task = first[j];
    kvb_parallel_segments(count, first, matmul_tasks, jobs, sizeof(matmul_job), threads);
    return 0;
}

/* y[m, n] = x[m, k] W[n, k]^T: the activations rounded as kvb_quantize rounds them, into scratch memory of this
   call, then kvb_matmul. Returns 0, -1 for a type this file does not multiply, -2 when the scratch memory cannot
   be had. */
int kvb_linear(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const float *x, int64_t m,
               float *y, int threads) {
    if (!kvb_supports(type % KVB_TILED)) return -1;
    const int block = activation_block(type % KVB_TILED);
    const int64_t nb = k / block, sum_bytes = block == 32 ? m * nb * (int64_t)sizeof(kvb_sum32) : m * (k / 16) * 2;
    const int64_t act_bytes = block == 32 ? 2 * m * k : m * k;
    uint8_t *scratch = malloc((size_t)(act_bytes + m * nb * 4 + sum_bytes + 64));
    if (!scratch) return -2;
    int8_t *q = (int8_t *)scratch;
    float *d = (float *)(scratch + ((act_bytes + 31) / 32) * 32);
    void *sums = (uint8_t *)d + m * nb * 4;
    kvb_quantize(x, m, k, block, q, d, sums, threads);
    const int status = kvb_matmul(type, w, n, k, row_bytes, q, d, sums, m, y, threads);
    free(scratch);
    return status;
}

/* 1 when this build multiplies weights of `type` held as tiles */
int kvb_tiles(int type) {
    tile_fn tiles[MAX_ROWS];
    return kvb_tiles_for(type, tiles);
}

