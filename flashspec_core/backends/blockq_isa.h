/* The instruction-set layer of blockq.c: vector types and the dequantising loads per ISA (AVX-512,
 * AVX2 with FMA), or SCALAR where neither is built. Included by blockq.c only. */
#include <stdint.h>
#include <string.h>
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

#if defined(__AVX2__) || defined(__AVX512F__)
/* 8 lanes' sum by halves: lane i with i + 4, then i + 2, i + 1 (VSUM's tail on both ISAs) */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX512F__)
typedef __m512 vf;
#define VW 16
#define VZERO _mm512_setzero_ps()
#define VSET1 _mm512_set1_ps
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
/* A vector's sum by halves: lane i with i + 8, then i + 4, i + 2, i + 1 (written out, not left to
 * the compiler's reduction, so VSUM4's four sums at once pair the same lanes: equal bit for bit). */
static inline float VSUM(__m512 v) {
    return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
/* VSUM of a0..a3 into y[0..3], the halving steps done on the four at once (each shuffle and add
 * serves two or four sums; 14 vector ops where four VSUMs take 28). */
static inline void VSUM4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *y) {
    const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
    /* 128-bit lane r: row r's lanes i + (i + 4) */
    __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t01, t23, _MM_SHUFFLE(3, 1, 3, 1)));
    w = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(1, 0, 3, 2)));
    w = _mm512_add_ps(w, _mm512_permute_ps(w, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, w)));
}
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
    /* the fifth bit of weight i is bit i of qh: a mask over the lanes, whose set lanes take their
     * value from the upper table (16..31) instead */
    const vf upper = _mm512_fmadd_ps(_mm512_add_ps(iota, _mm512_set1_ps(16.0f)), d, m);
    const __m512i vh = _mm512_srli_epi32(v, 4);
    *lo = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(v, table), _cvtu32_mask16(qh & 0xffffu), v, upper);
    *hi = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(vh, table), _cvtu32_mask16(qh >> 16), vh, upper);
}
/* Q6_K: a block's two words of highs then 16 bytes of nibbles (blockq.py) -> weights 0..15 and
 * 16..31 as d * (q - 32) rounded once: fma(q, d, m) with m = -32 d (exact) */
INLINE void dequant_q6(const uint8_t *block, int h, vf dl, vf dh, vf ml, vf mh, vf *lo, vf *hi) {
    (void)h;
    long long words;
    memcpy(&words, block, 8);
    const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const __m512i r = _mm512_srlv_epi32(_mm512_set1_epi64(words), shifts);  /* lane i's highs in bits 0..3 */
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 8)));
    const __m512i low = _mm512_set1_epi32(15), top = _mm512_set1_epi32(48);
    const __m512i il = _mm512_or_si512(_mm512_and_si512(v, low), _mm512_and_si512(_mm512_slli_epi32(r, 4), top));
    const __m512i ih = _mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_and_si512(_mm512_slli_epi32(r, 2), top));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(il), dl, ml);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih), dh, mh);
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
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
#define VSUM sum8
/* VSUM of a0..a3 into y[0..3], the same pairs of lanes, the halving steps done on the four at once */
static inline void VSUM4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float *y) {
    const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
    const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    /* 128-bit lane 0: rows 0 and 2's lanes i + (i + 2); lane 1: rows 1 and 3's */
    __m256 w = _mm256_add_ps(_mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(t01, t23, _MM_SHUFFLE(3, 2, 3, 2)));
    w = _mm256_add_ps(_mm256_shuffle_ps(w, w, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(w, w, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm_storeu_ps(y, _mm_unpacklo_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1)));
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
/* Q6_K: as the AVX-512 path, 8 weights from the low nibbles (h..) and 8 from the high ones */
INLINE void dequant_q6(const uint8_t *block, int h, vf dl, vf dh, vf ml, vf mh, vf *lo, vf *hi) {
    long long words;
    memcpy(&words, block, 8);
    const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12), _mm256_set1_epi32(2 * h));
    const __m256i r = _mm256_srlv_epi32(_mm256_set1_epi64x(words), shifts);
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 + h)));
    const __m256i low = _mm256_set1_epi32(15), top = _mm256_set1_epi32(48);
    const __m256i il = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(_mm256_slli_epi32(r, 4), top));
    const __m256i ih = _mm256_or_si256(_mm256_srli_epi32(v, 4), _mm256_and_si256(_mm256_slli_epi32(r, 2), top));
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), dl, ml);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), dh, mh);
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
