/* AMX (Intel's tile registers, Sapphire Rapids and later) for the block kernel's prefills: whether it can be used
   here (the CPU has it, the OS grants the process its tile state, $KVBOOST_BLOCKS_AMX is not "0"), its tile
   configuration, and four exact int8 dots of 16 activation rows by a tile's 16 weight rows at once (TDPBSUD:
   signed int8 times unsigned int8 into int32). ktiles.c multiplies the K-quants' tiles with them.

   The 32-value types' tiles were tried here too (their int16 activations split into a signed high and an unsigned
   low byte, two dots a block): 0.7-0.95x the vector tiles, whose int16 products already run at float32 GEMM's
   speed; their per-block float steps, not the products, bound them. Not kept. Tried again for a batched step's
   6-8 rows (blocks pipelined, one vpermb to lay out 64 bytes of codes; the same bits): 0.99-1.08x the vector
   tiles' time at 7-8 rows, 2.1x at one (a 2-vCPU Xeon, one thread, Q4_1 1536 x 576): storing each block's two
   integer sums out of the tile registers, before its scales can apply, bounds them. docs/benchmarks.md has the
   numbers ("On the Xeon again"). */

#define _GNU_SOURCE /* syscall() */
#include "gguf_blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__) && defined(__linux__) /* arch_prctl */
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

#else
int kvb_amx(void) { return 0; }
void kvb_amx_configure(int values) { (void)values; }
void kvb_amx_release(void) {}
void kvb_amx_four(const int8_t *const a[4], int64_t k, const void *const b[4], int64_t stride, int32_t dots[4][256]) {
    (void)a, (void)k, (void)b, (void)stride, (void)dots;
}
#endif
