/* The K-quants' weights as 16-row tiles, for CPUs with AVX-512 VNNI (gguf_blocks.c calls these; kvb_repack
   makes the tiles).

   A 256-value block of one row is multiplied, in gguf_dots.c's rows, by widening and scaling its codes before
   any product: ~50 instructions a block, for one output. A tile puts the same block of 16 rows side by side, so
   that each vector lane is one row: 64 bytes hold four codes of each of the 16 rows, and one _mm512_dpbusd_epi32
   with four activation codes broadcast gives all 16 rows' four products. The same bytes as the rows' blocks, in
   another order:

   Q4_K (file block, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles, byte
   32p + i holding value i of sub-block 2p in its low nibble and of 2p + 1 in its high one):
     [0, 32)      16 fp16 d (row c at 2c)             [32, 64)  16 fp16 dmin
     [64, 256)    the 12 scale bytes, byte i of row c at 64 + 16 i + c
     [256, 2304)  nibbles: pair p, group g (values 4g .. 4g + 3): 64 bytes at 256 + 64 (8p + g), row c's bytes
                  32p + 4g .. 32p + 4g + 3 at 4c
   Q6_K (file block, 210 bytes: 128 bytes of low nibbles ql, 64 of 2-bit high parts qh, 16 int8 scales, fp16 d;
   value l of 32-value group c in half n: ql[64n + 32 (c & 1) + l] (high nibble for c >= 2) and bits 2c of
   qh[32n + l]; scale 8n + 2c + l / 16):
     [0, 32)      16 fp16 d                           [32, 288) the 16 scales, scale s of row c at 32 + 16 s + c
     [288, 2336)  low nibbles: 64 bytes at 288 + 64 (8P + g), row c's ql bytes 32P + 4g .. + 3 at 4c
     [2336, 3360) high parts: 64 bytes at 2336 + 64 (8n + g), row c's qh bytes 32n + 4g .. + 3 at 4c

   The sums are gguf_dots.c's (block256_float there): per row and block the exact integer sum of the sub-block
   dots times their scales, and the exact sum of the activations' sums times the mins (Q4_K) or scales (Q6_K);
   then one rounding each into the row's float sums, blocks in order. So a tile's outputs are the rows' bit for
   bit. */

#include "gguf_blocks.h"
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define KVB_KTILES 1
#endif

enum { Q4K_BYTES = 144, Q6K_BYTES = 210, Q4K_TILE = 16 * Q4K_BYTES, Q6K_TILE = 16 * Q6K_BYTES };

/* Row c's block moved into its tile (to_tile) or back: the layout above, written as copies of runs of fixed
   length (so that reordering a 7B model's 4 GB is ~10^9 small moves the compiler makes single loads and
   stores, not a lookup per byte) */
static inline void move(uint8_t *tile, uint8_t *row, int n, int to_tile) {
    if (to_tile)
        memcpy(tile, row, (size_t)n);
    else
        memcpy(row, tile, (size_t)n);
}

static inline __attribute__((always_inline)) void k_move(int type, int c, uint8_t *tile, uint8_t *row, int to_tile) {
    if (type == KVB_Q4_K) {
        move(tile + 2 * c, row, 2, to_tile);
        move(tile + 32 + 2 * c, row + 2, 2, to_tile);
        for (int i = 0; i < 12; i++) move(tile + 64 + 16 * i + c, row + 4 + i, 1, to_tile);
        for (int pg = 0; pg < 32; pg++) move(tile + 256 + 64 * pg + 4 * c, row + 16 + 4 * pg, 4, to_tile);
        return;
    }
    for (int pg = 0; pg < 32; pg++) move(tile + 288 + 64 * pg + 4 * c, row + 4 * pg, 4, to_tile);
    for (int ng = 0; ng < 16; ng++) move(tile + 2336 + 64 * ng + 4 * c, row + 128 + 4 * ng, 4, to_tile);
    for (int i = 0; i < 16; i++) move(tile + 32 + 16 * i + c, row + 192 + i, 1, to_tile);
    move(tile + 2 * c, row + 208, 2, to_tile);
}

/* the tile of 16 rows' blocks of a K-quant type (rows[c]: row c's block) */
void kvb_ktile(int type, const uint8_t *const rows[16], uint8_t *tile) {
    for (int c = 0; c < 16; c++) k_move(type, c, tile, (uint8_t *)rows[c], 1);
}

/* row c's block back from a tile */
void kvb_kuntile(int type, const uint8_t *tile, int c, uint8_t *block) { k_move(type, c, (uint8_t *)tile, block, 0); }

#ifdef KVB_KTILES
/* The weight stream is asked for this far ahead of the tile block being multiplied, into L2 (as gguf_dots.c does
   for the 32-value types, but there into L1, 4096 bytes ahead). A K-quant tile block is 2304 (Q4_K) or 3360
   (Q6_K) bytes. The 1.5B shape's 8960 x 1536 Q4_K and 1536 x 8960 Q6_K rotated past L3, 2 threads, 2-vCPU EPYC:
   the two settings alternating in one library, Q4_K 1 / 8 / 64 rows 0.65 / 0.81 / 0.96x the time of 4096 into L1,
   Q6_K 0.82 / 0.52 / 0.89x (16384 bytes alike); this build against the one before (`bench kernels --against`),
   Q4_K 3-8 rows 0.70-0.90x but 1-2 rows 0.91-1.07x, Q6_K 0.55-0.88x. The 32-value types' tiles lost 3-11% at 4-64
   rows into L2, so they keep theirs. */
#define PREFETCH_BYTES 8192
#define PREFETCH_HINT _MM_HINT_T1

/* 16 int32 lanes from the 16 rows' bytes */
static inline __m512i lanes(__m128i bytes) { return _mm512_cvtepu8_epi32(bytes); }

/* What a Q4_K tile block gives every activation row: its sub-blocks' scales (lane c: row c's), its mins in pairs
   (lane c: row c's mins of sub-blocks 2i and 2i + 1, two int16), d and dmin. */
typedef struct {
    __m512i scale[8], mpair[4];
    __m512 dw, dmin;
} q4k_block;

static inline void q4k_prepare(const uint8_t *w, q4k_block *blk) {
    const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(0x0f), two = _mm_set1_epi8(3);
    __m128i s[12], m[8];
    for (int i = 0; i < 12; i++) s[i] = _mm_loadu_si128((const __m128i *)(w + 64 + 16 * i));
    for (int j = 0; j < 4; j++) {
        blk->scale[j] = lanes(_mm_and_si128(s[j], six));
        m[j] = _mm_and_si128(s[j + 4], six);
        const __m128i high_sc = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(s[j], 6), two), 4);
        const __m128i high_m = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(s[j + 4], 6), two), 4);
        blk->scale[j + 4] = lanes(_mm_or_si128(_mm_and_si128(s[j + 8], four), high_sc));
        m[j + 4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(s[j + 8], 4), four), high_m);
    }
    for (int i = 0; i < 4; i++) {
        const __m128i lo = _mm_unpacklo_epi8(m[2 * i], m[2 * i + 1]), hi = _mm_unpackhi_epi8(m[2 * i], m[2 * i + 1]);
        blk->mpair[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    }
    blk->dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
    blk->dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
}

/* the block's codes as bytes: split[2 (8p + g)] sub-block 2p's values 4g .. 4g + 3 (16 lanes of four), split[2 (8p
   + g) + 1] sub-block 2p + 1's */
static inline void q4k_split(const uint8_t *w, __m512i split[64]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int pg = 0; pg < 32; pg++) {
        const __m512i raw = _mm512_loadu_si512((const void *)(w + 256 + 64 * pg));
        split[2 * pg] = _mm512_and_si512(raw, low);
        split[2 * pg + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
}

/* one activation row's float steps for a block: `sum` its integer sum of sub-block dots times their scales,
   bs its code sums per 16 (block256_float in gguf_dots.c, lane by lane) */
static inline void q4k_finish(const q4k_block *blk, __m512i sum, const int16_t *bs, float dr, __m512 *acc,
                              __m512 *mins) {
    __m512i terms = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++) { /* the activations' sums per 32 for sub-blocks 2i, 2i + 1, as int16 */
        const uint16_t first = (uint16_t)(bs[4 * i] + bs[4 * i + 1]);
        const uint16_t second = (uint16_t)(bs[4 * i + 2] + bs[4 * i + 3]);
        terms = _mm512_dpwssd_epi32(terms, blk->mpair[i], _mm512_set1_epi32((int32_t)(first | (uint32_t)second << 16)));
    }
    const __m512 r = _mm512_set1_ps(dr);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(blk->dw, r), *acc);
    *mins = _mm512_fmadd_ps(_mm512_cvtepi32_ps(terms), _mm512_mul_ps(blk->dmin, r), *mins);
}

/* Activation rows a tile's block is multiplied with at once: each 64 bytes of codes are loaded and split into
   nibbles once for the group, and every row's sums stay in registers (Q4_K: 3 per row). Before, a block's codes were
   split once into memory for all rows and read back row by row: 64 vector stores a block, and 2 rows cost 2.4x one.
   Q4_K 1536 x 1536 in cache, one thread, EPYC Zen 4: 1 / 2 / 4 / 8 rows 38 / 91 / 128 / 200 us before, 37 / 47 / 70
   / 125 us in groups of 4 (groups of 8: 130 us at 8 rows, spilled; of 2: slower). */
#define KT_GROUP 4

/* rows 0 .. G - 1 at x (k apart) times a Q4_K tile block (its codes at `codes`): per row the exact integer sum of
   the sub-block dots times their scales */
static inline __attribute__((always_inline)) void q4k_rows(int G, const uint8_t *codes, const q4k_block *blk,
                                                             const int8_t *x, int64_t k, __m512i *sum) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int r = 0; r < G; r++) sum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 4; p++) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) */
        __m512i even[KT_GROUP], odd[KT_GROUP];
        for (int r = 0; r < G; r++) even[r] = odd[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(codes + 64 * (8 * p + g)));
            const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            for (int r = 0; r < G; r++) {
                even[r] = dpbusd_from(even[r], lo, x + r * k + 64 * p + 4 * g);
                odd[r] = dpbusd_from(odd[r], hi, x + r * k + 64 * p + 32 + 4 * g);
            }
        }
        for (int r = 0; r < G; r++)
            sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(_mm512_mullo_epi32(even[r], blk->scale[2 * p]),
                                                               _mm512_mullo_epi32(odd[r], blk->scale[2 * p + 1])));
    }
}

/* out[r * stride + c] for activation rows r < R against one tile (w: its first block; nb blocks): the activations
   as gguf_blocks.c rounds them for 256-value blocks (int8 codes q [R, k], scales d [R, nb], sums per 16
   bsums [R, k / 16]). */
static inline __attribute__((always_inline)) void q4k_tile(int R, const uint8_t *w, int64_t nb, const int8_t *q,
                                                             const float *d, const int16_t *bsums, int64_t k,
                                                             float *out, int64_t stride) {
    __m512 acc[8], mins[8];
    for (int r = 0; r < R; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += Q4K_TILE) {
        for (int line = 0; line < Q4K_TILE; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), PREFETCH_HINT);
        q4k_block blk;
        q4k_prepare(w, &blk);
        for (int r0 = 0; r0 < R; r0 += KT_GROUP) {
            const int G = R - r0 < KT_GROUP ? R - r0 : KT_GROUP;
            __m512i sum[KT_GROUP];
            q4k_rows(G, w + 256, &blk, q + r0 * k + b * 256, k, sum);
            for (int r = r0; r < r0 + G; r++)
                q4k_finish(&blk, sum[r - r0], bsums + (r * nb + b) * 16, d[r * nb + b], &acc[r], &mins[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * stride, _mm512_sub_ps(acc[r], mins[r]));
}

/* the four 32-value groups c = 0..3 of half n, values 4g .. 4g + 3, of a Q6_K tile block: 16 lanes of four 6-bit
   codes each (out[c]) */
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *w, int n, int g, __m512i out[4]) {
    const __m512i low = _mm512_set1_epi8(0x0f), two = _mm512_set1_epi8(3);
    const __m512i qh = _mm512_loadu_si512((const void *)(w + 2336 + 64 * (8 * n + g)));
#pragma GCC unroll 2
    for (int e = 0; e < 2; e++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(w + 288 + 64 * (8 * (2 * n + e) + g)));
#pragma GCC unroll 2
        for (int c = e; c < 4; c += 2) {
            const __m512i nibble = _mm512_and_si512(c >= 2 ? _mm512_srli_epi16(ql, 4) : ql, low);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(qh, 2 * c), two);
            out[c] = _mm512_or_si512(nibble, _mm512_slli_epi16(high, 4));
        }
    }
}

/* What a Q6_K tile block gives every activation row: its 16 scales (lane c: row c's), in pairs (two int16), d */
typedef struct {
    __m512i scale[16], spair[8];
    __m512 dw;
} q6k_block;

static inline void q6k_prepare(const uint8_t *w, q6k_block *blk) {
    for (int i = 0; i < 8; i++) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(w + 32 + 32 * i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(w + 48 + 32 * i));
        blk->scale[2 * i] = _mm512_cvtepi8_epi32(a), blk->scale[2 * i + 1] = _mm512_cvtepi8_epi32(b);
        blk->spair[i] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
    }
    blk->dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
}

/* the codes offset 32 (the scales times the activations' sums, times 32) off the integer sum, then the float step.
   The pair of sums 2i, 2i + 1 is the int32 at bs + 2i: `from_memory`, it is the instruction's broadcast operand,
   else built in scalar registers. Which is faster depends on the rows around it (Q6_K 1536 x 8960 past L3, 2
   threads, EPYC Zen 4: 2 rows 0.90x the time from memory, 1 row 1.01-1.03x, 3 and 4 rows 1.05x; 2 rows in cache
   101 -> 59 us). */
static inline void q6k_finish(const q6k_block *blk, __m512i sum, const int16_t *bs, float dr, __m512 *acc,
                              int from_memory) {
    __m512i terms = _mm512_setzero_si512();
    for (int i = 0; i < 8; i++) {
        if (from_memory) {
            terms = dpwssd_from(terms, blk->spair[i], bs + 2 * i);
            continue;
        }
        const uint32_t pair = (uint16_t)bs[2 * i] | (uint32_t)(uint16_t)bs[2 * i + 1] << 16;
        terms = _mm512_dpwssd_epi32(terms, blk->spair[i], _mm512_set1_epi32((int32_t)pair));
    }
    sum = _mm512_sub_epi32(sum, _mm512_slli_epi32(terms, 5));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(blk->dw, _mm512_set1_ps(dr)), *acc);
}

/* rows 0 .. G - 1 at x (k apart) times a Q6_K tile block: as q4k_rows, a scale per 16 values (the codes made once
   for the group of rows; 1-4 rows: q6k_rows_wide takes more). Q6_K 1536 x 1536 in cache, one thread: 1 / 2 / 4 / 8
   rows 76 / 131 / 217 / 384 us before, 55 / 114 / 101 / 182 us (q6k_codes inlined whole: 1 row 75 -> 55 us). */
static inline __attribute__((always_inline)) void q6k_rows(int G, const uint8_t *w, const q6k_block *blk,
                                                             const int8_t *x, int64_t k, __m512i *sum) {
    for (int r = 0; r < G; r++) sum[r] = _mm512_setzero_si512();
    for (int n = 0; n < 2; n++)
        for (int half = 0; half < 2; half++) { /* values 16 half .. 16 half + 15 of each group: one scale */
            __m512i dot[KT_GROUP][4];
            for (int r = 0; r < G; r++)
                for (int c = 0; c < 4; c++) dot[r][c] = _mm512_setzero_si512();
            for (int g = 4 * half; g < 4 * half + 4; g++) {
                __m512i c4[4];
                q6k_codes(w, n, g, c4);
                for (int r = 0; r < G; r++)
                    for (int c = 0; c < 4; c++)
                        dot[r][c] = dpbusd_from(dot[r][c], c4[c], x + r * k + 128 * n + 32 * c + 4 * g);
            }
            for (int r = 0; r < G; r++)
                for (int c = 0; c < 4; c++)
                    sum[r] = _mm512_add_epi32(sum[r],
                                              _mm512_mullo_epi32(dot[r][c], blk->scale[2 * (4 * n + c) + half]));
        }
}

/* code vector c (values 4g .. 4g + 3 of group c of half n, 16 lanes of four 6-bit codes) alone: q6k_codes' c */
static inline __attribute__((always_inline)) __m512i q6k_code(const uint8_t *w, int n, int g, int c) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i qh = _mm512_loadu_si512((const void *)(w + 2336 + 64 * (8 * n + g)));
    const __m512i ql = _mm512_loadu_si512((const void *)(w + 288 + 64 * (8 * (2 * n + (c & 1)) + g)));
    const __m512i nibble = _mm512_and_si512(c >= 2 ? _mm512_srli_epi16(ql, 4) : ql, low);
    /* bits 2c, 2c + 1 of qh's bytes to bits 4, 5 (the shifts move 16-bit lanes; `top` keeps each byte's own) */
    const __m512i high = c == 2 ? qh : c < 2 ? _mm512_slli_epi16(qh, 4 - 2 * c) : _mm512_srli_epi16(qh, 2);
    return _mm512_or_si512(nibble, _mm512_and_si512(high, top));
}

/* q6k_rows for 5, 6 or 8 rows in one pass: one group c at a time, each code vector made once for all G rows (G
   accumulators and G sums in registers, where q6k_rows' four groups at once would spill). Q6_K 1536 x 8960 past
   L3, 2 threads, EPYC Zen 4, against passes of 4 and the rest (4 + 1, 4 + 2, two groups of 4): 0.96-1.00 /
   0.91-0.94 / 0.91-0.93x the time. 7 rows stay 4 + 3 (1.12-1.19x in one pass there, though 0.80x in cache: the
   second pass of 3 reads the tile from L2 at the kernel's speed). The loop over c stays a loop (unrolled, its four
   sets of accumulators spill: 1.2x the time at 8 rows). */
static inline __attribute__((always_inline)) void q6k_rows_wide(int G, const uint8_t *w, const q6k_block *blk,
                                                                  const int8_t *x, int64_t k, __m512i *sum) {
#pragma GCC unroll 8
    for (int r = 0; r < G; r++) sum[r] = _mm512_setzero_si512();
    for (int n = 0; n < 2; n++)
        for (int half = 0; half < 2; half++)
#pragma GCC unroll 1
            for (int c = 0; c < 4; c++) {
                __m512i dot[MAX_ROWS];
#pragma GCC unroll 8
                for (int r = 0; r < G; r++) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int g = 4 * half; g < 4 * half + 4; g++) {
                    const __m512i code = q6k_code(w, n, g, c);
#pragma GCC unroll 8
                    for (int r = 0; r < G; r++)
                        dot[r] = dpbusd_from(dot[r], code, x + r * k + 128 * n + 32 * c + 4 * g);
                }
#pragma GCC unroll 8
                for (int r = 0; r < G; r++)
                    sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(dot[r], blk->scale[2 * (4 * n + c) + half]));
            }
}

/* Q6_K: as q4k_tile, with a scale per 16 values */
static inline __attribute__((always_inline)) void q6k_tile(int R, const uint8_t *w, int64_t nb, const int8_t *q,
                                                             const float *d, const int16_t *bsums, int64_t k,
                                                             float *out, int64_t stride) {
    __m512 acc[8];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += Q6K_TILE) {
        for (int line = 0; line < Q6K_TILE; line += 64)
            _mm_prefetch((const char *)(w + PREFETCH_BYTES + line), PREFETCH_HINT);
        q6k_block blk;
        q6k_prepare(w, &blk);
        __m512i sum[MAX_ROWS];
        if (R > KT_GROUP)
            q6k_rows_wide(R, w, &blk, q + b * 256, k, sum);
        else
            q6k_rows(R, w, &blk, q + b * 256, k, sum);
        for (int r = 0; r < R; r++)
            q6k_finish(&blk, sum[r], bsums + (r * nb + b) * 16, d[r * nb + b], &acc[r], R == 2 || R > KT_GROUP);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * stride, acc[r]);
}

/* kvb_q4k_tile_R / kvb_q6k_tile_R: R rows at once (gguf_dots.c's kvb_tiles_for lists them) */
#define KTILE_FN(TYPE, R)                                                                                          \
    void kvb_##TYPE##_tile_##R(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *sums, \
                               int64_t k, float *out, int64_t stride) {                                          \
        TYPE##_tile(R, w, nb, q, d, (const int16_t *)sums, k, out, stride);                                      \
    }
#define KTILE_FNS(R) KTILE_FN(q4k, R) KTILE_FN(q6k, R)
KTILE_FNS(1)
KTILE_FNS(2)
KTILE_FNS(3)
KTILE_FNS(4)
KTILE_FNS(8)
KTILE_FN(q6k, 5)
KTILE_FN(q6k, 6)
#endif

/* ---- AMX: many activation rows at once ----
   Where the CPU has AMX (Sapphire Rapids and later) and the OS grants its tile state, 16 activation rows times a
   tile's 16 weight rows over 32 values (Q6_K: 16, one scale's worth) are one instruction (TDPBSUD: signed int8
   activations, unsigned codes), whose 256 integer dots are exact: the same integers the vector paths above sum,
   then the same integer scaling and the same float steps per row. So a row's output does not depend on whether
   AMX computed it (test: any number of rows against the weight's rows, bit for bit). */
#if defined(KVB_KTILES) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define AMX_ROWS 64 /* activation rows a call takes at most (gguf_blocks.c's AMX_BLOCK) */

/* activation row r's integer sum of `count` products' dots (dots[i]: 16 rows x 16 weight rows) times their scales */
static inline __m512i scaled_sum(const int32_t (*dots)[256], const __m512i *scale, int count, int r) {
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < count; i++)
        sum = _mm512_add_epi32(sum, _mm512_mullo_epi32(_mm512_load_si512(dots[i] + 16 * r), scale[i]));
    return sum;
}

/* Q4_K: out[r * stride + c] for `rows` (a multiple of 16, at most AMX_ROWS) activation rows against one tile */
static void q4k_amx(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int16_t *bsums, int64_t k,
                    int64_t rows, float *out, int64_t stride) {
    kvb_amx_configure(32);
    __m512 acc[AMX_ROWS], mins[AMX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = mins[r] = _mm512_setzero_ps();
    __m512i split[64] __attribute__((aligned(64)));
    int32_t dots[8][256] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++, w += Q4K_TILE) {
        q4k_block blk;
        q4k_prepare(w, &blk);
        q4k_split(w, split);
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
            const int8_t *x = q + m0 * k + b * 256;
            for (int half = 0; half < 2; half++) { /* sub-blocks 4 half .. 4 half + 3 */
                const int8_t *a[4];
                const void *codes[4];
                for (int t = 0; t < 4; t++) {
                    const int j = 4 * half + t;
                    a[t] = x + 32 * j, codes[t] = &split[2 * 8 * (j / 2) + j % 2]; /* rows g: 128 bytes apart */
                }
                kvb_amx_four(a, k, codes, 128, &dots[4 * half]);
            }
            for (int r = 0; r < 16; r++) {
                const int64_t at = (m0 + r) * nb + b;
                q4k_finish(&blk, scaled_sum(dots, blk.scale, 8, r), bsums + at * 16, d[at], &acc[m0 + r],
                           &mins[m0 + r]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(out + r * stride, _mm512_sub_ps(acc[r], mins[r]));
}

/* Q6_K: as q4k_amx, 16 values a product (one scale) */
static void q6k_amx(const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int16_t *bsums, int64_t k,
                    int64_t rows, float *out, int64_t stride) {
    kvb_amx_configure(16);
    __m512 acc[AMX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    __m512i codes[64] __attribute__((aligned(64)));
    int32_t dots[16][256] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b++, w += Q6K_TILE) {
        q6k_block blk;
        q6k_prepare(w, &blk);
        for (int ng = 0; ng < 16; ng++) q6k_codes(w, ng / 8, ng % 8, codes + 4 * ng);
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
            const int8_t *x = q + m0 * k + b * 256;
            for (int pass = 0; pass < 4; pass++) { /* scales 4 pass .. 4 pass + 3: group j = s / 2, half s % 2 */
                const int8_t *a[4];
                const void *from[4];
                for (int t = 0; t < 4; t++) {
                    const int s = 4 * pass + t, j = s / 2, half = s % 2, n = j / 4, c = j % 4;
                    a[t] = x + 32 * j + 16 * half, from[t] = &codes[4 * (8 * n + 4 * half) + c]; /* 256 bytes apart */
                }
                kvb_amx_four(a, k, from, 256, &dots[4 * pass]);
            }
            for (int r = 0; r < 16; r++) {
                const int64_t at = (m0 + r) * nb + b;
                q6k_finish(&blk, scaled_sum(dots, blk.scale, 16, r), bsums + at * 16, d[at], &acc[m0 + r], 0);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(out + r * stride, acc[r]);
}

/* `rows` activation rows (a multiple of 16, at most 64) against one Q4_K or Q6_K tile (w: its first block), as
   kvb_q4k_tile_* / kvb_q6k_tile_* compute them; returns 0, or -1 where AMX cannot be used (then nothing is done) */
int kvb_ktile_amx(int type, const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *sums,
                  int64_t k, int64_t rows, float *out, int64_t stride) {
    if (!kvb_amx() || rows % 16 || rows > AMX_ROWS || rows <= 0) return -1;
    if (type == KVB_Q4_K)
        q4k_amx(w, nb, q, d, (const int16_t *)sums, k, rows, out, stride);
    else
        q6k_amx(w, nb, q, d, (const int16_t *)sums, k, rows, out, stride);
    kvb_amx_release(); /* the thread's tile state back to its initial state: nothing to save at a switch */
    return 0;
}
#else
int kvb_ktile_amx(int type, const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *sums,
                  int64_t k, int64_t rows, float *out, int64_t stride) {
    (void)type, (void)w, (void)nb, (void)q, (void)d, (void)sums, (void)k, (void)rows, (void)out, (void)stride;
    return -1;
}
#endif
