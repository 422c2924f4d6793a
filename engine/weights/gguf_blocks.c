/* GGUF weight blocks times activations, as the file holds them: no conversion at load, no second rounding.

   Activations are rounded per block: for the K-quants to int8, as llama.cpp rounds its own (one float scale
   d = max|x| / 127 per 256 and the codes' sum per 16: layout A256); for the 32-value types to int16 (a scale
   d = max|x| / 32767 and the codes' sum per 32: layout A32). int8 per 32, llama.cpp's rounding for those types,
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
   kvb_dequantize forms each value with gguf-py's float32 products, so a row read back equals gguf's dequantized
   row bit for bit (built with -ffp-contract=off: no fused multiply-adds that would round differently). */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define KVB_AVX2 1
#endif

enum { KVB_Q4_0 = 2, KVB_Q4_1 = 3, KVB_Q8_0 = 8, KVB_Q4_K = 12, KVB_Q6_K = 14 };

/* engine/weights/thread_pool.c: fn(ctx, begin, end) over [0, n) in `threads` contiguous parts, on the process's one pool */
typedef void (*kvb_task)(void *ctx, int64_t begin, int64_t end);
void kvb_parallel(int64_t n, int threads, kvb_task fn, void *ctx);

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0) {
        const float f = ldexpf((float)man, -24); /* zero or subnormal */
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112u) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline void q4k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- activations ---- */

static void quantize_block(const float *x, int n, int8_t *q, float *d) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)(int)nearbyintf(x[i] * inverse);
    *d = scale;
}

static void quantize_block16(const float *x, int n, int16_t *q, float *d) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = amax / 32767.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int16_t)(int)nearbyintf(x[i] * inverse);
    *d = scale;
}

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
                quantize_block16(x + r * k + b * 32, 32, qb, d + r * nb + b);
                int32_t sum = 0;
                for (int i = 0; i < 32; i++) sum += qb[i];
                ((int32_t *)sums)[r * nb + b] = sum;
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

/* x [rows, k] -> codes q [rows, k] (int16 for block = 32, int8 for 256); block = 32: scales d and code sums s
   (int32) [rows, k / 32]; block = 256:
   scales d [rows, k / 256] and code sums per 16 (int16) [rows, k / 16]. */
void kvb_quantize(const float *x, int64_t rows, int64_t k, int block, int8_t *q, float *d, void *sums, int threads) {
    quantize_job job = {x, k, block, q, d, sums};
    kvb_parallel(rows, threads, quantize_rows, &job);
}

static inline int block_bytes(int type) {
    return type == KVB_Q4_0 ? 18 : type == KVB_Q4_1 ? 20 : type == KVB_Q8_0 ? 34 : type == KVB_Q4_K ? 144 : 210;
}
static inline int activation_block(int type) { return type == KVB_Q4_K || type == KVB_Q6_K ? 256 : 32; }

/* The float steps of a 32-value block, the same on every path (the vector ones lane by lane): the block's exact
   integer dot `sum` of weight codes and activation codes (Q4_0: minus 8 times the activations' code sum), times
   the weight's scale and the activations', added to the output in one rounding (fmaf), blocks in order; Q4_1's
   offsets (the weight's m times the activations' sum) in their own sum. Output = acc + offsets. Each output is
   thus the same whatever number of rows and columns are computed together, on whichever path of this build. */
static inline __attribute__((always_inline)) void block32_float(int type, int32_t sum, float dw, float mw, float dr,
                                                                  int32_t sr, float *acc, float *offsets) {
    if (type == KVB_Q4_0) sum -= 8 * sr;
    *acc = fmaf((float)sum, dw * dr, *acc);
    if (type == KVB_Q4_1) *offsets = *offsets + (mw * dr) * (float)sr;
}

/* The float steps of a 256-value block (Q4_K, Q6_K), the same on every path: `sum`, the exact integer sum of the
   block's sub-block dots times their scales, and `terms`, the exact sum of the activations' sums per 16 times
   what multiplies them (Q4_K: the sub-blocks' mins; Q6_K: its scales, the codes' offset 32); each added to the
   output's sum in one rounding (fmaf), blocks in order. Output = acc - mins. */
static inline __attribute__((always_inline)) void block256_float(int type, int32_t sum, int32_t terms, float dw,
                                                                   float dmin, float dr, float *acc, float *mins) {
    if (type == KVB_Q6_K) sum -= 32 * terms;
    *acc = fmaf((float)sum, dw * dr, *acc);
    if (type == KVB_Q4_K) *mins = fmaf((float)terms, dmin * dr, *mins);
}

/* ---- 16-row tiles: the layout the vector kernels read (kvb_repack) ----
   A weight whose row count is a multiple of 16, of a 32-value type, is held as tiles of 16 rows: tile t, block b is
   the 16 rows' block b side by side, 16 * block_bytes bytes (the file's scales and codes, in another order):
     16 fp16 d (row c at 2c); Q4_1: 16 fp16 m; then the codes, pair by pair (pair p: values 2p and 2p + 1):
     Q8_0  pair p at 32 p: row c's two int8 codes at 2c, 2c + 1
     Q4_*  four pairs in each 64 bytes (pairs 4g .. 4g + 3 at 64 g): pair 4g + e (e = 0, 1) in the low nibbles of
           bytes 32 e + 2c, 32 e + 2c + 1; pair 4g + 2 + e in their high nibbles.
   So a pair of all 16 rows widens to one vector of 16 int32 lanes, each two int16 codes of one row. */
#define KVB_TILED 256 /* added to a type: its weight is held as tiles */

static inline int tile_codes_start(int type) { return type == KVB_Q4_1 ? 64 : 32; }

/* where code i of row c lies in a tiled block's codes: the byte, and in a Q4 type which nibble (*high) */
static inline int tile_code_at(int type, int c, int i, int *high) {
    const int p = i / 2, j = i % 2;
    if (type == KVB_Q8_0) {
        *high = 0;
        return 32 * p + 2 * c + j;
    }
    *high = p % 4 >= 2;
    return 64 * (p / 4) + 32 * (p % 2) + 2 * c + j;
}

/* code i of a file block of a 32-value type (Q4: 0-15, Q8_0: -128-127) */
static inline int file_code(int type, const uint8_t *blk, int i) {
    if (type == KVB_Q8_0) return (int8_t)blk[2 + i];
    const uint8_t byte = blk[(type == KVB_Q4_1 ? 4 : 2) + i % 16];
    return i < 16 ? byte & 0x0f : byte >> 4;
}

/* the tiled block of 16 rows' blocks (rows[c]: row c's file block) */
static void tile_block(int type, const uint8_t *const rows[16], uint8_t *t) {
    const int start = tile_codes_start(type);
    memset(t, 0, (size_t)(16 * block_bytes(type)));
    for (int c = 0; c < 16; c++) {
        memcpy(t + 2 * c, rows[c], 2);
        if (type == KVB_Q4_1) memcpy(t + 32 + 2 * c, rows[c] + 2, 2);
        for (int i = 0; i < 32; i++) {
            int high;
            const int at = start + tile_code_at(type, c, i, &high), code = file_code(type, rows[c], i);
            t[at] = (uint8_t)(type == KVB_Q8_0 ? code : t[at] | (high ? code << 4 : code));
        }
    }
}

/* row c's file block back from a tiled block, into out[34] (the largest 32-value block) */
static void untile_block(int type, const uint8_t *t, int c, uint8_t out[34]) {
    const int start = tile_codes_start(type), codes = type == KVB_Q4_1 ? 4 : 2;
    memset(out, 0, 34);
    memcpy(out, t + 2 * c, 2);
    if (type == KVB_Q4_1) memcpy(out + 2, t + 32 + 2 * c, 2);
    for (int i = 0; i < 32; i++) {
        int high;
        const uint8_t byte = t[start + tile_code_at(type, c, i, &high)];
        if (type == KVB_Q8_0)
            out[2 + i] = byte;
        else
            out[codes + i % 16] |= (uint8_t)(((high ? byte >> 4 : byte & 0x0f)) << (i < 16 ? 0 : 4));
    }
}

/* ---- dot products: out[r] = (weight row w) . (activation row r), for R activation rows at once (a weight
   block is decoded once for all R); each row's sums are the same whatever R is. ---- */

#ifdef KVB_AVX2
static inline __m256i dot_u8s8(__m256i u, __m256i v) { /* 8 int32, each the sum of 4 neighbouring products */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, v);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

static inline __m256i madd_add(__m256i sum, __m256i a, __m256i b) { /* sum + pairwise int16 products */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(sum, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(sum, a, b);
#else
    return _mm256_add_epi32(sum, _mm256_madd_epi16(a, b));
#endif
}

static inline int32_t hsum_i32(__m256i v) { /* exact: integers */
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(h);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* How far ahead of the block being multiplied the weight stream is prefetched. A decode step reads each weight
   once, from memory: without it every block waited on its scale's load (the embedded Q4_1 model decoded at 47
   tok/s on a 2-core Xeon, 102-105 with it; 2048-8192 bytes measured alike, 256 barely helped). */
#define PREFETCH_BYTES 4096

#define MAX_ROWS 8 /* activation rows multiplied at once */

/* Q4_0, Q4_1, Q8_0 against A32 (int16 activations), one weight row at a time (weights whose row count is not a
   multiple of 16, and the portable build's twin below): a block's exact integer dot (the codes widened to int16,
   _mm256_madd_epi16, the eight lanes summed in integers), then the float steps of block32_float. */
static inline __attribute__((always_inline)) void dots32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const int32_t *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = block_bytes(type);
    const __m128i low = _mm_set1_epi8(0x0f);
    float acc[MAX_ROWS], offsets[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = offsets[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        if ((b & 1) == 0) _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
        __m256i first, second; /* the block's 32 codes as int16: values 0-15, then 16-31 */
        if (type == KVB_Q8_0) {
            first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 2)));
            second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 18)));
        } else {
            const __m128i t = _mm_loadu_si128((const __m128i *)(w + (type == KVB_Q4_0 ? 2 : 4)));
            first = _mm256_cvtepu8_epi16(_mm_and_si128(t, low));
            second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), low));
        }
        const float dw = half_at(w), mw = type == KVB_Q4_1 ? half_at(w + 2) : 0.0f;
        for (int r = 0; r < R; r++) {
            const int64_t at = r * nb + b;
            const int16_t *x = xs + r * k + b * 32;
            const __m256i p = madd_add(_mm256_madd_epi16(first, load32(x)), second, load32(x + 16));
            block32_float(type, hsum_i32(p), dw, mw, d[at], s[at], &acc[r], &offsets[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * stride] = acc[r] + offsets[r];
}

#define KVB_TILES 1 /* 16 weight rows at a time, one output per vector lane */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* Q4_0, Q4_1, Q8_0 against A32 for one 16-row tile (w: its first block) and R activation rows: per block each pair
   of the 16 rows widens to one vector (lane c: row c), multiplied with the activations' pair p
   (_mm512_dpwssd_epi32): 16 exact integer dots at once; then block32_float's steps for the 16 outputs, lane by
   lane. A tile's block is widened once for the R rows. out[r * stride + c]. */
static inline __attribute__((always_inline)) void tile32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const int32_t *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = 16 * block_bytes(type), start = tile_codes_start(type);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MAX_ROWS], offsets[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = offsets[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), _MM_HINT_T0);
        /* pair by pair, each widened pair times every row's: R integer sums in registers, one vector of codes
           live at a time (integer sums: the order does not change them) */
        __m512i dot[MAX_ROWS];
        for (int r = 0; r < R; r++) dot[r] = _mm512_setzero_si512();
        const int32_t *x0 = (const int32_t *)(xs + b * 32); /* row r's pairs: x0 + r * k / 2 */
        if (type == KVB_Q8_0) {
            for (int p = 0; p < 16; p++) {
                const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + start + 32 * p)));
                for (int r = 0; r < R; r++)
                    dot[r] = _mm512_dpwssd_epi32(dot[r], v, _mm512_set1_epi32(x0[r * k / 2 + p]));
            }
        } else {
            for (int g = 0; g < 4; g++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(w + start + 64 * g));
                const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                const __m512i v[4] = {_mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)),
                                      _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                                      _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)),
                                      _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
                for (int e = 0; e < 4; e++)
                    for (int r = 0; r < R; r++)
                        dot[r] = _mm512_dpwssd_epi32(dot[r], v[e], _mm512_set1_epi32(x0[r * k / 2 + 4 * g + e]));
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        const __m512 mw = type == KVB_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)))
                                           : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const int64_t at = r * nb + b;
            __m512i sum = dot[r];
            if (type == KVB_Q4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * s[at]));
            const __m512 dr = _mm512_set1_ps(d[at]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, dr), acc[r]);
            if (type == KVB_Q4_1)
                offsets[r] = _mm512_add_ps(offsets[r], _mm512_mul_ps(_mm512_mul_ps(mw, dr),
                                                                     _mm512_set1_ps((float)s[at])));
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * stride, _mm512_add_ps(acc[r], offsets[r]));
}
#else
/* The same tiles on AVX2: each half of a tile (rows 0-7, 8-15) one 8-lane vector; _mm256_madd_epi16 (or VNNI)
   products summed in integers per lane, then block32_float's steps lane by lane: the same bits as AVX-512's. */
static inline __attribute__((always_inline)) void tile32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const int32_t *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = 16 * block_bytes(type), start = tile_codes_start(type);
    const __m128i low = _mm_set1_epi8(0x0f);
    __m256 acc[MAX_ROWS][2], offsets[MAX_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) acc[r][h] = offsets[r][h] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256i dot[MAX_ROWS]; /* as in the AVX-512 tiles: pair by pair, R integer sums in registers */
            for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
            const int32_t *x0 = (const int32_t *)(xs + b * 32); /* row r's pairs: x0 + r * k / 2 */
            if (type == KVB_Q8_0) {
                for (int p = 0; p < 16; p++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(w + start + 32 * p + 16 * h));
                    const __m256i v = _mm256_cvtepi8_epi16(raw);
                    for (int r = 0; r < R; r++) dot[r] = madd_add(dot[r], v, _mm256_set1_epi32(x0[r * k / 2 + p]));
                }
            } else {
                for (int g = 0; g < 4; g++)
                    for (int e = 0; e < 2; e++) {
                        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + start + 64 * g + 32 * e + 16 * h));
                        const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
                        const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
                        for (int r = 0; r < R; r++) {
                            dot[r] = madd_add(dot[r], lo, _mm256_set1_epi32(x0[r * k / 2 + 4 * g + e]));
                            dot[r] = madd_add(dot[r], hi, _mm256_set1_epi32(x0[r * k / 2 + 4 * g + 2 + e]));
                        }
                    }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16 * h)));
            const __m256 mw = type == KVB_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 32 + 16 * h)))
                                               : _mm256_setzero_ps();
            for (int r = 0; r < R; r++) {
                const int64_t at = r * nb + b;
                __m256i sum = dot[r];
                if (type == KVB_Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * s[at]));
                const __m256 dr = _mm256_set1_ps(d[at]);
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, dr), acc[r][h]);
                if (type == KVB_Q4_1)
                    offsets[r][h] = _mm256_add_ps(offsets[r][h], _mm256_mul_ps(_mm256_mul_ps(mw, dr),
                                                                               _mm256_set1_ps((float)s[at])));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * stride + 8 * h, _mm256_add_ps(acc[r][h], offsets[r][h]));
}
#endif

/* Q4_K, Q6_K against A256: a block's products times their integer sub-scales summed in int32 over the whole
   block, then one float multiply-add for the block (and one for Q4_K's mins, from the activations' sums per 16). */
static inline __attribute__((always_inline)) void dots256(int type, int R, const uint8_t *w, int64_t nb,
                                                            const int8_t *q, const float *d, const int16_t *bsums,
                                                            int64_t k, float *out, int64_t stride) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const int bytes = block_bytes(type);
    float acc[MAX_ROWS], mins[MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += bytes) {
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), _MM_HINT_T0);
        __m256i codes[8], scale16[8], terms16; /* terms16: what multiplies the activations' sums per 16 */
        float dw, dmin = 0.0f;
        int16_t sc16[16] __attribute__((aligned(32)));
        if (type == KVB_Q4_K) {
            dw = half_at(w), dmin = half_at(w + 2);
            uint32_t u[3], packed[4]; /* the 12 bytes of 6-bit scales and mins -> 8 scales, then 8 mins */
            memcpy(u, w + 4, 12);
            packed[0] = u[0] & 0x3f3f3f3fu;
            packed[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
            packed[2] = u[1] & 0x3f3f3f3fu;
            packed[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
            const __m128i bytes = _mm_loadu_si128((const __m128i *)packed);
            _mm256_store_si256((__m256i *)sc16, _mm256_cvtepu8_epi16(bytes));
            terms16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(bytes, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12,
                                                                                  13, 13, 14, 14, 15, 15)));
            for (int j = 0; j < 4; j++) {
                const __m256i raw = load32(w + 16 + 32 * j);
                codes[2 * j] = _mm256_and_si256(raw, low);
                codes[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
            }
            for (int j = 0; j < 8; j++) scale16[j] = _mm256_set1_epi16(sc16[j]);
        } else {
            dw = half_at(w + 208);
            terms16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 192))); /* times 32: the offset */
            _mm256_store_si256((__m256i *)sc16, terms16);
            const __m256i pairs = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3,
                                                   2, 3, 2, 3, 2, 3, 2, 3);
            for (int n = 0; n < 2; n++) {
                const __m256i l0 = load32(w + 64 * n), l1 = load32(w + 64 * n + 32), h = load32(w + 128 + 32 * n);
                for (int c = 0; c < 4; c++) {
                    const int j = 4 * n + c;
                    const __m256i l = (c & 1) ? l1 : l0;
                    const __m256i nibble = _mm256_and_si256(c >= 2 ? _mm256_srli_epi16(l, 4) : l, low);
                    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), two);
                    codes[j] = _mm256_or_si256(nibble, _mm256_slli_epi16(high, 4));
                    int32_t pair;
                    memcpy(&pair, sc16 + 2 * j, 4);
                    scale16[j] = _mm256_shuffle_epi8(_mm256_set1_epi32(pair), pairs);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const int64_t at = r * nb + b;
            const int8_t *x = q + r * k + b * 256;
            /* two partial sums, so that the eight multiply-adds form two chains of four, not one of eight (each
               waits on the last: ~5 cycles apiece); integer sums, exact in any order */
            __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
            for (int j = 0; j < 8; j += 2) {
                even = madd_add(even, _mm256_maddubs_epi16(codes[j], load32(x + 32 * j)), scale16[j]);
                odd = madd_add(odd, _mm256_maddubs_epi16(codes[j + 1], load32(x + 32 * (j + 1))), scale16[j + 1]);
            }
            const __m256i sums16 = _mm256_madd_epi16(terms16, load32(bsums + at * 16));
            block256_float(type, hsum_i32(_mm256_add_epi32(even, odd)), hsum_i32(sums16), dw, dmin, d[at], &acc[r],
                           &mins[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * stride] = acc[r] - mins[r];
}

#else /* portable C: the same integer sums, the float sums in block order */

static inline __attribute__((always_inline)) void dots32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const int32_t *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int bytes = block_bytes(type);
    for (int r = 0; r < R; r++) {
        float acc = 0.0f, offsets = 0.0f;
        const uint8_t *blk = w;
        for (int64_t b = 0; b < nb; b++, blk += bytes) {
            const int64_t at = r * nb + b;
            const int16_t *x = (const int16_t *)q + r * k + b * 32;
            int32_t sum = 0;
            if (type == KVB_Q8_0) {
                for (int i = 0; i < 32; i++) sum += (int32_t)(int8_t)blk[2 + i] * x[i];
            } else {
                const uint8_t *nib = blk + (type == KVB_Q4_0 ? 2 : 4);
                for (int i = 0; i < 16; i++) sum += (nib[i] & 0x0f) * x[i] + (nib[i] >> 4) * x[16 + i];
            }
            block32_float(type, sum, half_at(blk), type == KVB_Q4_1 ? half_at(blk + 2) : 0.0f, d[at], s[at], &acc,
                          &offsets);
        }
        out[r * stride] = acc + offsets;
    }
}

static inline __attribute__((always_inline)) void dots256(int type, int R, const uint8_t *w, int64_t nb,
                                                            const int8_t *q, const float *d, const int16_t *bsums,
                                                            int64_t k, float *out, int64_t stride) {
    const int bytes = block_bytes(type);
    for (int r = 0; r < R; r++) {
        float acc = 0.0f, mins = 0.0f;
        const uint8_t *blk = w;
        for (int64_t b = 0; b < nb; b++, blk += bytes) {
            const int64_t at = r * nb + b;
            const int8_t *x = q + r * k + b * 256;
            const int16_t *bs = bsums + at * 16;
            int32_t sum = 0, terms = 0;
            if (type == KVB_Q4_K) {
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    q4k_scale_min(blk + 4, j, &sc, &m);
                    const uint8_t *raw = blk + 16 + 32 * (j / 2);
                    int32_t part = 0;
                    for (int i = 0; i < 32; i++) part += ((j & 1) ? raw[i] >> 4 : raw[i] & 0x0f) * x[32 * j + i];
                    sum += part * sc;
                    terms += m * (bs[2 * j] + bs[2 * j + 1]);
                }
                block256_float(type, sum, terms, half_at(blk), half_at(blk + 2), d[at], &acc, &mins);
            } else {
                const int8_t *sc = (const int8_t *)(blk + 192);
                for (int n = 0; n < 2; n++) {
                    const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
                    for (int c = 0; c < 4; c++) {
                        const int j = 4 * n + c;
                        for (int half = 0; half < 2; half++) {
                            int32_t part = 0;
                            for (int l = 16 * half; l < 16 * half + 16; l++) {
                                const int code = ((((c & 1) ? ql[l + 32] : ql[l]) >> (c >= 2 ? 4 : 0)) & 0x0f) |
                                                 (((qh[l] >> (2 * c)) & 3) << 4);
                                part += code * x[32 * j + l];
                            }
                            sum += part * sc[2 * j + half];
                        }
                    }
                }
                for (int g = 0; g < 16; g++) terms += sc[g] * bs[g];
                block256_float(type, sum, terms, half_at(blk + 208), 0.0f, d[at], &acc, &mins);
            }
        }
        out[r * stride] = acc - mins;
    }
}
#endif

typedef void (*dot_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const void *, int64_t, float *,
                       int64_t);

#define DOTS(NAME, KIND, TYPE, SUMS)                                                                                \
    static void NAME##_1(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const void *s, int64_t k, \
                         float *out, int64_t stride) {                                                            \
        KIND(TYPE, 1, w, nb, q, d, (const SUMS *)s, k, out, stride);                                              \
    }                                                                                                            \
    static void NAME##_2(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const void *s, int64_t k, \
                         float *out, int64_t stride) {                                                            \
        KIND(TYPE, 2, w, nb, q, d, (const SUMS *)s, k, out, stride);                                              \
    }                                                                                                            \
    static void NAME##_4(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const void *s, int64_t k, \
                         float *out, int64_t stride) {                                                            \
        KIND(TYPE, 4, w, nb, q, d, (const SUMS *)s, k, out, stride);                                              \
    }                                                                                                            \
    static void NAME##_8(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const void *s, int64_t k, \
                         float *out, int64_t stride) {                                                            \
        KIND(TYPE, 8, w, nb, q, d, (const SUMS *)s, k, out, stride);                                              \
    }
DOTS(dot_q4_0, dots32, KVB_Q4_0, int32_t)
DOTS(dot_q4_1, dots32, KVB_Q4_1, int32_t)
DOTS(dot_q8_0, dots32, KVB_Q8_0, int32_t)
DOTS(dot_q4_k, dots256, KVB_Q4_K, int16_t)
DOTS(dot_q6_k, dots256, KVB_Q6_K, int16_t)

typedef void (*tile_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const int32_t *, int64_t, float *,
                        int64_t);

#ifdef KVB_TILES
#define TILES(NAME, TYPE, R)                                                                                        \
    static void NAME##_##R(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *s,         \
                           int64_t k, float *out, int64_t stride) {                                               \
        tile32(TYPE, R, w, nb, q, d, s, k, out, stride);                                                          \
    }
#define ALL_TILES(NAME, TYPE) TILES(NAME, TYPE, 1) TILES(NAME, TYPE, 2) TILES(NAME, TYPE, 4) TILES(NAME, TYPE, 8)
ALL_TILES(tile_q4_0, KVB_Q4_0)
ALL_TILES(tile_q4_1, KVB_Q4_1)
ALL_TILES(tile_q8_0, KVB_Q8_0)
#endif

/* Q4_K and Q6_K as 16-row tiles (ktiles.c), where the CPU has AVX-512 VNNI: their layout and kernels */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVB_KTILES 1
#define KVB_KTILE_DECL(NAME, R) \
    void NAME##_##R(const uint8_t *, int64_t, const int8_t *, const float *, const int32_t *, int64_t, float *, int64_t);
#define KVB_KTILE_DECLS(NAME) KVB_KTILE_DECL(NAME, 1) KVB_KTILE_DECL(NAME, 2) KVB_KTILE_DECL(NAME, 4) KVB_KTILE_DECL(NAME, 8)
KVB_KTILE_DECLS(kvb_q4k_tile)
KVB_KTILE_DECLS(kvb_q6k_tile)
#endif
void kvb_ktile(int type, const uint8_t *const rows[16], uint8_t *tile);
void kvb_kuntile(int type, const uint8_t *tile, int c, uint8_t *block);

/* the 16-row tiles for 1, 2, 4 and 8 activation rows (tiles[0..3]), or 0 where this build has none for the type */
static int tiles_for(int type, tile_fn tiles[4]) {
#define KVB_TILE_SET(NAME) tiles[0] = NAME##_1, tiles[1] = NAME##_2, tiles[2] = NAME##_4, tiles[3] = NAME##_8
#ifdef KVB_KTILES
    if (type == KVB_Q4_K || type == KVB_Q6_K) {
        if (type == KVB_Q4_K)
            KVB_TILE_SET(kvb_q4k_tile);
        else
            KVB_TILE_SET(kvb_q6k_tile);
        return 1;
    }
#endif
#ifdef KVB_TILES
    switch (type) {
    case KVB_Q4_0: KVB_TILE_SET(tile_q4_0); return 1;
    case KVB_Q4_1: KVB_TILE_SET(tile_q4_1); return 1;
    case KVB_Q8_0: KVB_TILE_SET(tile_q8_0); return 1;
    default: break;
    }
#undef KVB_TILE_SET
#endif
    (void)type, (void)tiles;
    return 0;
}

/* the dot for 1, 2, 4 and 8 activation rows at once (dots[0..3]) */
static int dots_for(int type, dot_fn dots[4]) {
#define KVB_DOTS(NAME) dots[0] = NAME##_1, dots[1] = NAME##_2, dots[2] = NAME##_4, dots[3] = NAME##_8
    switch (type) {
    case KVB_Q4_0: KVB_DOTS(dot_q4_0); return 1;
    case KVB_Q4_1: KVB_DOTS(dot_q4_1); return 1;
    case KVB_Q8_0: KVB_DOTS(dot_q8_0); return 1;
    case KVB_Q4_K: KVB_DOTS(dot_q4_k); return 1;
    case KVB_Q6_K: KVB_DOTS(dot_q6_k); return 1;
    default: return 0;
    }
#undef KVB_DOTS
}

int kvb_supports(int type) {
    dot_fn dots[4];
    return dots_for(type, dots);
}

int kvb_activation_block(int type) { return activation_block(type % KVB_TILED); } /* type: + KVB_TILED or not */

int kvb_vector_path(void) { /* 2: AVX2 with VNNI, 1: AVX2, 0: portable C */
#if defined(KVB_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(KVB_AVX2)
    return 1;
#else
    return 0;
#endif
}

#define ROWS_PER_TASK 16 /* weight rows a task takes: one 16-row tile where the type has tiles */

typedef struct {
    dot_fn dots[4];
    tile_fn tiles[4]; /* or NULL */
    const uint8_t *w, *acts, *sum_bytes;
    const float *d;
    int64_t n, k, nb, row_bytes, row, per_block, m;
    float *y;
} matmul_job;

#define M_BLOCK 64
static void matmul_tasks(void *ctx, int64_t first_task, int64_t end_task) {
    const matmul_job *j = ctx;
    const int64_t n = j->n, nb = j->nb, row = j->row, per_block = j->per_block, m = j->m;
    for (int64_t from = 0; from < m; from += M_BLOCK) { /* activation rows a block at a time: they stay in cache */
      const int64_t upto = from + M_BLOCK < m ? from + M_BLOCK : m;
      for (int64_t t = first_task; t < end_task; t++) {
        const int64_t first = t * ROWS_PER_TASK, last = first + ROWS_PER_TASK < n ? first + ROWS_PER_TASK : n;
        int64_t i = from;
        for (int size = 3; size >= 0; size--) /* activation rows 8, then 4, 2 and 1 at a time */
            for (; i + (1 << size) <= upto; i += 1 << size) {
                const int8_t *acts = (const int8_t *)(j->acts + i * row);
                const float *d = j->d + i * nb;
                const uint8_t *sums = j->sum_bytes + i * nb * per_block;
                if (j->tiles[0]) { /* tiled: the task is one tile */
                    j->tiles[size](j->w + first * j->row_bytes, nb, acts, d, (const int32_t *)sums, j->k,
                                   j->y + i * n + first, n);
                    continue;
                }
                for (int64_t r = first; r < last; r++)
                    j->dots[size](j->w + r * j->row_bytes, nb, acts, d, sums, j->k, j->y + i * n + r, n);
            }
      }
    }
}

/* y[m, n] = sum_k W[n, k] x[m, k], x as kvb_quantize made it for this type's activation block (q, d, sums); type
   + KVB_TILED: W held as tiles (kvb_repack). Returns 0, or -1 for a type or layout this build does not multiply.
   Output rows are split between threads in tasks of ROWS_PER_TASK weight rows; a task takes the activation rows
   eight at a time, then four, two and one (a weight block is decoded once for the rows taken together; each row's
   sums are the same however they are taken). */
int kvb_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const int8_t *q, const float *d,
               const void *sums, int64_t m, float *y, int threads) {
    matmul_job job = {{0}, {0}, w, (const uint8_t *)q, (const uint8_t *)sums, d, n, k, 0, row_bytes, 0, 0, m, y};
    const int tiled = type >= KVB_TILED;
    type = tiled ? type - KVB_TILED : type;
    if (!dots_for(type, job.dots) || (tiled && (!tiles_for(type, job.tiles) || n % 16))) return -1;
    const int block = activation_block(type);
    job.nb = k / block;
    job.row = block == 32 ? 2 * k : k;            /* bytes of one activation row */
    job.per_block = block == 32 ? 4 : 32;         /* bytes of sums per activation block */
    kvb_parallel((n + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads, matmul_tasks, &job);
    return 0;
}

/* y[m, n] = x[m, k] W[n, k]^T: the activations rounded as kvb_quantize rounds them, into scratch memory of this
   call, then kvb_matmul. Returns 0, -1 for a type this file does not multiply, -2 when the scratch memory cannot
   be had. */
int kvb_linear(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const float *x, int64_t m,
               float *y, int threads) {
    if (!kvb_supports(type % KVB_TILED)) return -1;
    const int block = activation_block(type % KVB_TILED);
    const int64_t nb = k / block, sum_bytes = block == 32 ? m * nb * 4 : m * (k / 16) * 2;
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

/* ---- rows back to float32, gguf-py's products ---- */

static void row_q4_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++, w += 18, out += 32) {
        const float dw = half_at(w);
        for (int i = 0; i < 16; i++) {
            out[i] = (float)((w[2 + i] & 0x0f) - 8) * dw;
            out[16 + i] = (float)((w[2 + i] >> 4) - 8) * dw;
        }
    }
}

static void row_q4_1(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++, w += 20, out += 32) {
        const float dw = half_at(w), mw = half_at(w + 2);
        for (int i = 0; i < 16; i++) {
            out[i] = dw * (float)(w[4 + i] & 0x0f) + mw;
            out[16 + i] = dw * (float)(w[4 + i] >> 4) + mw;
        }
    }
}

static void row_q8_0(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++, w += 34, out += 32) {
        const float dw = half_at(w);
        for (int i = 0; i < 32; i++) out[i] = (float)(int8_t)w[2 + i] * dw;
    }
}

static void row_q4_k(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; b++, w += 144) {
        const float dw = half_at(w), dmin = half_at(w + 2);
        for (int j = 0; j < 8; j++, out += 32) {
            uint8_t sc, m;
            q4k_scale_min(w + 4, j, &sc, &m);
            const float scale = dw * (float)sc, offset = dmin * (float)m;
            const uint8_t *raw = w + 16 + 32 * (j / 2);
            for (int i = 0; i < 32; i++) out[i] = (float)((j & 1) ? raw[i] >> 4 : raw[i] & 0x0f) * scale - offset;
        }
    }
}

static void row_q6_k(const uint8_t *w, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; b++, w += 210) {
        const float dw = half_at(w + 208);
        const int8_t *scales = (const int8_t *)(w + 192);
        for (int n = 0; n < 2; n++) {
            const uint8_t *ql = w + 64 * n, *qh = w + 128 + 32 * n;
            for (int c = 0; c < 4; c++, out += 32)
                for (int l = 0; l < 32; l++) {
                    const int code = ((((c & 1) ? ql[l + 32] : ql[l]) >> (c >= 2 ? 4 : 0)) & 0x0f) |
                                     (((qh[l] >> (2 * c)) & 3) << 4);
                    out[l] = (dw * (float)scales[8 * n + 2 * c + l / 16]) * (float)(code - 32);
                }
        }
    }
}

typedef struct {
    void (*row)(const uint8_t *, int64_t, float *);
    const uint8_t *w;
    int64_t k, row_bytes;
    const int64_t *idx;
    float *out;
    int tiled; /* 0, or the type whose tiles w holds */
} dequantize_job;

static void dequantize_rows(void *ctx, int64_t first, int64_t end) {
    const dequantize_job *j = ctx;
    for (int64_t i = first; i < end; i++) {
        if (!j->tiled) {
            j->row(j->w + j->idx[i] * j->row_bytes, j->k, j->out + i * j->k);
            continue;
        }
        const int64_t tile = j->idx[i] / 16, bytes = block_bytes(j->tiled), values = activation_block(j->tiled);
        const uint8_t *t = j->w + tile * 16 * j->row_bytes;
        uint8_t block[210];
        for (int64_t b = 0; b < j->k / values; b++) {
            if (values == 256)
                kvb_kuntile(j->tiled, t + b * 16 * bytes, (int)(j->idx[i] % 16), block);
            else
                untile_block(j->tiled, t + b * 16 * bytes, (int)(j->idx[i] % 16), block);
            j->row(block, values, j->out + i * j->k + b * values);
        }
    }
}

/* 16 when this build multiplies tiles (AVX2 or AVX-512), else 0 (portable C) */
int kvb_tile_rows(void) {
    tile_fn tiles[4];
    return tiles_for(KVB_Q4_1, tiles) ? 16 : 0;
}

/* 1 when this build multiplies weights of `type` held as tiles */
int kvb_tiles(int type) {
    tile_fn tiles[4];
    return tiles_for(type, tiles);
}

typedef struct {
    int type;
    const uint8_t *w;
    int64_t k, row_bytes;
    uint8_t *out;
    _Atomic int *failed; /* set when an in-place task had no memory for its rows */
} repack_job;

static void repack_tiles(void *ctx, int64_t first, int64_t end) {
    const repack_job *j = ctx;
    const int64_t bytes = block_bytes(j->type), values = activation_block(j->type);
    /* in place (out == w): tile t takes the bytes of its own 16 rows, which are copied aside first */
    uint8_t *aside = j->out == j->w ? malloc((size_t)(16 * j->row_bytes)) : NULL;
    if (j->out == j->w && !aside) {
        atomic_store(j->failed, 1);
        return;
    }
    for (int64_t t = first; t < end; t++) {
        const uint8_t *from = j->w + 16 * t * j->row_bytes;
        if (aside) from = memcpy(aside, from, (size_t)(16 * j->row_bytes));
        for (int64_t b = 0; b < j->k / values; b++) {
            const uint8_t *rows[16];
            for (int c = 0; c < 16; c++) rows[c] = from + c * j->row_bytes + b * bytes;
            uint8_t *tile = j->out + 16 * t * j->row_bytes + b * 16 * bytes;
            if (values == 256)
                kvb_ktile(j->type, rows, tile);
            else
                tile_block(j->type, rows, tile);
        }
    }
    free(aside);
}

/* out: the n rows of w (a type this build multiplies as tiles, n a multiple of 16) as tiles; the same number of
   bytes; out may be w (then 16 rows at a time are copied aside: no second copy of the weight). Returns 0, -1 for
   a type or shape that has no tiles, -2 when memory for 16 rows cannot be had (in place: w is then partly
   tiles, and unusable). */
int kvb_repack(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, uint8_t *out, int threads) {
    const int values = activation_block(type);
    if (!kvb_tiles(type) || n % 16 || k % values || row_bytes != k / values * block_bytes(type)) return -1;
    _Atomic int failed = 0;
    repack_job job = {type, w, k, row_bytes, out, &failed};
    kvb_parallel(n / 16, threads, repack_tiles, &job);
    return atomic_load(&failed) ? -2 : 0;
}

/* out[i, :] = row idx[i] of W, for n_idx rows (each index checked by the caller); type + KVB_TILED: W held as
   tiles. Returns 0, or -1 for a type this file does not read. */
int kvb_dequantize(int type, const uint8_t *w, int64_t k, int64_t row_bytes, const int64_t *idx, int64_t n_idx,
                   float *out, int threads) {
    const int tiled = type >= KVB_TILED ? type - KVB_TILED : 0;
    if (tiled && !kvb_tiles(tiled)) return -1;
    type = tiled ? tiled : type;
    void (*row)(const uint8_t *, int64_t, float *) = 0;
    switch (type) {
    case KVB_Q4_0: row = row_q4_0; break;
    case KVB_Q4_1: row = row_q4_1; break;
    case KVB_Q8_0: row = row_q8_0; break;
    case KVB_Q4_K: row = row_q4_k; break;
    case KVB_Q6_K: row = row_q6_k; break;
    default: return -1;
    }
    dequantize_job job = {row, w, k, row_bytes, idx, out, tiled};
    kvb_parallel(n_idx, n_idx > 64 ? threads : 1, dequantize_rows, &job);
    return 0;
}
