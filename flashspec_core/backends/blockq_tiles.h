/* The register tiles of blockq.c: R rows of W (1, 2 or 4) against C columns of x (tokens), every
 * accumulator in a register, one tile function per family of layouts (4- and 5-bit nibbles, the
 * K-quants, Q6_K, Q8, the float layouts) and one macro per layout naming its tile with its
 * parameters. Included by blockq.c only, after its layout parameters and prefetch distance; the
 * panel path (blockq_panel.h) reuses the K-quants' scale helpers and the float loads below. */

/* A tile's accumulators [R][C][A] set to zero; summed (A = 2: two into one) into y, columns ldy apart. */
INLINE void acc_zero(const int R, const int C, const int A, vf acc[4][8][2]) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            for (int a = 0; a < A; a++) acc[r][c][a] = VZERO;
}

INLINE void acc_store(const int R, const int C, const int A, vf acc[4][8][2], float *y, int ldy) {
    if (A == 2)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c][0] = VADD(acc[r][c][0], acc[r][c][1]);
    for (int c = 0; c < C; c++) {
        if (R == 4) VSUM4(acc[0][c][0], acc[1][c][0], acc[2][c][0], acc[3][c][0], y + (size_t)c * ldy);
        else
            for (int r = 0; r < R; r++) y[(size_t)c * ldy + r] = VSUM(acc[r][c][0]);
    }
}

/* A half-block tile step: each row's dequantised low (weights h..) and high (16 + h..) halves
 * against every column's x at the same offsets (x: the block's first weight h of column 0). */
INLINE void fma_halves(const int R, const int C, const int A, const vf lo[4], const vf hi[4], const float *x, int K,
                       vf acc[4][8][2]) {
    for (int c = 0; c < C; c++) {
        const vf xl = VLOAD(x + (size_t)c * K), xh = VLOAD(x + (size_t)c * K + 16);
        for (int r = 0; r < R; r++) {
            acc[r][c][0] = VFMA(lo[r], xl, acc[r][c][0]);
            acc[r][c][A - 1] = VFMA(hi[r], xh, acc[r][c][A - 1]);
        }
    }
}

/* Super-block sb of a K-quant row's scales (sr: the row's, nb blocks), worked out once for its 8
 * blocks with vector products, so a block reads its two scales from memory: Q4_K / Q5_K d * sc and
 * -dmin * m per block (exact in fp32: an fp16 times a 6-bit integer), Q6_K d * sc per 16 weights
 * (an fp16 times an int8). */
INLINE void kq_scales8(const float *sr, int nb, int sb, float *dk, float *mk) {
    const uint8_t *sm = (const uint8_t *)(sr + nb / 4) + 8 * sb;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sm)));
    const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + nb))));
    _mm256_storeu_ps(dk, _mm256_mul_ps(_mm256_set1_ps(sr[sb]), sc));
    _mm256_storeu_ps(mk, _mm256_mul_ps(_mm256_set1_ps(sr[nb / 8 + sb]), m));
}

INLINE void q6_scales16(const float *sr, int nb, int sb, float *dk, float *mk) {
    const int8_t *sc = (const int8_t *)(sr + nb / 8) + 16 * sb;
    const __m256 d = _mm256_set1_ps(sr[sb]), m32 = _mm256_set1_ps(-32.0f);
    for (int i = 0; i < 16; i += 8) {
        const __m256 ds = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(sc + i)))));
        _mm256_storeu_ps(dk + i, ds);
        _mm256_storeu_ps(mk + i, _mm256_mul_ps(ds, m32));  /* -32 d * sc: exact */
    }
}

/* One tile: R rows of W against C columns of x, every accumulator in a register. A = 2 (a pass of
 * one token) sums each row into two accumulators (the low and high halves of a 4- or 5-bit block,
 * alternate vectors of an 8-bit block) added at the end: one chain of dependent FMAs would bound
 * such a pass, not the arithmetic. The order of a row's sums depends on A only, never on R. y's
 * columns are ldy apart. */
INLINE void q4_tile(const int R, const int C, const int A, const int FIVE, const int OFF, const int KQ,
                    const uint8_t *q, const float *s, int nb, const float *x, int K, float *y, int ldy) {
    const int P = NIB_BYTES(FIVE), S = NIB_SCALES(OFF);
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    acc_zero(R, C, A, acc);
    float kd[4][8], km[4][8];  /* K-quants: the super-block's d * sc and -dmin * m per row */
    for (int b = 0; b < nb; b++) {
        if (KQ && (b & 7) == 0)
            for (int r = 0; r < R; r++) kq_scales8(s + (size_t)r * KQ_SCALES(nb), nb, b >> 3, kd[r], km[r]);
        for (int r = 0; r < R; r++) __builtin_prefetch(q + ((size_t)r * nb + b) * P + prefetch_ahead);
        for (int h = 0; h < 16; h += VW) {
            vf lo[4], hi[4];
            for (int r = 0; r < R; r++) {
                const uint8_t *block = q + ((size_t)r * nb + b) * P;
                uint32_t qh = 0;
                if (FIVE) memcpy(&qh, block, 4);
                float dr, mr;
                if (KQ) {
                    dr = kd[r][b & 7];
                    mr = km[r][b & 7];
                } else {
                    const float *sr = s + ((size_t)r * nb + b) * S;
                    dr = sr[0];
                    mr = OFF ? -0.0f : sr[S - 1];
                }
                dequant_q4(FIVE, OFF, block + P - 16 + h, qh, h, VSET1(dr), VSET1(mr), &lo[r], &hi[r]);
            }
            fma_halves(R, C, A, lo, hi, x + b * 32 + h, K, acc);
        }
    }
    acc_store(R, C, A, acc, y, ldy);
}

/* G: weights per scale (32, or 16 for Q8_S16) */
INLINE void q8_tile(const int R, const int C, const int A, const int G, const int8_t *q, const float *s, int nb,
                    const float *x, int K, float *y, int ldy) {
    const int S = 32 / G;
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    acc_zero(R, C, A, acc);
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) __builtin_prefetch(q + (size_t)r * K + b * 32 + prefetch_ahead);
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
    acc_store(R, C, A, acc, y, ldy);
}

/* Q6_K's tile: as q4_tile, 24 bytes a block (two words of highs, then the nibbles) and one scale
 * per 16 weights, d * sc (exact: an fp16 times an int8), each weight d * sc * (q - 32) rounded once. */
INLINE void q6_tile(const int R, const int C, const int A, const uint8_t *q, const float *s, int nb,
                    const float *x, int K, float *y, int ldy) {
    vf acc[4][8][2];  /* [R][C][A]: only the tile's own are used */
    acc_zero(R, C, A, acc);
    float kd[4][16], km[4][16];  /* the super-block's d * sc and -32 d * sc per row, one a half-block */
    for (int b = 0; b < nb; b++) {
        if ((b & 7) == 0)
            for (int r = 0; r < R; r++) q6_scales16(s + (size_t)r * Q6_SCALES(nb), nb, b >> 3, kd[r], km[r]);
        const int i = 2 * (b & 7);
        for (int r = 0; r < R; r++) __builtin_prefetch(q + ((size_t)r * nb + b) * Q6_BYTES + prefetch_ahead);
        for (int h = 0; h < 16; h += VW) {
            vf lo[4], hi[4];
            for (int r = 0; r < R; r++)
                dequant_q6(q + ((size_t)r * nb + b) * Q6_BYTES, h, VSET1(kd[r][i]), VSET1(kd[r][i + 1]),
                           VSET1(km[r][i]), VSET1(km[r][i + 1]), &lo[r], &hi[r]);
            fma_halves(R, C, A, lo, hi, x + b * 32 + h, K, acc);
        }
    }
    acc_store(R, C, A, acc, y, ldy);
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
    acc_zero(R, C, A, acc);
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < R; r++) __builtin_prefetch(q + r * row + (size_t)b * 32 * (FMT == F32 ? 4 : 2) + prefetch_ahead);
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
    acc_store(R, C, A, acc, y, ldy);
}

/* one tile function per layout (the dispatch macros below take a tile by name) */
#define Q4_1_TILE(R, C, A, ...) q4_tile(R, C, A, 0, 0, 0, __VA_ARGS__)
#define Q4_0_TILE(R, C, A, ...) q4_tile(R, C, A, 0, 8, 0, __VA_ARGS__)
#define Q5_1_TILE(R, C, A, ...) q4_tile(R, C, A, 1, 0, 0, __VA_ARGS__)
#define Q5_0_TILE(R, C, A, ...) q4_tile(R, C, A, 1, 16, 0, __VA_ARGS__)
#define Q4_K_TILE(R, C, A, ...) q4_tile(R, C, A, 0, 0, 1, __VA_ARGS__)
#define Q5_K_TILE(R, C, A, ...) q4_tile(R, C, A, 1, 0, 1, __VA_ARGS__)
#define Q6_K_TILE(R, C, A, ...) q6_tile(R, C, A, __VA_ARGS__)
#define Q8_0_TILE(R, C, A, q, ...) q8_tile(R, C, A, 32, (const int8_t *)(q), __VA_ARGS__)
#define Q8_S16_TILE(R, C, A, q, ...) q8_tile(R, C, A, 16, (const int8_t *)(q), __VA_ARGS__)
#define F16_TILE(R, C, A, ...) float_tile(R, C, A, F16, __VA_ARGS__)
#define BF16_TILE(R, C, A, ...) float_tile(R, C, A, BF16, __VA_ARGS__)
#define F32_TILE(R, C, A, ...) float_tile(R, C, A, F32, __VA_ARGS__)
