/* The panel path of blockq.c for products of many tokens (rows side by side, a long verify pass, a
 * prompt piece): each group of 4 weight rows is dequantised once, a chunk of weights at a time, into
 * a thread's fp32 panel (the same values the tiles compute), then every column of x runs against
 * the panel in register tiles of 4 rows x PC columns. A tile of blockq.c dequantises its rows again
 * for every C columns, which at 16-128 tokens cost about as much as the products; here a row is
 * dequantised once per call.
 * Each row's sums run in the order of the tiles' one-accumulator pass (the halves order of the 4-
 * and 6-bit layouts, the natural one of the others), so the results equal theirs bit for bit.
 * Included by blockq.c only, after its layouts and dequantising loads. */
#include <stdlib.h>

#if VW == 16
#define PC 6  /* 24 accumulators, 4 weights and one x: 29 of AVX-512's 32 registers */
#else
#define PC 2  /* AVX2's 16 registers: 8 accumulators, 4 weights, one x */
#endif

static __thread float *panel_buf;
static __thread size_t panel_cap;

/* This thread's panel of at least `floats` floats (grown, never shrunk); NULL if memory ran out. */
static float *panel_of(size_t floats) {
    if (floats > panel_cap) {
        free(panel_buf);
        panel_cap = 0;
        panel_buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (panel_buf) panel_cap = floats;
    }
    return panel_buf;
}

/* Blocks b0 .. b1 - 1 of one row of a 4- or 5-bit layout (its blocks q, its scales s; nb blocks a
 * row) dequantised into w[(b1 - b0) * 32]; b0 a multiple of 8 (a K-quant's super-block). */
INLINE void unpack_q4(const int FIVE, const int OFF, const int KQ, const uint8_t *q, const float *s, int nb, int b0,
                      int b1, float *w) {
    const int P = NIB_BYTES(FIVE), S = NIB_SCALES(OFF);
    float kd[8], km[8];
    w -= (size_t)b0 * 32;
    for (int b = b0; b < b1; b++) {
        if (KQ && (b & 7) == 0) kq_scales8(s, nb, b >> 3, kd, km);
        const uint8_t *block = q + (size_t)b * P;
        __builtin_prefetch(block + prefetch_ahead);
        uint32_t qh = 0;
        if (FIVE) memcpy(&qh, block, 4);
        const float dr = KQ ? kd[b & 7] : s[(size_t)b * S];
        const float mr = KQ ? km[b & 7] : OFF ? -0.0f : s[(size_t)b * S + S - 1];
        for (int h = 0; h < 16; h += VW) {
            vf lo, hi;
            dequant_q4(FIVE, OFF, block + P - 16 + h, qh, h, VSET1(dr), VSET1(mr), &lo, &hi);
            VSTORE(w + b * 32 + h, lo);
            VSTORE(w + b * 32 + 16 + h, hi);
        }
    }
}

INLINE void unpack_q6(const uint8_t *q, const float *s, int nb, int b0, int b1, float *w) {
    float kd[16], km[16];
    w -= (size_t)b0 * 32;
    for (int b = b0; b < b1; b++) {
        if ((b & 7) == 0) q6_scales16(s, nb, b >> 3, kd, km);
        const int i = 2 * (b & 7);
        __builtin_prefetch(q + (size_t)b * Q6_BYTES + prefetch_ahead);
        for (int h = 0; h < 16; h += VW) {
            vf lo, hi;
            dequant_q6(q + (size_t)b * Q6_BYTES, h, VSET1(kd[i]), VSET1(kd[i + 1]), VSET1(km[i]), VSET1(km[i + 1]),
                       &lo, &hi);
            VSTORE(w + b * 32 + h, lo);
            VSTORE(w + b * 32 + 16 + h, hi);
        }
    }
}

INLINE void unpack_q8(const int G, const int8_t *q, const float *s, int b0, int b1, float *w) {
    const int S = 32 / G;
    w -= (size_t)b0 * 32;
    for (int b = b0; b < b1; b++) {
        __builtin_prefetch(q + (size_t)b * 32 + prefetch_ahead);
        for (int h = 0; h < 32; h += VW)
            VSTORE(w + b * 32 + h, bytes_s8(q + (size_t)b * 32 + h) * VSET1(s[(size_t)b * S + h / G]));
    }
}

static __attribute__((noinline)) void unpack_row(int kind, const uint8_t *q, const float *s, int nb, int b0, int b1,
                                                 float *w) {
    switch (kind) {
        case Q4_1: unpack_q4(0, 0, 0, q, s, nb, b0, b1, w); break;
        case Q4_0: unpack_q4(0, 8, 0, q, s, nb, b0, b1, w); break;
        case Q5_1: unpack_q4(1, 0, 0, q, s, nb, b0, b1, w); break;
        case Q5_0: unpack_q4(1, 16, 0, q, s, nb, b0, b1, w); break;
        case Q4_K: unpack_q4(0, 0, 1, q, s, nb, b0, b1, w); break;
        case Q5_K: unpack_q4(1, 0, 1, q, s, nb, b0, b1, w); break;
        case Q6_K: unpack_q6(q, s, nb, b0, b1, w); break;
        case Q8_S16: unpack_q8(16, (const int8_t *)q, s, b0, b1, w); break;
        case F16: case BF16: case F32:
            for (int k = b0 * 32; k < b1 * 32; k += VW) VSTORE(w + k - b0 * 32, load_floats(kind, q, (size_t)k));
            break;
        default: unpack_q8(32, (const int8_t *)q, s, b0, b1, w);
    }
}

/* R rows of a panel chunk (n floats a row) against C columns of x (K apart), every accumulator in
 * a register; acc: the tile's sums so far ([R][C] vectors, carried from chunk to chunk in memory,
 * so each sum runs in one order whatever the chunking), zero at the first chunk, reduced into y at
 * the last. HALVES: a block's vectors in the halves order (low and high half at one offset, then
 * the next offset), else in order. */
INLINE void panel_tile(const int R, const int C, const int HALVES, const float *w, int n, const float *x, int K,
                       vf *saved, int first, int last, float *y, int ldy) {
    vf acc[4][PC];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = first ? VZERO : saved[r * PC + c];
    for (int b = 0; b < n; b += 32)
        for (int j = 0; j < 32 / VW; j++) {
            const int k = b + (HALVES ? (j & 1) * 16 + (j >> 1) * VW : j * VW);
            vf wv[4];
            for (int r = 0; r < R; r++) wv[r] = VLOAD(w + (size_t)r * n + k);
            for (int c = 0; c < C; c++) {
                const vf xv = VLOAD(x + (size_t)c * K + k);
                for (int r = 0; r < R; r++) acc[r][c] = VFMA(wv[r], xv, acc[r][c]);
            }
        }
    for (int c = 0; c < C; c++) {
        if (!last)
            for (int r = 0; r < R; r++) saved[r * PC + c] = acc[r][c];
        else if (R == 4) VSUM4(acc[0][c], acc[1][c], acc[2][c], acc[3][c], y + (size_t)c * ldy);
        else y[(size_t)c * ldy] = VSUM(acc[0][c]);  /* R == 1 */
    }
}

#define PANEL_COLS(R, H, cols, ...) do { switch (cols) { \
    case 1: panel_tile(R, 1, H, __VA_ARGS__); break; case 2: panel_tile(R, PC >= 2 ? 2 : 1, H, __VA_ARGS__); break; \
    case 3: panel_tile(R, PC >= 3 ? 3 : 1, H, __VA_ARGS__); break; case 4: panel_tile(R, PC >= 4 ? 4 : 1, H, __VA_ARGS__); break; \
    case 5: panel_tile(R, PC >= 5 ? 5 : 1, H, __VA_ARGS__); break; default: panel_tile(R, PC, H, __VA_ARGS__); } } while (0)

/* Weights of a panel chunk: K split into equal chunks of at most PANEL_K, each a multiple of 256
 * (a K-quant's super-block), so 4 rows of a chunk and a few columns of x stay in a core's caches. */
#define PANEL_K 1024

static int panel_chunk(int K) {
    const int chunks = (K + PANEL_K - 1) / PANEL_K, n = ((K + chunks - 1) / chunks + 255) / 256 * 256;
    return n < K ? n : K;
}

/* Floats of a thread's panel for rows of K weights and M columns: the chunk, then the columns'
 * carried sums (4 x PC vectors per PC columns). */
static size_t panel_floats(int K, int M) {
    return (size_t)4 * panel_chunk(K) + (size_t)4 * VW * ((M + PC - 1) / PC) * PC;
}

/* rows (4, or 1 for a tail row) of W (blocks q, scales s, row_bytes and row_scales apart) against
 * M columns of x: chunk by chunk of PANEL_K weights, each dequantised into the panel and run against
 * every column, PC at a time. */
static __attribute__((noinline)) void panel_rows(int kind, int rows, const uint8_t *q, const float *s,
                                                 size_t row_bytes, size_t row_scales, int nb, const float *x, int M,
                                                 int K, float *panel, float *y, int ldy) {
    const int halves = nibble_kind(kind) || kind == Q6_K;
    const int chunk = panel_chunk(K);
    vf *saved = (vf *)(panel + (size_t)4 * chunk);
    for (int k0 = 0; k0 < K; k0 += chunk) {
        const int n = K - k0 < chunk ? K - k0 : chunk, first = k0 == 0, last = k0 + n == K;
        for (int r = 0; r < rows; r++)
            unpack_row(kind, q + r * row_bytes, s + r * row_scales, nb, k0 / 32, (k0 + n) / 32, panel + (size_t)r * n);
        for (int j0 = 0; j0 < M;) {
            const int step = M - j0 >= PC ? PC : M - j0;
            const float *xj = x + (size_t)j0 * K + k0;
            float *yj = y + (size_t)j0 * ldy;
            vf *sv = saved + (size_t)j0 * 4;  /* 4 x PC vectors per PC columns */
            if (rows == 4 && halves) PANEL_COLS(4, 1, step, panel, n, xj, K, sv, first, last, yj, ldy);
            else if (rows == 4) PANEL_COLS(4, 0, step, panel, n, xj, K, sv, first, last, yj, ldy);
            else if (halves) PANEL_COLS(1, 1, step, panel, n, xj, K, sv, first, last, yj, ldy);
            else PANEL_COLS(1, 0, step, panel, n, xj, K, sv, first, last, yj, ldy);
            j0 += step;
        }
    }
}
