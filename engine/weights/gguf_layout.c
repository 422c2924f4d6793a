/* GGUF weights' bytes in the kernel's other orders, and back to float32: the 16-row tiles kvb_repack makes
   (the 32-value types' layout below; the K-quants' in ktiles.c) and kvb_dequantize's rows, gguf-py's values
   bit for bit (built with -ffp-contract=off). The block formats are described in gguf_blocks.c. */

#include "gguf_blocks.h"

/* ---- 16-row tiles: the layout the vector kernels read (kvb_repack) ----
   A weight whose row count is a multiple of 16, of a 32-value type, is held as tiles of 16 rows: tile t, block b is
   the 16 rows' block b side by side, 16 * block_bytes bytes (the file's scales and codes, in another order):
     16 fp16 d (row c at 2c); Q4_1: 16 fp16 m; then the codes, pair by pair (pair p: values 2p and 2p + 1):
     Q8_0  pair p at 32 p: row c's two int8 codes at 2c, 2c + 1
     Q4_*  four pairs in each 64 bytes (pairs 4g .. 4g + 3 at 64 g), as 32 16-bit words: word 2c + j holds value
           j of row c's pairs 4g + s in its nibble s (bits 4s .. 4s + 3, little-endian).
   So a pair of all 16 rows widens to one vector of 16 int32 lanes, each two int16 codes of one row: a Q4 pair is
   the 64 bytes shifted right by 4s in 16-bit lanes, masked to 4 bits (no mask for s = 3). */


/* where code i of row c lies in a tiled block's codes: the byte, and in a Q4 type which nibble (*high) */
static inline int tile_code_at(int type, int c, int i, int *high) {
    const int p = i / 2, j = i % 2;
    if (type == KVB_Q8_0) {
        *high = 0;
        return 32 * p + 2 * c + j;
    }
    *high = p % 2;
    return 64 * (p / 4) + 2 * (2 * c + j) + p % 4 / 2;
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

/* out[i, :] = row idx[i] of W (n rows), for n_idx rows; type + KVB_TILED: W held as tiles. Returns 0, -1 for a
   type this file does not read, or -3 (nothing written) where an index is not a row of W. */
int kvb_dequantize(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes, const int64_t *idx,
                   int64_t n_idx, float *out, int threads) {
    for (int64_t i = 0; i < n_idx; i++)
        if (idx[i] < 0 || idx[i] >= n) return -3;
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
