/* The block kernel's products (gguf_blocks.c calls them through kvb_dots_for and kvb_tiles_for): a weight row's
   blocks, or a 16-row tile's, times R activation rows rounded as gguf_blocks.c rounds them; AVX2 and AVX-512
   paths and a portable C twin, all with the same integer sums and the same float steps per block, so an output has
   the same bits on every path and for any R. The Q4_K and Q6_K tiles are in ktiles.c. */

#include "gguf_blocks.h"

/* The float steps of a 32-value block, the same on every path (the vector ones lane by lane): the block's exact
   integer dot `sum` of weight codes and activation codes (Q4_0: minus 8 times the activations' code sum), times
   the weight's scale and the activations', added to the output in one rounding (fmaf), blocks in order; Q4_1's
   offsets (the weight's m times the activations' scale times their code sum, the latter product rounded once
   when the activations were: kvb_sum32) in their own sum, one rounding (fmaf) per block. Output = acc + offsets.
   Each output is thus the same whatever number of rows and columns are computed together, on whichever path of
   this build. */
static inline __attribute__((always_inline)) void block32_float(int type, int32_t sum, float dw, float mw, float dr,
                                                                  const kvb_sum32 *a, float *acc, float *offsets) {
    if (type == KVB_Q4_0) sum -= 8 * a->sum;
    *acc = fmaf((float)sum, dw * dr, *acc);
    if (type == KVB_Q4_1) *offsets = fmaf(mw, a->scaled, *offsets);
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


/* Q4_0, Q4_1, Q8_0 against A32 (int16 activations), one weight row at a time (weights whose row count is not a
   multiple of 16, and the portable build's twin below): a block's exact integer dot (the codes widened to int16,
   _mm256_madd_epi16, the eight lanes summed in integers), then the float steps of block32_float. */
static inline __attribute__((always_inline)) void dots32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const kvb_sum32 *s,
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
            block32_float(type, hsum_i32(p), dw, mw, d[at], &s[at], &acc[r], &offsets[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r * stride] = acc[r] + offsets[r];
}

#define KVB_TILES 1 /* 16 weight rows at a time, one output per vector lane */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

/* Q4_0, Q4_1, Q8_0 against A32 for one 16-row tile (w: its first block) and R activation rows: per block each pair
   of the 16 rows widens to one vector (lane c: row c), multiplied with the activations' pair p
   (_mm512_dpwssd_epi32): 16 exact integer dots at once; then block32_float's steps for the 16 outputs, lane by
   lane. A tile's block is widened once for the R rows. out[r * stride + c].
   Q4_1's offsets take a pass over the tile's m of their own from OFFSETS_APART rows (the same fmas in the same
   order, so the same bits): R sums of offsets beside R sums and R integer dots in registers spilled, and a tile of
   8 rows in cache took 0.82-0.92x the time of the two sums in one pass at 6-8 rows (Q4_1 1536 x 576, one thread,
   EPYC Zen 4), ~1.05x at 1 row with its weights out of cache (its m read again). */
#define OFFSETS_APART 5
static inline __attribute__((always_inline)) void tile32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const kvb_sum32 *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = 16 * block_bytes(type), start = tile_codes_start(type);
    const int apart = type == KVB_Q4_1 && R >= OFFSETS_APART;
    const uint8_t *const first = w;
    const __m512i low = _mm512_set1_epi16(0x0f);
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
                for (int r = 0; r < R; r++) dot[r] = dpwssd_from(dot[r], v, x0 + r * k / 2 + p);
            }
        } else {
            for (int g = 0; g < 4; g++) { /* pair 4g + e: nibble e of each 16-bit word (gguf_layout.c) */
                const __m512i raw = _mm512_loadu_si512((const void *)(w + start + 64 * g));
                const __m512i v[4] = {_mm512_and_si512(raw, low), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low),
                                      _mm512_and_si512(_mm512_srli_epi16(raw, 8), low), _mm512_srli_epi16(raw, 12)};
                for (int e = 0; e < 4; e++)
                    for (int r = 0; r < R; r++) dot[r] = dpwssd_from(dot[r], v[e], x0 + r * k / 2 + 4 * g + e);
            }
        }
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        for (int r = 0; r < R; r++) {
            const int64_t at = r * nb + b;
            __m512i sum = dot[r];
            if (type == KVB_Q4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * s[at].sum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(d[at])), acc[r]);
            if (type == KVB_Q4_1 && !apart)
                offsets[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32))),
                                             _mm512_set1_ps(s[at].scaled), offsets[r]);
        }
    }
    if (apart) /* Q4_1's offsets, blocks in order as above */
        for (int64_t b = 0; b < nb; b++) {
            const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(first + b * bytes + 32)));
            for (int r = 0; r < R; r++)
                offsets[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s[r * nb + b].scaled), offsets[r]);
        }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * stride, _mm512_add_ps(acc[r], offsets[r]));
}
#else
/* The same tiles on AVX2: each half of a tile (rows 0-7, 8-15) one 8-lane vector; _mm256_madd_epi16 (or VNNI)
   products summed in integers per lane, then block32_float's steps lane by lane: the same bits as AVX-512's. */
/* Q4_1's offsets in a pass of their own from 3 rows, as on AVX-512 with half the registers: a -march=haswell build
   on the EPYC, one thread, 1536 x 576 in cache, best of 40: 0.97x the time at 3 rows, 0.96x at 4, 0.97x at 6,
   the same at 8 as never apart. */
#define OFFSETS_APART 3
static inline __attribute__((always_inline)) void tile32(int type, int R, const uint8_t *w, int64_t nb,
                                                           const int8_t *q, const float *d, const kvb_sum32 *s,
                                                           int64_t k, float *out, int64_t stride) {
    const int16_t *xs = (const int16_t *)q;
    const int bytes = 16 * block_bytes(type), start = tile_codes_start(type);
    const int apart = type == KVB_Q4_1 && R >= OFFSETS_APART;
    const uint8_t *const first = w;
    const __m256i low = _mm256_set1_epi16(0x0f);
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
                for (int g = 0; g < 4; g++) { /* pair 4g + e: nibble e of each 16-bit word, rows 8h .. 8h + 7 */
                    const __m256i raw = load32(w + start + 64 * g + 32 * h);
                    const __m256i v[4] = {_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                                          _mm256_and_si256(_mm256_srli_epi16(raw, 8), low), _mm256_srli_epi16(raw, 12)};
                    for (int e = 0; e < 4; e++)
                        for (int r = 0; r < R; r++)
                            dot[r] = madd_add(dot[r], v[e], _mm256_set1_epi32(x0[r * k / 2 + 4 * g + e]));
                }
            }
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16 * h)));
            for (int r = 0; r < R; r++) {
                const int64_t at = r * nb + b;
                __m256i sum = dot[r];
                if (type == KVB_Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * s[at].sum));
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(d[at])),
                                            acc[r][h]);
                if (type == KVB_Q4_1 && !apart) {
                    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 32 + 16 * h)));
                    offsets[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[at].scaled), offsets[r][h]);
                }
            }
        }
    }
    if (apart) /* Q4_1's offsets, blocks in order as above */
        for (int64_t b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) {
                const __m256 mw =
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(first + b * bytes + 32 + 16 * h)));
                for (int r = 0; r < R; r++)
                    offsets[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[r * nb + b].scaled), offsets[r][h]);
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
                                                           const int8_t *q, const float *d, const kvb_sum32 *s,
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
            block32_float(type, sum, half_at(blk), type == KVB_Q4_1 ? half_at(blk + 2) : 0.0f, d[at], &s[at], &acc,
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
DOTS(dot_q4_0, dots32, KVB_Q4_0, kvb_sum32)
DOTS(dot_q4_1, dots32, KVB_Q4_1, kvb_sum32)
DOTS(dot_q8_0, dots32, KVB_Q8_0, kvb_sum32)
DOTS(dot_q4_k, dots256, KVB_Q4_K, int16_t)
DOTS(dot_q6_k, dots256, KVB_Q6_K, int16_t)


#ifdef KVB_TILES
#define TILES(NAME, TYPE, R)                                                                                        \
    static void NAME##_##R(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *s,         \
                           int64_t k, float *out, int64_t stride) {                                               \
        tile32(TYPE, R, w, nb, q, d, (const kvb_sum32 *)s, k, out, stride);                                       \
    }
#define ALL_TILES(NAME, TYPE)                                                                                     \
    TILES(NAME, TYPE, 1) TILES(NAME, TYPE, 2) TILES(NAME, TYPE, 3) TILES(NAME, TYPE, 4) TILES(NAME, TYPE, 5)     \
    TILES(NAME, TYPE, 6) TILES(NAME, TYPE, 7) TILES(NAME, TYPE, 8)
ALL_TILES(tile_q4_0, KVB_Q4_0)
ALL_TILES(tile_q4_1, KVB_Q4_1)
ALL_TILES(tile_q8_0, KVB_Q8_0)
#endif

/* Q4_K and Q6_K as 16-row tiles (ktiles.c), where the CPU has AVX-512 VNNI: their layout and kernels */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVB_KTILES 1
#define KVB_KTILE_DECL(NAME, R) \
    void NAME##_##R(const uint8_t *, int64_t, const int8_t *, const float *, const int32_t *, int64_t, float *, int64_t);
#define KVB_KTILE_DECLS(NAME)                                                                                      \
    KVB_KTILE_DECL(NAME, 1) KVB_KTILE_DECL(NAME, 2) KVB_KTILE_DECL(NAME, 3) KVB_KTILE_DECL(NAME, 4)                \
    KVB_KTILE_DECL(NAME, 8)
KVB_KTILE_DECLS(kvb_q4k_tile)
KVB_KTILE_DECLS(kvb_q6k_tile)
KVB_KTILE_DECL(kvb_q6k_tile, 5) KVB_KTILE_DECL(kvb_q6k_tile, 6)
#endif

/* the 16-row tiles for R activation rows at once (tiles[R - 1], R = 1 .. MAX_ROWS; NULL for an R taken in smaller
   parts: Q4_K has 1-4 and 8), or 0 where this build has none for the type. The 32-value types take 3, 5, 6 or 7
   rows (a check of drafted tokens, a batch of streams) in one pass, where passes of 4, 2 and 1 decoded the tile's
   weights again for each. Q4_K's tiles take rows in groups of 4 (ktiles.c): 5-7 rows in one pass were 1.6-2.8x
   slower (spilled), one code group at a time for all rows (as Q6_K's 5, 6 and 8; its 7 rows are 4 + 3) 0.87 /
   0.97 / 1.02 / 1.07x the time at 5 / 6 / 7 / 8 rows in cache (the 1.5B shape, EPYC Zen 4). */
int kvb_tiles_for(int type, tile_fn tiles[MAX_ROWS]) {
    for (int r = 0; r < MAX_ROWS; r++) tiles[r] = 0;
#define KVB_KTILE_SET(NAME) \
    tiles[0] = NAME##_1, tiles[1] = NAME##_2, tiles[2] = NAME##_3, tiles[3] = NAME##_4, tiles[7] = NAME##_8
#define KVB_TILE_SET(NAME)                                                                                         \
    tiles[0] = NAME##_1, tiles[1] = NAME##_2, tiles[2] = NAME##_3, tiles[3] = NAME##_4, tiles[4] = NAME##_5,      \
    tiles[5] = NAME##_6, tiles[6] = NAME##_7, tiles[7] = NAME##_8
#ifdef KVB_KTILES
    if (type == KVB_Q4_K || type == KVB_Q6_K) {
        if (type == KVB_Q4_K)
            KVB_KTILE_SET(kvb_q4k_tile);
        else {
            KVB_KTILE_SET(kvb_q6k_tile);
            tiles[4] = kvb_q6k_tile_5, tiles[5] = kvb_q6k_tile_6;
        }
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
#endif
#undef KVB_KTILE_SET
#undef KVB_TILE_SET
    (void)type;
    return 0;
}

/* the dot for 1, 2, 4 and 8 activation rows at once (dots[0..3]) */
int kvb_dots_for(int type, dot_fn dots[4]) {
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

int kvb_vector_path(void) { /* 2: AVX2 with VNNI, 1: AVX2, 0: portable C */
#if defined(KVB_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(KVB_AVX2)
    return 1;
#else
    return 0;
#endif
}
