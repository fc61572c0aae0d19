/* What blockq.c offers the other kernels compiled with it (decode_layers.c). */
#include <stdint.h>

enum { Q4_1, Q8_0 };  /* block kinds, as blockq.py's KINDS orders them */

/* y[M,N] = x[M,K] @ W[N,K]^T from W's blocks; an orphaned `omp for nowait` over W's rows. */
void block_rows(int kind, const float *x, int M, int K, const uint8_t *qs, const float *scales, float *y, int N);
