/* What blockq.c offers the other kernels compiled with it (decode_layers.c). */
#include <stdint.h>

/* block layouts, as blockq.py's LAYOUTS orders them (blockq.c says what each holds) */
enum { Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, Q8_S16, F16, BF16, F32, Q4_K, Q5_K, Q6_K };

/* y[M,N] = x[M,K] @ W[N,K]^T from W's blocks (y's rows ldy apart); an orphaned `omp for nowait`
 * over W's rows. */
void block_rows(int kind, const float *x, int M, int K, const uint8_t *qs, const float *scales, float *y, int N,
                int ldy);

/* Bytes ahead of a stream that the kernels ask the cache for (blockq_set_prefetch: measured per
 * machine at load); the layer stack's attention streams its keys and values at the same distance. */
int blockq_prefetch(void);
