/* The layer stack of a Llama-family model whose linear layers are GGUF blocks, in one call and one
 * OpenMP parallel region.
 *
 * Why: with the products read from blocks (blockq.c) a forward of a small model spends most of its
 * time around them: ~30 torch ops per layer (norms, rotation, cache writes, SDPA, SiLU, residual
 * adds), the Python that calls them, and an OpenMP fork and join per product. Here each layer is
 * nine steps separated by barriers of the one parallel region: norm, q|k|v (three products, one
 * barrier), rotation and cache write, attention, o, residual and norm, gate|up, SiLU(gate) * up,
 * down; and a tenth after q|k|v where the model has q/k/v biases (Qwen2) or q/k norms (Qwen3)
 * (decode_heads.c).
 *
 * The arithmetic is the model's, in fp32, step for step as transformers writes it: RMSNorm as
 * weight * (x * (1 / sqrt(mean(x^2) + eps))); the rotation as q * cos + rotate_half(q) * sin from
 * transformers' own cos and sin (computed by the caller, so every rope scaling is the model's);
 * attention over the slots 0..position of the token's row (as StaticLlama's mask), softmax with
 * the max subtracted; SiLU as g / (1 + e^-g). Sums run in another order than torch's (as the
 * block kernel's do), exp is Cephes' polynomial (within 1 ulp, as torch's own vectorized exp is an
 * approximation too), and nothing is contracted into an FMA that transformers rounds twice (built
 * with -ffp-contract=off). tests/core/backends/test_native_layers.py compares it with transformers'
 * forward; the greedy tests of the default model with transformers' generate.
 *
 * The tokens are ragged: B segments of any lengths (a row's draft, another's single token, a new
 * request's prompt piece), segment b being tokens starts[b] .. starts[b + 1] - 1 of cache row
 * row[b], so every product reads the weights once for all of them.
 *
 * Layout: x, h, out [T, hidden] (T = tokens of every segment, in order); the stacked q|k|v product
 * [T, (H + 2 H_kv) * D] (q heads, then k, then v); the caches [rows, H_kv, S, D] per layer. */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "blockq.h"

/* per-layer slots of the table (int64: addresses, and block kinds): the norms, the caches, the q, k
 * and v biases (Qwen2's [H * D], [H_kv * D], [H_kv * D]) and the per-head q and k norm weights
 * (Qwen3's [D] each), 0 where the model has none, then per projection (q, k, v, o, gate, up, down)
 * its blocks, scales and layout (blockq.h), each its own kind (a Q4_K_M file mixes them within a
 * layer) */
enum { ATTN_NORM, MLP_NORM, K_CACHE, V_CACHE, Q_BIAS, K_BIAS, V_BIAS, Q_NORM, K_NORM, PROJ };
enum { P_Q, P_K, P_V, P_O, P_GATE, P_UP, P_DOWN, N_PROJ };
enum { SLOTS = PROJ + 3 * N_PROJ };
/* dims: layers, hidden, heads, kv heads, head dim, intermediate, slots per row (S), the most tokens
 * of one segment (W), slots per attention chunk (CH) */
enum { N_LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, MAX_LEN, WIDTH, CHUNK, N_DIMS };

int decode_layers_slots(void) { return SLOTS; }

/* The barrier between the steps of the layer stack: the team's threads spin until all have
 * arrived (yielding the core after a while). Why not OpenMP's own: once a process holds more
 * OpenMP threads than cores (the engine decodes on its own thread, whose team adds to the one
 * the loading thread left behind, idle), libgomp stops spinning at its barriers after ~1,000
 * rounds and sleeps in the kernel, and a forward's hundreds of barriers then cost about as much as
 * its arithmetic. */
typedef struct {
    atomic_int arrived;
    atomic_int phase;
} Team;

#define SPINS (1 << 12) /* rounds before yielding the core: about a hundred microseconds */

static void team_sync(Team *team, int *phase) {
    const int n = omp_get_num_threads(), next = *phase + 1;
    *phase = next;
    if (n == 1) return;
    if (atomic_fetch_add_explicit(&team->arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&team->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&team->phase, next, memory_order_release);
        return;
    }
    for (unsigned spins = 0; atomic_load_explicit(&team->phase, memory_order_acquire) != next; spins++) {
        if (spins < SPINS) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
}

#define F(p) ((float *)(intptr_t)(p))
#define U8(p) ((const uint8_t *)(intptr_t)(p))

/* e^x in fp32 (Cephes' expf: Cody-Waite reduction, degree-6 polynomial; within 1 ulp of e^x at
 * every fp32 x in [-87, 88], checked exhaustively), in a form the compiler vectorizes; 0 below -87
 * (where e^x is under fp32's normal range). */
static inline float fexp(float x) {
    const float xc = fminf(fmaxf(x, -87.0f), 88.0f);
    const float n = floorf(xc * 1.44269504088896341f + 0.5f);
    const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return x < -87.0f ? 0.0f : p * two_n.f;
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Whether table row e has q/k/v biases or q/k norms: decode_heads.c's `bias_and_norm` then runs
 * between the q|k|v products and the rotation, over the table's slots Q_BIAS .. K_NORM. */
static int has_bias_or_norm(const int64_t *e) {
    return e[Q_BIAS] || e[K_BIAS] || e[V_BIAS] || e[Q_NORM] || e[K_NORM];
}
void bias_and_norm(float *qkv, const int64_t *extras, float eps, int T, int nq, int nkv, int D);

/* x += delta (when given), then y = RMSNorm(x) with weight w; one token per iteration. */
static void add_norm(float *x, const float *delta, const float *w, float eps, float *y, int T, int H) {
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < T; t++) {
        float *xr = x + (size_t)t * H, *yr = y + (size_t)t * H;
        if (delta)
            for (int i = 0; i < H; i++) xr[i] += delta[(size_t)t * H + i];
        const float r = 1.0f / sqrtf(dot(xr, xr, H) / (float)H + eps);
        for (int i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

/* Rotate the q and k heads of each token in place and write its k and v heads into the cache at
 * (row[t], kv head, pos[t]). cos, sin: [T, D]. */
static void rope_and_cache(float *qkv, const int64_t *pos, const int64_t *row, const float *cos, const float *sin,
                           int T, int nq, int nkv, int D, int S, float *kc, float *vc) {
    const int heads = nq + 2 * nkv, half = D / 2;
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < T * heads; it++) {
        const int t = it / heads, h = it % heads;
        float *v = qkv + (size_t)t * heads * D + (size_t)h * D;
        if (h < nq + nkv) {
            const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
            float rotated[D];
            for (int i = 0; i < half; i++) rotated[i] = v[i] * c[i] + (-v[i + half]) * s[i];
            for (int i = half; i < D; i++) rotated[i] = v[i] * c[i] + v[i - half] * s[i];
            for (int i = 0; i < D; i++) v[i] = rotated[i];
        }
        if (h >= nq) {
            const int kv = h < nq + nkv ? h - nq : h - nq - nkv;
            float *cache = (h < nq + nkv ? kc : vc) + (((size_t)row[t] * nkv + kv) * S + (size_t)pos[t]) * D;
            for (int i = 0; i < D; i++) cache[i] = v[i];
        }
    }
}

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
    const int ahead = blockq_prefetch();
    for (int i = 0; i < n; i++) stream_ahead(V + (size_t)i * D, D, 0);  /* the values, read in the last pass */
#if defined(__AVX512F__)
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

/* The segments of a call: segment b is tokens starts[b] .. starts[b + 1] - 1 of cache row row[b];
 * its attention work items (kv heads x chunks of its live slots) are items[b] .. items[b + 1] - 1,
 * its live slots 0 .. len[b] - 1 (1 + its largest position). */
typedef struct {
    int B;
    const int64_t *starts, *row, *items, *len;
} Segments;

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
static int64_t attend_scratch(int queries, int D, int CH) {
    return (int64_t)(queries > QB ? queries : QB) * CH + QB * D;
}

static void attend(const float *qkv, const int64_t *pos, const Segments *sg, int T, int W, int nq, int nkv, int D,
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

static void silu_row(const float *restrict g, const float *restrict u, float *restrict a, int n) {
    #pragma omp simd
    for (int i = 0; i < n; i++) a[i] = g[i] / (1.0f + fexp(-g[i])) * u[i];
}

/* act[t] = SiLU(gate[t]) * up[t], gu: [T, 2I] (gate | up). */
static void silu_mul(const float *gu, float *act, int T, int I) {
    #pragma omp for schedule(static) nowait
    for (int t = 0; t < T; t++) silu_row(gu + (size_t)t * 2 * I, gu + (size_t)t * 2 * I + I, act + (size_t)t * I, I);
}

/* y (rows ldy apart) = x [T, K] @ W^T for projection p of table row e, W [N, K]; no barrier */
static void product(const int64_t *e, int p, const float *x, int T, int K, float *y, int N, int ldy) {
    const int64_t *w = e + PROJ + 3 * p;
    block_rows((int)w[2], x, T, K, U8(w[0]), F(w[1]), y, N, ldy);
}

/* floats of scratch `decode_layers` needs for T tokens on `threads` threads */
int64_t decode_layers_work(const int64_t *dims, int T, int threads) {
    const int64_t H = dims[HIDDEN], nq = dims[HEADS], nkv = dims[KV_HEADS], D = dims[HEAD_DIM], I = dims[INTER];
    const int64_t CH = dims[CHUNK], chunks = (dims[MAX_LEN] + CH - 1) / CH;
    return T * (2 * H + (nq + 2 * nkv) * D + nq * D + 3 * I) + T * nq * chunks * (D + 2) +
           threads * attend_scratch((int)(dims[WIDTH] * (nq / nkv)), (int)D, (int)CH);
}

/* Every layer and the final norm for T tokens: x [T, hidden] holds the embeddings on entry and the
 * residual stream on exit; out [T, hidden] gets the final norm's output. The tokens are B
 * segments: segment b's are tokens starts[b] .. starts[b + 1] - 1 (starts: [B + 1], starts[0] = 0,
 * starts[B] = T), written to and attending over cache row row[b] (row: [B], each row at most once).
 * pos: [T] (each token's position); cos, sin: [T, D]; fdims: eps, attention scale. dims[WIDTH]
 * is at least the longest segment. */
void decode_layers(const int64_t *tab, const int64_t *dims, const float *fdims, float *x, int T,
                   const int64_t *pos, const int64_t *starts, const int64_t *row, int B, const float *cos,
                   const float *sin, const float *final_norm, float *out, float *work, int threads) {
    const int H = (int)dims[HIDDEN], nq = (int)dims[HEADS], nkv = (int)dims[KV_HEADS], D = (int)dims[HEAD_DIM];
    const int I = (int)dims[INTER], S = (int)dims[MAX_LEN], W = (int)dims[WIDTH], CH = (int)dims[CHUNK];
    const int QKV = (nq + 2 * nkv) * D, CHUNKS = (S + CH - 1) / CH;
    const float eps = fdims[0], scale = fdims[1], qk_eps = fdims[2];  /* fdims[2]: the q/k norms' eps */
    float *h = work, *qkv = h + (size_t)T * H, *att = qkv + (size_t)T * QKV, *gu = att + (size_t)T * nq * D;
    float *act = gu + (size_t)T * 2 * I, *delta = act + (size_t)T * I, *part = delta + (size_t)T * H;
    float *scores = part + (size_t)T * nq * CHUNKS * (D + 2);
    int64_t *items = malloc(sizeof(int64_t) * ((size_t)2 * B + 1 + (size_t)T)), *len = items + B + 1, *trow = len + B;
    items[0] = 0;
    for (int b = 0; b < B; b++) {
        len[b] = 0;
        for (int64_t t = starts[b]; t < starts[b + 1]; t++) {
            len[b] = pos[t] + 1 > len[b] ? pos[t] + 1 : len[b];
            trow[t] = row[b];
        }
        items[b + 1] = items[b] + nkv * ((len[b] + CH - 1) / CH);
    }
    const Segments sg = {B, starts, row, items, len};
    Team team;
    atomic_init(&team.arrived, 0);
    atomic_init(&team.phase, 0);
    #pragma omp parallel num_threads(threads)
    {
        int phase = 0;  /* this thread's count of barriers passed */
        for (int l = 0; l < (int)dims[N_LAYERS]; l++) {
            const int64_t *e = tab + (size_t)l * SLOTS;
            add_norm(x, l ? delta : NULL, F(e[ATTN_NORM]), eps, h, T, H);
            team_sync(&team, &phase);
            product(e, P_Q, h, T, H, qkv, nq * D, QKV);  /* q | k | v: one barrier after the three */
            product(e, P_K, h, T, H, qkv + nq * D, nkv * D, QKV);
            product(e, P_V, h, T, H, qkv + (nq + nkv) * D, nkv * D, QKV);
            if (has_bias_or_norm(e)) {  /* the same for every thread: all of them sync or none */
                team_sync(&team, &phase);
                bias_and_norm(qkv, e + Q_BIAS, qk_eps, T, nq, nkv, D);
            }
            team_sync(&team, &phase);
            rope_and_cache(qkv, pos, trow, cos, sin, T, nq, nkv, D, S, F(e[K_CACHE]), F(e[V_CACHE]));
            team_sync(&team, &phase);
            attend(qkv, pos, &sg, T, W, nq, nkv, D, S, CH, scale, F(e[K_CACHE]), F(e[V_CACHE]), att, part, scores,
                   &team, &phase);
            team_sync(&team, &phase);
            product(e, P_O, att, T, nq * D, delta, H, H);
            team_sync(&team, &phase);
            add_norm(x, delta, F(e[MLP_NORM]), eps, h, T, H);
            team_sync(&team, &phase);
            product(e, P_GATE, h, T, H, gu, I, 2 * I);
            product(e, P_UP, h, T, H, gu + I, I, 2 * I);
            team_sync(&team, &phase);
            silu_mul(gu, act, T, I);
            team_sync(&team, &phase);
            product(e, P_DOWN, act, T, I, delta, H, H);
            team_sync(&team, &phase);
        }
        add_norm(x, dims[N_LAYERS] ? delta : NULL, final_norm, eps, out, T, H);
    }
    free(items);
}
