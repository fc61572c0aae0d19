/* y[M,N] = x[M,K] @ W[N,K]^T with W held as blocks of 32 weights along K, in fp32 arithmetic.
 *
 * Layouts (blockq.h; blockq.py repacks each GGUF type into one of them, the K-quants' 256-weight
 * super-blocks as 8 blocks of 32 that keep the file's compact scales, multiplied out per super-block):
 * Q4_1: w = d*q + m, q in 0..15 (low nibbles: weights 0..15 of the block, high: 16..31);
 * Q4_0: w = d*(q - 8); Q5_1 and Q5_0: the same with a fifth bit per weight (a 32-bit word before
 * the nibbles, bit i for weight i) and q - 16; Q4_K and Q5_K: Q4_1's and Q5_1's blocks, d and m
 * from the super-block's fp32 d and -dmin times the block's 6-bit sc and m; Q6_K: 6-bit q - 32 (the
 * nibbles and a 2-bit high a weight), one d * sc per 16 weights; Q8_0: w = d*q, q in -128..127, one
 * d per 32 weights; Q8_S16: the same with one d per 16 weights; F16, BF16, F32: the weights themselves
 * (2 or 4 bytes each, no scales; an fp16 or bf16 value widened to fp32 is exact). Every d*q is exact in fp32 (d is an
 * fp16 value, or a fp16 value times a 6- or 8-bit integer scale, and q has at most 8 bits), so
 * fma(q, d, m) rounds once, as ggml's d*q + m does, and an offset kind adds -0.0 (the identity,
 * keeping ggml's sign of a zero weight): the kernel multiplies by the dequantised weights bit for
 * bit and differs from a dense fp32 product only in the order of its sums (as MKL's gemv and gemm do).
 *
 * Why: a CPU decode step is bound by the bytes of weights it reads; these blocks are 0.75 (q4_1),
 * 0.58 (q4_k), 0.83 (q6_k) and 1.125 (q8_0) bytes a weight against fp32's 4. A tile of R rows x C columns (tokens) keeps
 * every accumulator in a register, so a verify pass of M tokens dequantises each block
 * ceil(M / C) times, not M times. Tiles of one row read W as one stream per thread and leave
 * registers for 8 columns; tiles of 4 rows reuse each load of x 4 times but read 8 streams at once,
 * and pass a few more columns than they hold (a 5- to 8-token verify, rows side by side) to tiles of
 * 2 rows that hold them all, so no weight is dequantised twice.
 * Which is faster is the machine's (blockq_set_rows; the calibration times both): every row's sums
 * run in the same order either way, so the results are identical bit for bit. Built per machine
 * with -march=native (blockq.py), so the AVX-512 or AVX2 path is the one this CPU runs; a plain C
 * loop elsewhere. */
#include <stdint.h>
#include <string.h>
#include "blockq.h"
#include "blockq_isa.h"

int blockq_lanes(void) {
#ifdef SCALAR
    return 1;
#else
    return VW;
#endif
}


/* Layout parameters: FIVE (a fifth bit per weight: 20 bytes a block, else 16), OFF (the offset
 * subtracted from q; OFF kinds keep one fp32 d a block, the others d and m) */
#define NIB_BYTES(FIVE) ((FIVE) ? 20 : 16)
#define NIB_SCALES(OFF) ((OFF) ? 1 : 2)
/* K-quant layouts keep the file's compact scales, per row: Q4_K and Q5_K nb / 8 fp32 d, nb / 8 fp32
 * -dmin, then nb uint8 sc and nb uint8 m (3 nb / 4 floats' room); Q6_K nb / 8 fp32 d, then 2 nb
 * int8 sc (5 nb / 8 floats' room). nb (blocks of 32 a row) is a multiple of 8 (super-blocks of 256). */
#define KQ_SCALES(nb) ((size_t)(nb) * 3 / 4)
#define Q6_SCALES(nb) ((size_t)(nb) * 5 / 8)
#define Q6_BYTES 24

/* Bytes ahead of a row's current block that a tile asks the cache for (blockq_set_prefetch): where
 * memory is far (a VM's), a few KiB ahead keeps the weights streaming; the library measures the
 * machine's best distance at load (blockq.py). It changes the speed of a product, never its result. */
static int prefetch_ahead = 0;

void blockq_set_prefetch(int bytes) { prefetch_ahead = bytes < 0 ? 0 : bytes; }
int blockq_prefetch(void) { return prefetch_ahead; }

#ifndef SCALAR

#include "blockq_tiles.h"

/* columns per tile: of 4 rows (4 x C accumulators and 4 dequantised pairs in registers), of 1 row */
#if VW == 16
#define C4 4
#define C2 8
#define C1 8
#else
#define C4 2  /* AVX2 has 16 registers (2 x 5 and 2 x 6 tiles measured no faster than the panel) */
#define C2 4
#define C1 4
#endif

/* cols: the tile's columns; alone: the pass is of one token in all (two accumulators a row) */
#define DISPATCH4(TILE, cols, alone, ...) do { switch (cols) { \
    case 1: if (alone) TILE(4, 1, 2, __VA_ARGS__); else TILE(4, 1, 1, __VA_ARGS__); break; case 2: TILE(4, 2, 1, __VA_ARGS__); break; \
    case 3: TILE(4, C4 >= 3 ? 3 : 1, 1, __VA_ARGS__); break; default: TILE(4, C4, 1, __VA_ARGS__); } } while (0)
#define DISPATCH1(TILE, cols, alone, ...) do { switch (cols) { \
    case 1: if (alone) TILE(1, 1, 2, __VA_ARGS__); else TILE(1, 1, 1, __VA_ARGS__); break; case 2: TILE(1, 2, 1, __VA_ARGS__); break; \
    case 3: TILE(1, 3, 1, __VA_ARGS__); break; case 4: TILE(1, 4, 1, __VA_ARGS__); break; \
    case 5: TILE(1, C1 >= 5 ? 5 : 1, 1, __VA_ARGS__); break; case 6: TILE(1, C1 >= 6 ? 6 : 1, 1, __VA_ARGS__); break; \
    case 7: TILE(1, C1 >= 7 ? 7 : 1, 1, __VA_ARGS__); break; default: TILE(1, C1, 1, __VA_ARGS__); } } while (0)
/* One function per layout: each compiles on its own, as small as a kernel of one layout (inlined
 * into one function, the six layouts' tiles made every one of them slower). */
/* tiles of 2 rows take the columns a tile of 4 rows cannot hold (C4 < cols <= C2), all at once */
#define DISPATCH2(TILE, cols, ...) do { switch (cols) { \
    case 3: TILE(2, 3, 1, __VA_ARGS__); break; case 4: TILE(2, 4, 1, __VA_ARGS__); break; \
    case 5: TILE(2, C2 >= 5 ? 5 : 1, 1, __VA_ARGS__); break; case 6: TILE(2, C2 >= 6 ? 6 : 1, 1, __VA_ARGS__); break; \
    case 7: TILE(2, C2 >= 7 ? 7 : 1, 1, __VA_ARGS__); break; default: TILE(2, C2, 1, __VA_ARGS__); } } while (0)
#define LAYOUT_ROWS(NAME, TILE) \
    static __attribute__((noinline)) void NAME(int R, int cols, int alone, const uint8_t *q, const float *s, int nb, \
                                               const float *x, int K, float *y, int ldy) { \
        if (R == 4) DISPATCH4(TILE, cols, alone, q, s, nb, x, K, y, ldy); \
        else if (R == 2) DISPATCH2(TILE, cols, q, s, nb, x, K, y, ldy); \
        else DISPATCH1(TILE, cols, alone, q, s, nb, x, K, y, ldy); }
LAYOUT_ROWS(q4_1_rows, Q4_1_TILE)
LAYOUT_ROWS(q4_0_rows, Q4_0_TILE)
LAYOUT_ROWS(q5_1_rows, Q5_1_TILE)
LAYOUT_ROWS(q5_0_rows, Q5_0_TILE)
LAYOUT_ROWS(q8_0_rows, Q8_0_TILE)
LAYOUT_ROWS(q8_s16_rows, Q8_S16_TILE)
LAYOUT_ROWS(f16_rows, F16_TILE)
LAYOUT_ROWS(bf16_rows, BF16_TILE)
LAYOUT_ROWS(f32_rows, F32_TILE)
LAYOUT_ROWS(q4_k_rows, Q4_K_TILE)
LAYOUT_ROWS(q5_k_rows, Q5_K_TILE)
LAYOUT_ROWS(q6_k_rows, Q6_K_TILE)
#endif

#ifndef SCALAR
typedef void (*rows_fn)(int, int, int, const uint8_t *, const float *, int, const float *, int, float *, int);
static rows_fn rows_of(int kind) {
    switch (kind) {
        case Q4_1: return q4_1_rows;
        case Q4_0: return q4_0_rows;
        case Q5_1: return q5_1_rows;
        case Q5_0: return q5_0_rows;
        case Q8_S16: return q8_s16_rows;
        case F16: return f16_rows;
        case BF16: return bf16_rows;
        case F32: return f32_rows;
        case Q4_K: return q4_k_rows;
        case Q5_K: return q5_k_rows;
        case Q6_K: return q6_k_rows;
        default: return q8_0_rows;
    }
}
#endif

static int kq_kind(int kind) { return kind == Q4_K || kind == Q5_K; }
static int nibble_kind(int kind) {
    return kind == Q4_1 || kind == Q4_0 || kind == Q5_1 || kind == Q5_0 || kq_kind(kind);
}
static int five_kind(int kind) { return kind == Q5_1 || kind == Q5_0 || kind == Q5_K; }
static int offset_of(int kind) { return kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : 0; }
static int float_bytes(int kind) { return kind == F32 ? 4 : kind == F16 || kind == BF16 ? 2 : 0; }

#ifndef SCALAR
#include "blockq_panel.h"
#endif

#ifdef SCALAR
/* One row's blocks against one column of x, weight by weight (builds without AVX2). */
static float row_dot(int kind, const uint8_t *q, const float *s, int nb, const float *x) {
    float acc = 0.f;
    for (int b = 0; b < nb; b++) {
        if (nibble_kind(kind)) {
            const int five = five_kind(kind), off = offset_of(kind), S = NIB_SCALES(off);
            const uint8_t *block = q + (size_t)b * NIB_BYTES(five);
            uint32_t qh = 0;
            if (five) memcpy(&qh, block, 4);
            const uint8_t *nib = block + (five ? 4 : 0);
            const uint8_t *sm = (const uint8_t *)(s + nb / 4);
            const float d = kq_kind(kind) ? s[b >> 3] * (float)sm[b] : s[b * S];
            const float m = kq_kind(kind) ? s[nb / 8 + (b >> 3)] * (float)sm[nb + b] : off ? -0.0f : s[b * S + 1];
            for (int i = 0; i < 16; i++) {
                const int lo = (nib[i] & 15) | (int)((qh >> i) & 1) << 4, hi = (nib[i] >> 4) | (int)((qh >> (16 + i)) & 1) << 4;
                acc += (d * (float)(lo - off) + m) * x[b * 32 + i];
                acc += (d * (float)(hi - off) + m) * x[b * 32 + 16 + i];
            }
        } else if (kind == Q6_K) {
            const uint8_t *block = q + (size_t)b * Q6_BYTES;
            const int8_t *sc = (const int8_t *)(s + nb / 8);
            uint32_t w[2];
            memcpy(w, block, 8);
            for (int i = 0; i < 32; i++) {
                const int nibble = (block[8 + i % 16] >> (i < 16 ? 0 : 4)) & 15;
                const int lane = (int)(w[i % 2] >> (4 * (i % 16 / 2))) & 15;
                const int high = i < 16 ? lane & 3 : lane >> 2;
                acc += (s[b >> 3] * (float)sc[2 * b + i / 16] * (float)((nibble | high << 4) - 32)) * x[b * 32 + i];
            }
        } else if (float_bytes(kind)) {
            for (int i = 0; i < 32; i++) {
                const size_t at = (size_t)b * 32 + i;
                const float w = kind == F32 ? ((const float *)q)[at]
                              : kind == F16 ? f16_float(((const uint16_t *)q)[at]) : bf16_float(((const uint16_t *)q)[at]);
                acc += w * x[at];
            }
        } else {
            const int G = kind == Q8_S16 ? 16 : 32;
            for (int i = 0; i < 32; i++)
                acc += s[(b * 32 + i) / G] * (float)((const int8_t *)q)[b * 32 + i] * x[b * 32 + i];
        }
    }
    return acc;
}
#endif

/* Rows of W per tile: 1 or 4 (blockq_set_rows). A process-wide setting read at each call; it
 * changes the speed of a product, never its result. */
static int tile_rows = 1;

void blockq_set_rows(int rows) { tile_rows = rows == 4 ? 4 : 1; }
int blockq_rows(void) { return tile_rows; }

/* Rows in tiles of `tile_rows` (a tail of single rows), split over the threads of the enclosing
 * parallel region (an orphaned `omp for`, so the layer stack of decode_layers.c runs all its
 * products in one region; called outside one it runs on the calling thread); columns C at a time.
 * No barrier at the end (`nowait`): the caller synchronises (the region's end, or decode_layers.c's
 * own barrier). */
void block_rows(int kind, const float *x, int M, int K, const uint8_t *qs, const float *scales, float *y, int N,
                int ldy) {
    const int nb = K / 32, tile = tile_rows;
    const int nib = nibble_kind(kind), five = five_kind(kind), off = offset_of(kind);
    const int wide = float_bytes(kind);  /* float layouts: their bytes a weight, and no scales */
    const size_t row_bytes = nib ? (size_t)nb * NIB_BYTES(five) : wide ? (size_t)K * wide
                           : kind == Q6_K ? (size_t)nb * Q6_BYTES : (size_t)K;
    const size_t row_scales = wide ? 0 : kq_kind(kind) ? KQ_SCALES(nb) : kind == Q6_K ? Q6_SCALES(nb)
                            : (size_t)nb * (nib ? NIB_SCALES(off) : kind == Q8_S16 ? 2 : 1);
#ifndef SCALAR
    /* many columns: each row dequantised once into a panel (blockq_panel.h), not once per tile; up
     * to two tiles of 4 rows' columns (C2 >= 2 * C4: one tile of 2 rows') the tiles cost less than
     * the panel's stores and loads (measured on 1B-shaped layers) */
    if (M > 2 * C4) {
        float *panel = panel_of(panel_floats(K, M));
        #pragma omp for schedule(static) nowait
        for (int n = 0; n < N; n += 4) {
            const int rows = N - n < 4 ? N - n : 4, R = rows == 4 ? 4 : 1;
            for (int r0 = 0; r0 < rows; r0 += R) {
                const uint8_t *q = qs + (size_t)(n + r0) * row_bytes;
                const float *s = scales + (size_t)(n + r0) * row_scales;
                if (panel) {
                    panel_rows(kind, R, q, s, row_bytes, row_scales, nb, x, M, K, panel, y + n + r0, ldy);
                    continue;
                }
                for (int r = 0; r < R; r++)  /* no memory for a panel: tiles of one row (the same sums) */
                    for (int j0 = 0; j0 < M; j0 += C1)
                        rows_of(kind)(1, M - j0 < C1 ? M - j0 : C1, 0, q + r * row_bytes, s + r * row_scales, nb,
                                      x + (size_t)j0 * K, K, y + n + r0 + r + (size_t)j0 * ldy, ldy);
            }
        }
        return;
    }
#endif
    #pragma omp for schedule(static) nowait
    for (int n = 0; n < N; n += tile) {
        const int rows = N - n < tile ? N - n : tile;
        const int R = rows == 4 ? 4 : 1;
        for (int r0 = 0; r0 < rows; r0 += R) {
            const uint8_t *q = qs + (size_t)(n + r0) * row_bytes;
            const float *s = scales + (size_t)(n + r0) * row_scales;
            float *yr = y + n + r0;
#ifdef SCALAR
            for (int r = 0; r < R; r++)
                for (int j = 0; j < M; j++)
                    yr[(size_t)j * ldy + r] = row_dot(kind, q + r * row_bytes, s + r * row_scales, nb, x + (size_t)j * K);
#else
            if (R == 4 && M > C4 && M <= C2) {  /* 2 rows x every column, twice: one dequantisation */
                for (int r = 0; r < 4; r += 2)
                    rows_of(kind)(2, M, 0, q + r * row_bytes, s + r * row_scales, nb, x, K, yr + r, ldy);
                continue;
            }
            const int C = R == 4 ? C4 : C1;
            for (int j0 = 0; j0 < M;) {
                const int step = M - j0 >= C ? C : M - j0;
                const float *xj = x + (size_t)j0 * K;
                float *yj = yr + (size_t)j0 * ldy;
                rows_of(kind)(R, step, M == 1, q, s, nb, xj, K, yj, ldy);
                j0 += step;
            }
#endif
        }
    }
}

/* y[M,N] = x[M,K] @ W[N,K]^T for one weight of layout `kind`, on `threads` threads. */
void block_mm(int kind, const float *x, int M, int K, const uint8_t *qs, const float *scales, float *y, int N,
              int threads) {
    #pragma omp parallel num_threads(threads)
    block_rows(kind, x, M, K, qs, scales, y, N, N);
}
