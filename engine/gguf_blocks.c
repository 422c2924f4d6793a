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

/* engine/thread_pool.c: fn(ctx, begin, end) over [0, n) in `threads` contiguous parts, on the process's one pool */
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

static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

static inline __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* How far ahead of the block being multiplied the weight stream is prefetched. A decode step reads each weight
   once, from memory: without it every block waited on its scale's load (the embedded Q4_1 model decoded at 47
   tok/s on a 2-core Xeon, 102-105 with it; 2048-8192 bytes measured alike, 256 barely helped). */
#define PREFETCH_BYTES 4096

/* Q4_0, Q4_1, Q8_0 against A32 (int16 activations): per block an exact integer dot (the codes widened to int16,
   _mm256_madd_epi16), then one float multiply-add; two accumulators (even and odd blocks) so that consecutive
   blocks do not wait on each other. The loop takes the blocks two at a time so that which accumulator a block
   adds into is known when compiling: indexed by a running parity, the accumulators lived in memory and every
   block waited on a store and a load of the one before (half the decode time of a Q4_1 model). */
static inline __attribute__((always_inline)) void block32(int type, int R, const uint8_t *w, int64_t nb, int64_t b,
                                                            const int16_t *xs, const float *d, const int32_t *s,
                                                            int64_t k, __m256 acc[4][2], float offsets[4][2],
                                                            const int slot) {
    const __m128i low = _mm_set1_epi8(0x0f);
    const float dw = half_at(w);
    __m256i first, second; /* the block's 32 codes as int16: values 0-15, then 16-31 */
    float mw = 0.0f;
    if (type == KVB_Q8_0) {
        first = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 2)));
        second = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 18)));
    } else {
        const __m128i t = _mm_loadu_si128((const __m128i *)(w + (type == KVB_Q4_0 ? 2 : 4)));
        first = _mm256_cvtepu8_epi16(_mm_and_si128(t, low));
        second = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t, 4), low));
        if (type == KVB_Q4_1) mw = half_at(w + 2);
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = r * nb + b;
        const int16_t *x = xs + r * k + b * 32;
        __m256i p = _mm256_add_epi32(_mm256_madd_epi16(first, load32(x)), _mm256_madd_epi16(second, load32(x + 16)));
        if (type == KVB_Q4_0) p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(8 * s[at])));
        acc[r][slot] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * d[at]), acc[r][slot]);
        if (type == KVB_Q4_1) offsets[r][slot] += mw * d[at] * (float)s[at];
    }
}

static inline __attribute__((always_inline)) void dots32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const int32_t *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = block_bytes(type);
    __m256 acc[4][2];
    float offsets[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps(), offsets[r][0] = offsets[r][1] = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 2 * bytes) {
        _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
        block32(type, R, w, nb, b, xs, d, s, k, acc, offsets, 0);
        block32(type, R, w + bytes, nb, b + 1, xs, d, s, k, acc, offsets, 1);
    }
    if (b < nb) block32(type, R, w, nb, b, xs, d, s, k, acc, offsets, 0);
    for (int r = 0; r < R; r++)
        out[r * stride] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + (offsets[r][0] + offsets[r][1]);
}

/* Q4_K, Q6_K against A256: a block's products times their integer sub-scales summed in int32 over the whole
   block, then one float multiply-add for the block (and one for Q4_K's mins, from the activations' sums per 16). */
static inline __attribute__((always_inline)) void dots256(int type, int R, const uint8_t *w, int64_t nb,
                                                            const int8_t *q, const float *d, const int16_t *bsums,
                                                            int64_t k, float *out, int64_t stride) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const int bytes = block_bytes(type);
    __m256 acc[4], mins[4];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm256_setzero_ps();
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
            __m256i sum = _mm256_add_epi32(even, odd);
            const __m256i sums16 = _mm256_madd_epi16(terms16, load32(bsums + at * 16));
            if (type == KVB_Q6_K) sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(sums16, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dw * d[at]), acc[r]);
            if (type == KVB_Q4_K)
                mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums16), _mm256_set1_ps(dmin * d[at]), mins[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * stride] = hsum(acc[r]) - hsum(mins[r]);
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
                if (type == KVB_Q4_0) sum -= 8 * s[at];
                if (type == KVB_Q4_1) offsets += half_at(blk + 2) * d[at] * (float)s[at];
            }
            acc += (float)sum * (half_at(blk) * d[at]);
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
                acc += (float)sum * (half_at(blk) * d[at]);
                mins += (float)terms * (half_at(blk + 2) * d[at]);
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
                sum -= 32 * terms;
                acc += (float)sum * (half_at(blk + 208) * d[at]);
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
    static void NAME##_4(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const void *s, int64_t k, \
                         float *out, int64_t stride) {                                                            \
        KIND(TYPE, 4, w, nb, q, d, (const SUMS *)s, k, out, stride);                                              \
    }
DOTS(dot_q4_0, dots32, KVB_Q4_0, int32_t)
DOTS(dot_q4_1, dots32, KVB_Q4_1, int32_t)
DOTS(dot_q8_0, dots32, KVB_Q8_0, int32_t)
DOTS(dot_q4_k, dots256, KVB_Q4_K, int16_t)
DOTS(dot_q6_k, dots256, KVB_Q6_K, int16_t)

static int dots_for(int type, dot_fn *one, dot_fn *four) {
    switch (type) {
    case KVB_Q4_0: *one = dot_q4_0_1, *four = dot_q4_0_4; return 1;
    case KVB_Q4_1: *one = dot_q4_1_1, *four = dot_q4_1_4; return 1;
    case KVB_Q8_0: *one = dot_q8_0_1, *four = dot_q8_0_4; return 1;
    case KVB_Q4_K: *one = dot_q4_k_1, *four = dot_q4_k_4; return 1;
    case KVB_Q6_K: *one = dot_q6_k_1, *four = dot_q6_k_4; return 1;
    default: return 0;
    }
}

int kvb_supports(int type) {
    dot_fn one, four;
    return dots_for(type, &one, &four);
}

int kvb_activation_block(int type) { return activation_block(type); }

int kvb_vector_path(void) { /* 2: AVX2 with VNNI, 1: AVX2, 0: portable C */
#if defined(KVB_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(KVB_AVX2)
    return 1;
#else
    return 0;
#endif
}

#define ROWS_PER_TASK 16

typedef struct {
    dot_fn one, four;
    const uint8_t *w, *acts, *sum_bytes;
    const float *d;
    int64_t n, k, nb, row_bytes, row, per_block, m;
    float *y;
} matmul_job;

static void matmul_tasks(void *ctx, int64_t first_task, int64_t end_task) {
    const matmul_job *j = ctx;
    const int64_t n = j->n, nb = j->nb, row = j->row, per_block = j->per_block, m = j->m;
    for (int64_t t = first_task; t < end_task; t++) {
        const int64_t first = t * ROWS_PER_TASK, last = first + ROWS_PER_TASK < n ? first + ROWS_PER_TASK : n;
        int64_t i = 0;
        for (; i + 4 <= m; i += 4)
            for (int64_t r = first; r < last; r++)
                j->four(j->w + r * j->row_bytes, nb, (const int8_t *)(j->acts + i * row), j->d + i * nb,
                        j->sum_bytes + i * nb * per_block, j->k, j->y + i * n + r, n);
        for (; i < m; i++)
            for (int64_t r = first; r < last; r++)
                j->one(j->w + r * j->row_bytes, nb, (const int8_t *)(j->acts + i * row), j->d + i * nb,
                       j->sum_bytes + i * nb * per_block, j->k, j->y + i * n + r, n);
    }
}

/* y[m, n] = sum_k W[n, k] x[m, k], x as kvb_quantize made it for this type's activation block (q, d, sums);
   returns 0, or -1 for a type this file does not multiply. Output rows are split between threads in tasks of
   ROWS_PER_TASK weight rows; a task takes the activation rows four at a time, the rest one at a time. */
int kvb_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const int8_t *q, const float *d,
               const void *sums, int64_t m, float *y, int threads) {
    dot_fn one, four;
    if (!dots_for(type, &one, &four)) return -1;
    const int block = activation_block(type);
    matmul_job job = {one, four, w, (const uint8_t *)q, (const uint8_t *)sums, d, n, k, k / block, row_bytes,
                      block == 32 ? 2 * k : k /* bytes of one activation row */,
                      block == 32 ? 4 : 32 /* bytes of sums per activation block */, m, y};
    kvb_parallel((n + ROWS_PER_TASK - 1) / ROWS_PER_TASK, threads, matmul_tasks, &job);
    return 0;
}

/* y[m, n] = x[m, k] W[n, k]^T: the activations rounded as kvb_quantize rounds them, into scratch memory of this
   call, then kvb_matmul. Returns 0, -1 for a type this file does not multiply, -2 when the scratch memory cannot
   be had. */
int kvb_linear(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const float *x, int64_t m,
               float *y, int threads) {
    dot_fn one, four;
    if (!dots_for(type, &one, &four)) return -1;
    const int block = activation_block(type);
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
} dequantize_job;

static void dequantize_rows(void *ctx, int64_t first, int64_t end) {
    const dequantize_job *j = ctx;
    for (int64_t i = first; i < end; i++) j->row(j->w + j->idx[i] * j->row_bytes, j->k, j->out + i * j->k);
}

/* out[i, :] = row idx[i] of W, for n_idx rows (each index checked by the caller); returns 0, or -1 for a type
   this file does not read. */
int kvb_dequantize(int type, const uint8_t *w, int64_t k, int64_t row_bytes, const int64_t *idx, int64_t n_idx,
                   float *out, int threads) {
    void (*row)(const uint8_t *, int64_t, float *) = 0;
    switch (type) {
    case KVB_Q4_0: row = row_q4_0; break;
    case KVB_Q4_1: row = row_q4_1; break;
    case KVB_Q8_0: row = row_q8_0; break;
    case KVB_Q4_K: row = row_q4_k; break;
    case KVB_Q6_K: row = row_q6_k; break;
    default: return -1;
    }
    dequantize_job job = {row, w, k, row_bytes, idx, out};
    kvb_parallel(n_idx, n_idx > 64 ? threads : 1, dequantize_rows, &job);
    return 0;
}
