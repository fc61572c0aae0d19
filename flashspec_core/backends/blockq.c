/* y[M,N] = x[M,K] @ W[N,K]^T with W held as blocks of 32 weights along K, in fp32 arithmetic.
 *
 * Layouts (blockq.h; blockq.py repacks each GGUF type into one of them, the K-quants' 256-weight
 * super-blocks as 8 blocks of 32 with their scales multiplied out):
 * Q4_1: w = d*q + m, q in 0..15 (low nibbles: weights 0..15 of the block, high: 16..31);
 * Q4_0: w = d*(q - 8); Q5_1 and Q5_0: the same with a fifth bit per weight (a 32-bit word before
 * the nibbles, bit i for weight i) and q - 16; Q8_0: w = d*q, q in -128..127, one d per 32
 * weights; Q8_S16: the same with one d per 16 weights (Q6_K); F16, BF16, F32: the weights themselves
 * (2 or 4 bytes each, no scales; an fp16 or bf16 value widened to fp32 is exact). Every d*q is exact in fp32 (d is an
 * fp16 value, or a fp16 value times a 6- or 8-bit integer scale, and q has at most 8 bits), so
 * fma(q, d, m) rounds once, as ggml's d*q + m does, and an offset kind adds -0.0 (the identity,
 * keeping ggml's sign of a zero weight): the kernel multiplies by the dequantised weights bit for
 * bit and differs from a dense fp32 product only in the order of its sums (as MKL's gemv and gemm do).
 *
 * Why: a CPU decode step is bound by the bytes of weights it reads; these blocks are 0.75 (q4_1)
 * and 1.125 (q8_0) bytes a weight against fp32's 4. A tile of R rows x C columns (tokens) keeps
 * every accumulator in a register, so a verify pass of M tokens dequantises each block
 * ceil(M / C) times, not M times. Tiles of one row read W as one stream per thread and leave
 * registers for 8 columns; tiles of 4 rows reuse each load of x 4 times but read 8 streams at once.
 * Which is faster is the machine's (blockq_set_rows; the calibration times both): every row's sums
 * run in the same order either way, so the results are identical bit for bit. Built per machine
 * with -march=native (blockq.py), so the AVX-512 or AVX2 path is the one this CPU runs; a plain C
 * loop elsewhere. */
#include <stdint.h>
#include <string.h>
#include "blockq.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* One fp16 or bf16 value (its bits) as fp32, exactly: bf16 is fp32's high half; an fp16 normal
 * number rebiases its exponent, a subnormal one is man * 2^-24 (exact), inf and NaN keep theirs. */
static inline float bf16_float(uint16_t h) {
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}
static inline float f16_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    union { uint32_t u; float f; } v = { .u = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | man << 13 };
    return v.f;
}

#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
#define VZERO _mm512_setzero_ps()
#define VSET1 _mm512_set1_ps
#define VLOAD _mm512_loadu_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
#define VSUM _mm512_reduce_add_ps
/* 16 bytes of nibbles -> weights 0..15 (low nibbles) and 16..31 (high) as d*q + m: the 16 values
 * d*i + m are one FMA over 0..15, and each nibble picks its value by a permute (which reads only
 * an index's low 4 bits, so the low nibbles need no mask): 5 vector ops where converting every
 * nibble and scaling it took 8. */
INLINE void dequant_q4(const int FIVE, const int OFF, const uint8_t *p, uint32_t qh, int h, vf d, vf m, vf *lo,
                       vf *hi) {
    (void)h;  /* 16 lanes: one step a block */
    const vf iota = _mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                  _mm512_set1_ps((float)OFF));
    const vf table = _mm512_fmadd_ps(iota, d, m);
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (!FIVE) {
        *lo = _mm512_permutexvar_ps(v, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
        return;
    }
    /* 5-bit indices into 32 values (two tables): the fifth bit of weight i is bit i of qh */
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bits = _mm512_set1_epi32((int)qh), one = _mm512_set1_epi32(1), low = _mm512_set1_epi32(15);
    const vf upper = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d, m);
    __m512i il = _mm512_or_si512(_mm512_and_si512(v, low),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, lanes), one), 4));
    __m512i ih = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_slli_epi32(_mm512_and_si512(
        _mm512_srlv_epi32(bits, _mm512_add_epi32(lanes, _mm512_set1_epi32(16))), one), 4));
    *lo = _mm512_permutex2var_ps(table, il, upper);
    *hi = _mm512_permutex2var_ps(table, ih, upper);
}
static inline vf bytes_s8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 fp16 or bf16 weights as fp32 (exact) */
static inline vf halves_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf halves_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 vf;
#define VW 8
#define VZERO _mm256_setzero_ps()
#define VSET1 _mm256_set1_ps
#define VLOAD _mm256_loadu_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
static inline float VSUM(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 8 bytes of nibbles (weights h.. of the block) -> 8 weights from the low nibbles and 8 from the
 * high ones, as (q - OFF)*d + m; FIVE: the fifth bit of weight i is bit i of qh */
INLINE void dequant_q4(const int FIVE, const int OFF, const uint8_t *p, uint32_t qh, int h, vf d, vf m, vf *lo,
                       vf *hi) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i il = _mm256_and_si256(v, _mm256_set1_epi32(15)), ih = _mm256_srli_epi32(v, 4);
    if (FIVE) {
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
        const __m256i bits = _mm256_set1_epi32((int)qh);
        il = _mm256_or_si256(il, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
            bits, _mm256_add_epi32(lanes, _mm256_set1_epi32(h))), one), 4));
        ih = _mm256_or_si256(ih, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(
            bits, _mm256_add_epi32(lanes, _mm256_set1_epi32(16 + h))), one), 4));
    }
    const __m256i off = _mm256_set1_epi32(OFF);
    *lo = VFMA(_mm256_cvtepi32_ps(_mm256_sub_epi32(il, off)), d, m);
    *hi = VFMA(_mm256_cvtepi32_ps(_mm256_sub_epi32(ih, off)), d, m);
}
static inline vf bytes_s8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* 8 fp16 or bf16 weights as fp32 (exact); without F16C, one value at a time */
static inline vf halves_f16(const uint16_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float w[8];
    for (int i = 0; i < 8; i++) w[i] = f16_float(p[i]);
    return _mm256_loadu_ps(w);
#endif
}
static inline vf halves_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#else
#define SCALAR 1
#endif

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

#ifndef SCALAR
/* One tile: R rows of W against C columns of x, every accumulator in a register. A = 2 (a pass of
 * one token) sums each row into two accumulators (the low and high halves of a 4- or 5-bit block,
 * alternate vectors of an 8-bit block) added at the end: one chain of dependent FMAs would bound
 * such a pass, not the arithmetic. The order of a row's sums depends on A only, never on R. y's
 * columns are ldy apart. */
INLINE void q4_tile(const int R, const int C, const int A, const int FIVE, const int OFF, const uint8_t *q,
                    const float *s, int nb, const float *x, int K, float *y, int ldy) {
    const int P = NIB_BYTES(FIVE), S = NIB_SCALES(OFF);
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int a = 0; a < A; a++) acc[r][c][a] = VZERO;
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < 16; h += VW) {
            vf lo[4], hi[4];
            for (int r = 0; r < R; r++) {
                const float *sr = s + ((size_t)r * nb + b) * S;
                const uint8_t *block = q + ((size_t)r * nb + b) * P;
                uint32_t qh = 0;
                if (FIVE) memcpy(&qh, block, 4);
                const vf d = VSET1(sr[0]), m = VSET1(OFF ? -0.0f : sr[S - 1]);
                dequant_q4(FIVE, OFF, block + P - 16 + h, qh, h, d, m, &lo[r], &hi[r]);
            }
            for (int c = 0; c < C; c++) {
                const vf xl = VLOAD(x + (size_t)c * K + b * 32 + h), xh = VLOAD(x + (size_t)c * K + b * 32 + 16 + h);
                for (int r = 0; r < R; r++) {
                    acc[r][c][0] = VFMA(lo[r], xl, acc[r][c][0]);
                    acc[r][c][A - 1] = VFMA(hi[r], xh, acc[r][c][A - 1]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ldy + r] = VSUM(A == 2 ? VADD(acc[r][c][0], acc[r][c][1]) : acc[r][c][0]);
}

/* G: weights per scale (32, or 16 for Q8_S16) */
INLINE void q8_tile(const int R, const int C, const int A, const int G, const int8_t *q, const float *s, int nb,
                    const float *x, int K, float *y, int ldy) {
    const int S = 32 / G;
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int a = 0; a < A; a++) acc[r][c][a] = VZERO;
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < 32; h += VW) {
            const int a = h / VW % A;
            vf w[4];
            for (int r = 0; r < R; r++)
                w[r] = bytes_s8(q + (size_t)r * K + b * 32 + h) * VSET1(s[((size_t)r * nb + b) * S + h / G]);
            for (int c = 0; c < C; c++) {
                const vf xv = VLOAD(x + (size_t)c * K + b * 32 + h);
                for (int r = 0; r < R; r++) acc[r][c][a] = VFMA(w[r], xv, acc[r][c][a]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ldy + r] = VSUM(A == 2 ? VADD(acc[r][c][0], acc[r][c][1]) : acc[r][c][0]);
}

/* VW weights from index i of a row of float layout FMT (F16, BF16, F32) as fp32 */
INLINE vf load_floats(const int FMT, const uint8_t *row, size_t i) {
    if (FMT == F32) return VLOAD((const float *)row + i);
    return FMT == F16 ? halves_f16((const uint16_t *)row + i) : halves_bf16((const uint16_t *)row + i);
}

/* The float layouts' tile: as q8_tile, the weights read as they are (SZ bytes each, no scales). */
INLINE void float_tile(const int R, const int C, const int A, const int FMT, const uint8_t *q, const float *s,
                       int nb, const float *x, int K, float *y, int ldy) {
    (void)s;
    const size_t row = (size_t)K * (FMT == F32 ? 4 : 2);
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int a = 0; a < A; a++) acc[r][c][a] = VZERO;
    for (int b = 0; b < nb; b++) {
        for (int h = 0; h < 32; h += VW) {
            const int a = h / VW % A;
            vf w[4];
            for (int r = 0; r < R; r++) w[r] = load_floats(FMT, q + r * row, (size_t)b * 32 + h);
            for (int c = 0; c < C; c++) {
                const vf xv = VLOAD(x + (size_t)c * K + b * 32 + h);
                for (int r = 0; r < R; r++) acc[r][c][a] = VFMA(w[r], xv, acc[r][c][a]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(size_t)c * ldy + r] = VSUM(A == 2 ? VADD(acc[r][c][0], acc[r][c][1]) : acc[r][c][0]);
}

/* one tile function per layout (the dispatch macros below take a tile by name) */
#define Q4_1_TILE(R, C, A, ...) q4_tile(R, C, A, 0, 0, __VA_ARGS__)
#define Q4_0_TILE(R, C, A, ...) q4_tile(R, C, A, 0, 8, __VA_ARGS__)
#define Q5_1_TILE(R, C, A, ...) q4_tile(R, C, A, 1, 0, __VA_ARGS__)
#define Q5_0_TILE(R, C, A, ...) q4_tile(R, C, A, 1, 16, __VA_ARGS__)
#define Q8_0_TILE(R, C, A, q, ...) q8_tile(R, C, A, 32, (const int8_t *)(q), __VA_ARGS__)
#define Q8_S16_TILE(R, C, A, q, ...) q8_tile(R, C, A, 16, (const int8_t *)(q), __VA_ARGS__)
#define F16_TILE(R, C, A, ...) float_tile(R, C, A, F16, __VA_ARGS__)
#define BF16_TILE(R, C, A, ...) float_tile(R, C, A, BF16, __VA_ARGS__)
#define F32_TILE(R, C, A, ...) float_tile(R, C, A, F32, __VA_ARGS__)

/* columns per tile: of 4 rows (4 x C accumulators and 4 dequantised pairs in registers), of 1 row */
#if VW == 16
#define C4 4
#define C1 8
#else
#define C4 2  /* AVX2 has 16 registers */
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
#define LAYOUT_ROWS(NAME, TILE) \
    static __attribute__((noinline)) void NAME(int R, int cols, int alone, const uint8_t *q, const float *s, int nb, \
                                               const float *x, int K, float *y, int ldy) { \
        if (R == 4) DISPATCH4(TILE, cols, alone, q, s, nb, x, K, y, ldy); \
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
        default: return q8_0_rows;
    }
}
#endif

static int nibble_kind(int kind) { return kind == Q4_1 || kind == Q4_0 || kind == Q5_1 || kind == Q5_0; }
static int five_kind(int kind) { return kind == Q5_1 || kind == Q5_0; }
static int offset_of(int kind) { return kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : 0; }
static int float_bytes(int kind) { return kind == F32 ? 4 : kind == F16 || kind == BF16 ? 2 : 0; }

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
            const float d = s[b * S], m = off ? -0.0f : s[b * S + 1];
            for (int i = 0; i < 16; i++) {
                const int lo = (nib[i] & 15) | (int)((qh >> i) & 1) << 4, hi = (nib[i] >> 4) | (int)((qh >> (16 + i)) & 1) << 4;
                acc += (d * (float)(lo - off) + m) * x[b * 32 + i];
                acc += (d * (float)(hi - off) + m) * x[b * 32 + 16 + i];
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
    const size_t row_bytes = nib ? (size_t)nb * NIB_BYTES(five) : wide ? (size_t)K * wide : (size_t)K;
    const size_t row_scales = wide ? 0 : (size_t)nb * (nib ? NIB_SCALES(off) : kind == Q8_S16 ? 2 : 1);
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
