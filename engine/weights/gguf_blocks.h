/* What the GGUF block kernel's C files share (gguf_blocks.c: activations and products; gguf_layout.c: tiles
   and values back; ktiles.c: the K-quants' tiles): the block types, their sizes, a half float's value, Q4_K's
   6-bit scales, and the thread pool (thread_pool.c). */

#ifndef KVB_GGUF_BLOCKS_H
#define KVB_GGUF_BLOCKS_H

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
/* the same over `count` jobs' items one after the other (job s: ctxs + s * size, items first[s] .. first[s + 1] - 1) */
void kvb_parallel_segments(int64_t count, const int64_t *first, kvb_task fn, void *ctxs, size_t size, int threads);

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

/* Layout A32's sums, one per activation row and block of 32: the codes' sum (Q4_0 subtracts 8 times it) and the
   block's scale times it, rounded to float (Q4_1's offsets: the weight's m times this, one fma per block) */
typedef struct {
    int32_t sum;
    float scaled;
} kvb_sum32;

static inline int block_bytes(int type) {
    return type == KVB_Q4_0 ? 18 : type == KVB_Q4_1 ? 20 : type == KVB_Q8_0 ? 34 : type == KVB_Q4_K ? 144 : 210;
}
static inline int activation_block(int type) { return type == KVB_Q4_K || type == KVB_Q6_K ? 256 : 32; }

#define KVB_TILED 256 /* added to a type: its weight is held as 16-row tiles (gguf_layout.c) */

static inline int tile_codes_start(int type) { return type == KVB_Q4_1 ? 64 : 32; } /* a 32-value tile's codes */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* The tiles' multiply-adds with four activation bytes from memory broadcast to every lane, as one instruction: the
   broadcast folded into it ({1to16}). Written as _mm512_dpwssd_epi32(acc, v, _mm512_set1_epi32(x)), gcc loads
   each broadcast by a vpbroadcastd of its own: the tiles took 2-6% longer at 1-8 rows (Q4_1 1536 x 576, one
   process alternating the two builds; Q6_K at 8 rows ~10%). The same instruction either way, so the same sums. */
typedef struct { int8_t bytes[4]; } kvb_four; /* four activation bytes (two int16, or four int8) */

static inline __attribute__((always_inline)) __m512i dpwssd_from(__m512i acc, __m512i codes, const void *four) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const kvb_four *)four));
    return acc; /* acc + the int16 pairs of codes times the pair at four, lane by lane */
}

static inline __attribute__((always_inline)) __m512i dpbusd_from(__m512i acc, __m512i codes, const void *four) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const kvb_four *)four));
    return acc; /* acc + the unsigned bytes of codes times the signed bytes at four, four to a lane */
}
#endif

/* 1 when this build multiplies weights of `type` held as tiles (gguf_blocks.c) */
int kvb_tiles(int type);
/* the K-quants' tiles (ktiles.c): a tile from 16 rows' blocks, and row c's block back */
void kvb_ktile(int type, const uint8_t *const rows[16], uint8_t *tile);
void kvb_kuntile(int type, const uint8_t *tile, int c, uint8_t *block);
/* AMX (amx.c): 1 where it multiplies tiles (the CPU has it, the OS grants it, KVBOOST_BLOCKS_AMX is not 0); its
   tile configuration for products over `values` int8, four products into dots, the tile state given back.
   kvb_ktile_amx (ktiles.c): 16n (n <= 4) activation rows against one Q4_K / Q6_K tile, the vector tiles' outputs
   bit for bit; -1 where AMX cannot be used. */
int kvb_amx(void);
void kvb_amx_configure(int values);
void kvb_amx_four(const int8_t *const a[4], int64_t k, const void *const b[4], int64_t stride, int32_t dots[4][256]);
void kvb_amx_release(void);
int kvb_ktile_amx(int type, const uint8_t *w, int64_t nb, const int8_t *q, const float *d, const int32_t *sums,
                  int64_t k, int64_t rows, float *out, int64_t stride);

/* a weight row's dot with R activation rows (R = 1, 2, 4, 8: dots[0..3]), and a 16-row tile's (R = 1 .. 8 where
   the build has them: tiles[R - 1]) (gguf_dots.c) */
typedef void (*dot_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const void *, int64_t, float *,
                       int64_t);
typedef void (*tile_fn)(const uint8_t *, int64_t, const int8_t *, const float *, const int32_t *, int64_t, float *,
                        int64_t);
int kvb_dots_for(int type, dot_fn dots[4]);
#define MAX_ROWS 8 /* activation rows multiplied at once */
int kvb_tiles_for(int type, tile_fn tiles[MAX_ROWS]); /* 0 where this build has no tiles for the type */

#endif
