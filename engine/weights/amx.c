/* AMX (Intel's tile registers, Sapphire Rapids and later) for the block kernel's prefills: 16 activation rows
   times a tile's 16 weight rows over one block in a few instructions, where the vector kernels take one row at a
   time. Used where the CPU has it, the OS grants the process its tile state and $KVBOOST_BLOCKS_AMX is not "0".

   Every product here is an exact integer dot (TDPB*D: int8 times int8 into int32), and what follows it is the
   vector tiles' own integer scaling and float steps, lane for lane: a row's output is the same bits whether AMX,
   the vector tiles or the rows computed it, and whatever other rows came with it.

   The 32-value types' activations are int16 (gguf_blocks.c): each is split into a signed high byte and an
   unsigned low byte (x = 256 h + l, exactly), and a block's dot is 256 (codes . h) + (codes . l). The K-quants'
   tiles (ktiles.c) use the helpers below with their int8 activations. */

#define _GNU_SOURCE /* syscall() */
#include "gguf_blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#include <stdatomic.h>
#include <sys/syscall.h>
#include <unistd.h>

static _Atomic int amx_state; /* 0: not asked yet; 1: granted; -1: not available or turned off */

int kvb_amx(void) {
    int state = atomic_load(&amx_state);
    if (state == 0) {
        const char *off = getenv("KVBOOST_BLOCKS_AMX");
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): the process may use the tile registers */
        state = (off && off[0] == '0') ? -1 : syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        atomic_store(&amx_state, state);
    }
    return state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* tiles 0-3: 16 x 16 int32 dots; 4 and 6: 16 activation rows of `values` int8; 5 and 7: the weights' codes for
   them, `values` / 4 rows of 16 columns x 4 */
void kvb_amx_configure(int values) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 4; t < 8; t += 2) c.colsb[t] = (uint16_t)values, c.rows[t] = 16;
    for (int t = 5; t < 8; t += 2) c.colsb[t] = 64, c.rows[t] = (uint8_t)(values / 4);
    /* gcc does not see that LDTILECFG reads the fields and drops their stores (the tiles then have no rows and
       the next tile instruction faults): a barrier that takes the struct's address keeps them */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

void kvb_amx_release(void) { _tile_release(); }

/* dots[t][r * 16 + c] for four products t: signed activations a[t] (16 rows, k apart) times unsigned codes b[t]
   (stride bytes between their rows) */
void kvb_amx_four(const int8_t *const a[4], int64_t k, const void *const b[4], int64_t stride, int32_t dots[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, a[0], k);
    _tile_loadd(5, b[0], stride);
    _tile_dpbsud(0, 4, 5);
    _tile_loadd(6, a[1], k);
    _tile_loadd(7, b[1], stride);
    _tile_dpbsud(1, 6, 7);
    _tile_loadd(4, a[2], k);
    _tile_loadd(5, b[2], stride);
    _tile_dpbsud(2, 4, 5);
    _tile_loadd(6, a[3], k);
    _tile_loadd(7, b[3], stride);
    _tile_dpbsud(3, 6, 7);
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    _tile_stored(2, dots[2], 64);
    _tile_stored(3, dots[3], 64);
}

/* a 32-value tile block's codes (gguf_layout.c's layout) as AMX reads them: 8 rows (values 4kk .. 4kk + 3) of 16
   columns (weight rows) x 4 bytes. A tile holds a pair of values per row in 16 bits: pairs 2kk and 2kk + 1 lie in
   the two 32-byte halves of 64 bytes, so interleaving the halves' 16-bit words gives the row. */
static void tile32_codes(int type, const uint8_t *t, __m512i b[8]) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i low = _mm512_set1_epi8(0x0f);
    const uint8_t *codes = t + tile_codes_start(type);
    if (type == KVB_Q8_0) {
        for (int kk = 0; kk < 8; kk++)
            b[kk] = _mm512_permutexvar_epi16(order, _mm512_loadu_si512((const void *)(codes + 64 * kk)));
        return;
    }
    for (int g = 0; g < 4; g++) { /* pairs 4g, 4g + 1 in the low nibbles, 4g + 2, 4g + 3 in the high ones */
        const __m512i raw = _mm512_permutexvar_epi16(order, _mm512_loadu_si512((const void *)(codes + 64 * g)));
        b[2 * g] = _mm512_and_si512(raw, low);
        b[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
}

/* the integer dots of 16 rows of high bytes h and low bytes l (k apart) with the codes b (8 rows of 64 bytes) for
   two blocks: dots[2i] high, dots[2i + 1] low, block i. Q4_0 / Q4_1 codes are unsigned, Q8_0's signed. */
static void tile32_dots(int type, const int8_t *const h[2], const uint8_t *const l[2], int64_t k,
                        const __m512i *const b[2], int32_t dots[4][256]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int i = 0; i < 2; i++) {
        _tile_loadd(5, b[i], 64);
        _tile_loadd(4, h[i], k);
        _tile_loadd(6, l[i], k);
        if (type == KVB_Q8_0) {
            if (i == 0) {
                _tile_dpbssd(0, 4, 5);
                _tile_dpbusd(1, 6, 5);
            } else {
                _tile_dpbssd(2, 4, 5);
                _tile_dpbusd(3, 6, 5);
            }
        } else {
            if (i == 0) {
                _tile_dpbsud(0, 4, 5);
                _tile_dpbuud(1, 6, 5);
            } else {
                _tile_dpbsud(2, 4, 5);
                _tile_dpbuud(3, 6, 5);
            }
        }
    }
    _tile_stored(0, dots[0], 64);
    _tile_stored(1, dots[1], 64);
    _tile_stored(2, dots[2], 64);
    _tile_stored(3, dots[3], 64);
}

#define AMX_ROWS 64 /* activation rows a call takes at most (gguf_blocks.c's M_BLOCK) */

/* `rows` (16n, at most 64) activation rows against one 32-value tile (w: its first block, nb blocks), as
   gguf_dots.c's tile32 computes them: hl the rows' int16 codes split into high bytes [rows, k] then low bytes
   [rows, k]; d, s the rows' scales and code sums per block. out[r * stride + c]. Returns 0, or -1 where AMX
   cannot be used (nothing done). */
int kvb_tile32_amx(int type, const uint8_t *w, int64_t nb, const int8_t *hl, int64_t all_rows, const float *d,
                   const int32_t *s, int64_t k, int64_t rows, float *out, int64_t stride) {
    if (!kvb_amx() || rows % 16 || rows > AMX_ROWS || rows <= 0 || nb % 2) return -1;
    kvb_amx_configure(32);
    const int64_t bytes = 16 * (type == KVB_Q4_0 ? 18 : type == KVB_Q4_1 ? 20 : 34);
    const int8_t *high = hl;
    const uint8_t *low = (const uint8_t *)hl + all_rows * k;
    __m512 acc[AMX_ROWS], offsets[AMX_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = offsets[r] = _mm512_setzero_ps();
    __m512i codes[2][8] __attribute__((aligned(64)));
    int32_t dots[4][256] __attribute__((aligned(64)));
    for (int64_t b = 0; b < nb; b += 2) { /* two blocks a round, each row's float steps in block order */
        const uint8_t *t[2] = {w + b * bytes, w + (b + 1) * bytes};
        tile32_codes(type, t[0], codes[0]);
        tile32_codes(type, t[1], codes[1]);
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
            const int8_t *h[2] = {high + m0 * k + b * 32, high + m0 * k + (b + 1) * 32};
            const uint8_t *l[2] = {low + m0 * k + b * 32, low + m0 * k + (b + 1) * 32};
            const __m512i *from[2] = {codes[0], codes[1]};
            tile32_dots(type, h, l, k, from, dots);
            for (int i = 0; i < 2; i++) {
                const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)t[i]));
                const __m512 mw = type == KVB_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t[i] + 32)))
                                                   : _mm512_setzero_ps();
                for (int r = 0; r < 16; r++) {
                    const int64_t at = (m0 + r) * nb + b + i;
                    __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(dots[2 * i] + 16 * r), 8),
                                                   _mm512_load_si512(dots[2 * i + 1] + 16 * r));
                    if (type == KVB_Q4_0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(8 * s[at]));
                    const __m512 dr = _mm512_set1_ps(d[at]);
                    acc[m0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, dr), acc[m0 + r]);
                    if (type == KVB_Q4_1)
                        offsets[m0 + r] = _mm512_add_ps(offsets[m0 + r], _mm512_mul_ps(_mm512_mul_ps(mw, dr),
                                                                                       _mm512_set1_ps((float)s[at])));
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) _mm512_storeu_ps(out + r * stride, _mm512_add_ps(acc[r], offsets[r]));
    _tile_release();
    return 0;
}
#else
int kvb_amx(void) { return 0; }
void kvb_amx_configure(int values) { (void)values; }
void kvb_amx_release(void) {}
void kvb_amx_four(const int8_t *const a[4], int64_t k, const void *const b[4], int64_t stride, int32_t dots[4][256]) {
    (void)a, (void)k, (void)b, (void)stride, (void)dots;
}
int kvb_tile32_amx(int type, const uint8_t *w, int64_t nb, const int8_t *hl, int64_t all_rows, const float *d,
                   const int32_t *s, int64_t k, int64_t rows, float *out, int64_t stride) {
    (void)type, (void)w, (void)nb, (void)hl, (void)all_rows, (void)d, (void)s, (void)k, (void)rows, (void)out;
    (void)stride;
    return -1;
}
#endif
