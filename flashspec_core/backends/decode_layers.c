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
#include "decode_layers.h"

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

#define SPINS (1 << 12) /* rounds before yielding the core: about a hundred microseconds */

void team_sync(Team *team, int *phase) {
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
