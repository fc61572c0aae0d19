/* What decode_layers.c's layer stack shares with its attention (decode_attend.c) and its head steps
 * (decode_heads.c): the team barrier, fp32 e^x and dot products, the ragged segments of a call. */
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

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

void team_sync(Team *team, int *phase);

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

/* The segments of a call: segment b is tokens starts[b] .. starts[b + 1] - 1 of cache row row[b];
 * its attention work items (kv heads x chunks of its live slots) are items[b] .. items[b + 1] - 1,
 * its live slots 0 .. len[b] - 1 (1 + its largest position). */
typedef struct {
    int B;
    const int64_t *starts, *row, *items, *len;
} Segments;

/* floats of one thread's attention scratch for `queries` queries a work item */
int64_t attend_scratch(int queries, int D, int CH);

/* att[t, h] for every token of the call's segments (decode_attend.c says how) */
void attend(const float *qkv, const int64_t *pos, const Segments *sg, int T, int W, int nq, int nkv, int D, int S,
            int CH, float scale, const float *kc, const float *vc, float *att, float *part, float *scores, Team *team,
            int *phase);
