/* The per-head steps of decode_layers.c's layer stack that only some architectures have: Qwen2's
 * q, k and v biases and Qwen3's per-head q and k RMSNorms, between the q|k|v products and the
 * rotation, in transformers' order (q_norm(q_proj(x)), the bias inside q_proj).
 *
 * Why a file of its own: decode_layers.c runs every Llama-family layer; these steps are per
 * architecture, and more of them (other norms or biases) belong here, not in the layer loop.
 *
 * The arithmetic is transformers' in fp32: the bias added after the product (as F.linear(x, W, b)
 * and the block kernel's block_linear add it), RMSNorm as w * (v * (1 / sqrt(mean(v^2) + eps)))
 * over the head's D values with the norm's own eps (as decode_layers.c's add_norm, and
 * Qwen3RMSNorm); built with -ffp-contract=off like the rest (blockq.py). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "decode_layers.h"

#define F(p) ((const float *)(intptr_t)(p))

/* v [D] += b [D]: one head's share of its projection's bias. */
static void add_bias(float *v, const float *b, int D) {
    for (int i = 0; i < D; i++) v[i] += b[i];
}

/* RMSNorm in place over one head's D values with weight w [D]. */
static void head_norm(float *v, const float *w, float eps, int D) {
    const float r = 1.0f / sqrtf(dot(v, v, D) / (float)D + eps);
    for (int i = 0; i < D; i++) v[i] = w[i] * (v[i] * r);
}

/* Each head of each token's q|k|v [T, (H + 2 H_kv) * D] (q heads, then k, then v): its
 * projection's bias added where it has one, then the q and k heads normed where there are q/k
 * norms. extras: the addresses of the q, k and v biases ([H * D], [H_kv * D], [H_kv * D]) and of
 * the q and k norm weights ([D] each), 0 where absent (decode_layers.c's table slots Q_BIAS ..
 * K_NORM); eps: the q/k norms'. An orphaned `omp for` without a barrier at its end (the caller
 * synchronises). */
void bias_and_norm(float *qkv, const int64_t *extras, float eps, int T, int nq, int nkv, int D) {
    const int heads = nq + 2 * nkv;
    const float *bias[3] = {F(extras[0]), F(extras[1]), F(extras[2])}, *norm[2] = {F(extras[3]), F(extras[4])};
    #pragma omp for schedule(static) nowait
    for (int it = 0; it < T * heads; it++) {
        const int t = it / heads, h = it % heads;
        const int part = h < nq ? 0 : h < nq + nkv ? 1 : 2, first = part == 0 ? 0 : part == 1 ? nq : nq + nkv;
        float *v = qkv + ((size_t)t * heads + h) * D;
        if (bias[part]) add_bias(v, bias[part] + (size_t)(h - first) * D, D);
        if (part < 2 && norm[part]) head_norm(v, norm[part], eps, D);
    }
}
