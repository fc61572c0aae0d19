/* The attention of decode_layers.c's layer stack: every token of a call's ragged segments against
 * the cached keys and values of its own row, in fp32, as transformers computes it (softmax with the
 * max subtracted; sums in another order). Why a file of its own: the layer loop is one concern, how
 * attention streams a row's cache is another. */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "blockq.h"
#include "decode_layers.h"

/* The queries of one work item (a segment's tokens x a kv head's query heads; query j is token
 * t0 + j / G's head g*G + j % G) and where their chunk results go. */
typedef struct {
    const float *qkv;
    const int64_t *pos;
    float *part;  /* [T, H, chunks, D + 2]: m, l, then the sum of e^(score - m) v */
    int t0, g, group, heads, nq, D, queries, chunks, c;
} Item;

static inline const float *query(const Item *q, int j) {
    const int t = q->t0 + j / q->group, h = q->g * q->group + j % q->group;
    return q->qkv + ((size_t)t * q->heads + h) * q->D;
}

static inline int64_t query_pos(const Item *q, int j) { return q->pos[q->t0 + j / q->group]; }

static inline float *result(const Item *q, int j) {
    const int t = q->t0 + j / q->group, h = q->g * q->group + j % q->group;
    return q->part + (((size_t)t * q->nq + h) * q->chunks + q->c) * (q->D + 2);
}

/* Ask the cache for the D floats at row + `ahead` bytes, a line at a time: where memory is far (a
 * VM's), a stream fetched ahead keeps up with the arithmetic (blockq_prefetch). */
static inline void stream_ahead(const float *row, int D, int ahead) {
    for (int b = 0; b < D * (int)sizeof(float); b += 64) __builtin_prefetch((const char *)row + ahead + b);
}

#if defined(__AVX512F__)
/* out[j] + 2 + d0 .. + 63 += sum over the n slots of p[j][s] * V[s][0..63] for nq <= 4 queries
 * (p: their softmax terms, CH apart), each product rounded, then added, slot by slot, skipping
 * zero terms: chunk_each's order, with the sums in registers rather than memory. */
static void weigh_values(const float *p, int CH, int nq, const float *V, int D, int n, float *const *out, int d0) {
    __m512 acc[4][4];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = j < nq ? _mm512_loadu_ps(out[j] + 2 + d0 + 16 * i) : _mm512_setzero_ps();
    for (int s = 0; s < n; s++) {
        const float *v = V + (size_t)s * D;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int j = 0; j < nq; j++) {
            const float w = p[(size_t)j * CH + s];
            if (w == 0.0f) continue;
            const __m512 pw = _mm512_set1_ps(w);
            acc[j][0] = _mm512_add_ps(acc[j][0], _mm512_mul_ps(pw, v0));
            acc[j][1] = _mm512_add_ps(acc[j][1], _mm512_mul_ps(pw, v1));
            acc[j][2] = _mm512_add_ps(acc[j][2], _mm512_mul_ps(pw, v2));
            acc[j][3] = _mm512_add_ps(acc[j][3], _mm512_mul_ps(pw, v3));
        }
    }
    for (int j = 0; j < nq; j++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out[j] + 2 + d0 + 16 * i, acc[j][i]);
}
#endif

/* A chunk's n keys K and values V (from slot s0) for a few queries, one at a time: dot products,
 * then softmax terms, then the weighted values; 16 queries at a time, each query's pointers and
 * position worked out once (per slot and query, their divisions cost more than the arithmetic).
 * sc: [16, CH] scratch. */
static void chunk_each(const Item *q, const float *K, const float *V, int s0, int n, int CH, float scale,
                       float *sc) {
    const int D = q->D;
    for (int j0 = 0; j0 < q->queries; j0 += 16) {
        const int nj = q->queries - j0 < 16 ? q->queries - j0 : 16;
        const float *qp[16];
        float *op[16];
        int64_t lim[16];  /* slot s counts while s <= lim */
        for (int j = 0; j < nj; j++) {
            qp[j] = query(q, j0 + j);
            op[j] = result(q, j0 + j);
            lim[j] = query_pos(q, j0 + j) - s0;
        }
        const int ahead = blockq_prefetch();
        for (int s = 0; s < n; s++) {
            stream_ahead(K + (size_t)s * D, D, ahead);  /* this slot's key a distance on */
            stream_ahead(V + (size_t)s * D, D, 0);  /* and its value, read in the last pass */
            for (int j = 0; j < nj; j++)
                sc[j * CH + s] = s <= lim[j] ? dot(qp[j], K + (size_t)s * D, D) * scale : -INFINITY;
        }
        for (int j = 0; j < nj; j++) {
            float *out = op[j], *e = sc + j * CH, top = -INFINITY, sum = 0.0f;
            for (int s = 0; s < n; s++) top = e[s] > top ? e[s] : top;
            out[0] = top;
            if (top == -INFINITY) {  /* the chunk starts past this query's position */
                for (int s = 0; s < n; s++) e[s] = 0.0f;
                continue;
            }
            #pragma omp simd reduction(+ : sum)
            for (int s = 0; s < n; s++) {
                e[s] = fexp(e[s] - top);
                sum += e[s];
            }
            out[1] = sum;
            for (int i = 0; i < D; i++) out[2 + i] = 0.0f;
        }
#if defined(__AVX512F__)
        if (D % 64 == 0) {  /* 4 queries x 64 of D at a time, the sums in registers (same order) */
            for (int j0 = 0; j0 < nj; j0 += 4)
                for (int d0 = 0; d0 < D; d0 += 64)
                    weigh_values(sc + (size_t)j0 * CH, CH, nj - j0 < 4 ? nj - j0 : 4, V + d0, D, n, op + j0, d0);
            continue;
        }
#endif
        for (int s = 0; s < n; s++)
            for (int j = 0; j < nj; j++) {
                const float p = sc[j * CH + s], *v = V + (size_t)s * D;
                if (p == 0.0f) continue;  /* masked, or e^(score - m) under fp32's range */
                float *o = op[j] + 2;
                #pragma omp simd
                for (int i = 0; i < D; i++) o[i] += p * v[i];
            }
    }
}

#define QB 16 /* queries per block where many share a chunk */

/* The same for queries j0 .. j0 + 15 at once, across the vector lanes: each key and value is read
 * once for the 16, no dot product needs a horizontal sum, and the softmax runs on all 16 at once.
 * D a multiple of 16. qt: [D, 16] scratch; e: [CH, 16] scratch (slot-major, so a slot's 16
 * scores are one vector). */
static void chunk_block16(const Item *q, int j0, const float *K, const float *V, int s0, int n, float scale,
                          float *qt, float *e) {
    const int D = q->D;
    float lim[QB], top[QB], sum[QB];
    for (int j = 0; j < QB; j++) {
        const int live = j0 + j < q->queries;
        lim[j] = live ? (float)(query_pos(q, j0 + j) - s0) : -1.0f;  /* slot s counts while s <= lim */
        for (int d = 0; d < D; d++) qt[d * QB + j] = live ? query(q, j0 + j)[d] : 0.0f;
        top[j] = -INFINITY;
        sum[j] = 0.0f;
    }
    int s = 0;
    for (int i = 0; i < n; i++) stream_ahead(V + (size_t)i * D, D, 0);  /* the values, read in the last pass */
#if defined(__AVX512F__)
    const int ahead = blockq_prefetch();
    /* SL slots at a time: SL independent chains of FMAs (one chain of D bound a slot by the FMA's
     * latency), each slot's sum in the same order as alone */
    enum { SL = 8 };
    for (; s + SL <= n; s += SL) {
        const float *k = K + (size_t)s * D;
        for (int i = 0; i < SL; i++) stream_ahead(k + (size_t)i * D, D, ahead);
        __m512 acc[SL];
        for (int i = 0; i < SL; i++) acc[i] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            const __m512 qd = _mm512_loadu_ps(qt + d * QB);
            for (int i = 0; i < SL; i++) acc[i] = _mm512_fmadd_ps(qd, _mm512_set1_ps(k[(size_t)i * D + d]), acc[i]);
        }
        for (int i = 0; i < SL; i++) _mm512_storeu_ps(e + (size_t)(s + i) * QB, acc[i]);
    }
#endif
    for (; s < n; s++) {
        const float *k = K + (size_t)s * D;
        float *es = e + (size_t)s * QB;
#if defined(__AVX512F__)
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * QB), _mm512_set1_ps(k[d]), acc);
        _mm512_storeu_ps(es, acc);
#else
        for (int j = 0; j < QB; j++) es[j] = 0.0f;
        for (int d = 0; d < D; d++)
            for (int j = 0; j < QB; j++) es[j] = fmaf(qt[d * QB + j], k[d], es[j]);
#endif
    }
    for (s = 0; s < n; s++) {
        float *es = e + (size_t)s * QB;
        #pragma omp simd
        for (int j = 0; j < QB; j++) {
            es[j] = (float)s <= lim[j] ? es[j] * scale : -INFINITY;
            top[j] = es[j] > top[j] ? es[j] : top[j];
        }
    }
    for (int s = 0; s < n; s++) {
        float *es = e + (size_t)s * QB;
        #pragma omp simd
        for (int j = 0; j < QB; j++) {
            es[j] = top[j] == -INFINITY ? 0.0f : fexp(es[j] - top[j]);
            sum[j] += es[j];
        }
    }
    for (int d0 = 0; d0 < D; d0 += 16) {
#if defined(__AVX512F__)
        __m512 acc[QB];
        for (int j = 0; j < QB; j++) acc[j] = _mm512_setzero_ps();
        for (int s = 0; s < n; s++) {
            const __m512 v = _mm512_loadu_ps(V + (size_t)s * D + d0);
            for (int j = 0; j < QB; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(e[s * QB + j]), v, acc[j]);
        }
        for (int j = 0; j < QB && j0 + j < q->queries; j++) _mm512_storeu_ps(result(q, j0 + j) + 2 + d0, acc[j]);
#else
        for (int j = 0; j < QB && j0 + j < q->queries; j++) {
            float *o = result(q, j0 + j) + 2 + d0;
            for (int i = 0; i < 16; i++) o[i] = 0.0f;
            for (int s = 0; s < n; s++)
                for (int i = 0; i < 16; i++) o[i] = fmaf(e[s * QB + j], V[(size_t)s * D + d0 + i], o[i]);
        }
#endif
    }
    for (int j = 0; j < QB && j0 + j < q->queries; j++) {
        result(q, j0 + j)[0] = top[j];
        result(q, j0 + j)[1] = sum[j];
    }
}


/* att[t, h] = softmax(scale * q . K[0..pos]) V over the slots 0..pos of the token's row (pos: its
 * position) and its kv head, in two passes (flash-decoding). Pass 1 takes a chunk of CH slots of
 * one segment's row and kv head at a time and streams its keys and values once for every query of
 * that segment and head group (its tokens x G heads), keeping per query the chunk's max score m,
 * sum l of e^(score - m) and sum of e^(score - m) v; pass 2 merges each query's chunks. Why: with
 * one query head per item every head of a group read the group's keys and values again, and
 * chunks spread a single token's attention over every thread. With 8 or more queries a chunk (a
 * verify pass, a prompt piece) they go 16 at a time across the vector lanes (chunk_block16).
 * part: [T, H, chunks, D + 2] (chunks: of the longest row); scores: per thread, `attend_scratch`
 * floats. */
int64_t attend_scratch(int queries, int D, int CH) {
    return (int64_t)(queries > QB ? queries : QB) * CH + QB * D;
}

void attend(const float *qkv, const int64_t *pos, const Segments *sg, int T, int W, int nq, int nkv, int D,
                   int S, int CH, float scale, const float *kc, const float *vc, float *att, float *part,
                   float *scores, Team *team, int *phase) {
    const int heads = nq + 2 * nkv, group = nq / nkv;
    const size_t stride = (size_t)D + 2;
    int len = 0;
    for (int b = 0; b < sg->B; b++) len = (int)sg->len[b] > len ? (int)sg->len[b] : len;
    const int chunks = (len + CH - 1) / CH;
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < (int)sg->items[sg->B]; it++) {
        int b = 0;
        while (sg->items[b + 1] <= it) b++;
        const int local = it - (int)sg->items[b], mine = ((int)sg->len[b] + CH - 1) / CH;
        const int g = local / mine, c = local % mine, seg_len = (int)sg->len[b];
        const int s0 = c * CH, n = (s0 + CH < seg_len ? s0 + CH : seg_len) - s0;
        const int t0 = (int)sg->starts[b], queries = ((int)sg->starts[b + 1] - t0) * group;
        const size_t base = ((size_t)sg->row[b] * nkv + g) * S * D + (size_t)s0 * D;
        const Item q = {qkv, pos, part, t0, g, group, heads, nq, D, queries, chunks, c};
        float *sc = scores + (size_t)omp_get_thread_num() * attend_scratch(W * group, D, CH);
        if (queries < 8 || D % 16) {
            chunk_each(&q, kc + base, vc + base, s0, n, CH, scale, sc);
            continue;
        }
        for (int j0 = 0; j0 < queries; j0 += QB)
            chunk_block16(&q, j0, kc + base, vc + base, s0, n, scale, sc + (size_t)QB * CH, sc);
    }
    team_sync(team, phase);  /* every chunk done before the merge */
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < T * nq; it++) {  /* it = t * H + h: att's layout too */
        const float *p = part + (size_t)it * chunks * stride;
        const int mine = (int)pos[it / nq] / CH + 1;  /* the chunks holding this token's slots 0..pos */
        float top = -INFINITY, sum = 0.0f;
        for (int c = 0; c < mine; c++) top = p[c * stride] > top ? p[c * stride] : top;
        float *o = att + (size_t)it * D;
        for (int i = 0; i < D; i++) o[i] = 0.0f;
        for (int c = 0; c < mine; c++) {
            const float *q = p + c * stride;
            if (q[0] == -INFINITY) continue;
            const float w = fexp(q[0] - top);
            sum += w * q[1];
            for (int i = 0; i < D; i++) o[i] += w * q[2 + i];
        }
        const float inv = 1.0f / sum;
        for (int i = 0; i < D; i++) o[i] *= inv;
    }
}

