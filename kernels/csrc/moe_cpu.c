/*
 * A sparse MoE MLP (Mixtral, Qwen3-MoE) of a small step in one call: router, top-k, the chosen
 * experts' SwiGLU MLPs, the weighted sum (kernels/moe_cpu.py; common/models/moe.py takes it for
 * decode-sized steps on the CPU).
 *
 * It rounds where the PyTorch path it replaces rounds (common/models/moe_experts.py's gathered
 * path, HF's router): the router logits, each expert's gate|up rows, SiLU, its product with up,
 * and each expert's down output in the model dtype; softmax, renormalisation and the weighted
 * sum in fp32 (the weights rounded to the model dtype first for Qwen3-MoE, kept in fp32 for
 * Mixtral). Sums run in this file's order, not PyTorch's (compiled with -ffast-math so the dot
 * products vectorise), so results agree with that path to fp32 reassociation, not bit for bit;
 * exp is libm's. Ties in the top-k go to the lower expert index.
 *
 * Phases over the whole step, each an OpenMP loop over independent dot products (rows of the
 * router, of the chosen experts' gate|up, of their down), so a decode step of a few tokens still
 * spreads its expert rows over the threads.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#define PARALLEL_MIN_MACS (1 << 15) /* below this a step's phase runs on one thread */

/* Σ a[i] b[i] over n, a and b of `dtype`; `a_f32`: a is fp32 whatever the dtype. */
static float dot(const void *a, const void *b, int64_t n, int dtype, int a_f32) {
    float acc = 0.0f;
    if (dtype == DTYPE_F32) {
        const float *x = a, *y = b;
        for (int64_t i = 0; i < n; i++) acc += x[i] * y[i];
    } else if (a_f32) {
        const float *x = a;
        const uint16_t *y = b;
        for (int64_t i = 0; i < n; i++) acc += x[i] * bf16_to_f32(y[i]);
    } else {
        const uint16_t *x = a, *y = b;
        for (int64_t i = 0; i < n; i++) acc += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    }
    return acc;
}

/* Softmax over `num_experts` logits, the top k (highest first, ties to the lower index), their
 * renormalisation; the weights rounded to the model dtype unless `fp32_weights`. */
static void route_token(const float *logits, int64_t num_experts, int k, int renormalize,
                        int fp32_weights, int dtype, int64_t *ids, float *weights, float *probs) {
    float max = logits[0], sum = 0.0f;
    for (int64_t e = 1; e < num_experts; e++) max = logits[e] > max ? logits[e] : max;
    for (int64_t e = 0; e < num_experts; e++) sum += probs[e] = expf(logits[e] - max);
    for (int64_t e = 0; e < num_experts; e++) probs[e] /= sum;
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; e++)
            if (probs[e] >= 0.0f && (best < 0 || probs[e] > probs[best])) best = e;
        ids[j] = best;
        weights[j] = probs[best];
        total += probs[best];
        probs[best] = -1.0f; /* taken */
    }
    for (int j = 0; j < k; j++) {
        const float w = renormalize ? weights[j] / total : weights[j];
        weights[j] = fp32_weights ? w : round_to(w, dtype);
    }
}

/*
 * out (T, H); x (T, H); router (E, H); gate_up (E, 2I, H) gate rows then up rows; down (E, H, I);
 * all contiguous, of `dtype` (0 fp32, 1 bf16). Returns 0, or 1 when scratch memory ran out.
 */
int pdserve_moe_decode(void *out, const void *x, const void *router, const void *gate_up,
                       const void *down, int64_t num_tokens, int64_t hidden, int64_t inter,
                       int64_t num_experts, int k, int renormalize, int fp32_weights, int dtype,
                       int threads) {
    const size_t elem = ELEM_SIZE(dtype);
    const int64_t T = num_tokens, H = hidden, I = inter, E = num_experts, A = num_tokens * k;
    float *logits = malloc(sizeof(float) * T * E * 2);
    int64_t *ids = malloc(sizeof(int64_t) * A);
    float *weights = malloc(sizeof(float) * A);
    float *h = malloc(sizeof(float) * A * 2 * I);
    float *act = malloc(sizeof(float) * A * I);
    float *routed = malloc(sizeof(float) * A * H);
    if (!logits || !ids || !weights || !h || !act || !routed) {
        free(logits), free(ids), free(weights), free(h), free(act), free(routed);
        return 1;
    }
    float *probs = logits + T * E;
    const char *xb = x, *rb = router, *gb = gate_up, *db = down;

#pragma omp parallel for collapse(2) num_threads(threads) if (T * E * H >= PARALLEL_MIN_MACS)
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++)
            logits[t * E + e] = round_to(dot(xb + t * H * elem, rb + e * H * elem, H, dtype, 0), dtype);

    for (int64_t t = 0; t < T; t++)
        route_token(logits + t * E, E, k, renormalize, fp32_weights, dtype, ids + t * k,
                    weights + t * k, probs + t * E);

#pragma omp parallel for collapse(2) num_threads(threads) if (A * 2 * I * H >= PARALLEL_MIN_MACS)
    for (int64_t a = 0; a < A; a++)
        for (int64_t r = 0; r < 2 * I; r++) {
            const char *row = gb + (ids[a] * 2 * I + r) * H * elem;
            h[a * 2 * I + r] = round_to(dot(xb + (a / k) * H * elem, row, H, dtype, 0), dtype);
        }

    for (int64_t a = 0; a < A; a++)
        for (int64_t i = 0; i < I; i++) {
            const float gate = h[a * 2 * I + i];
            const float silu = round_to(gate / (1.0f + expf(-gate)), dtype);
            act[a * I + i] = round_to(silu * h[a * 2 * I + I + i], dtype);
        }

#pragma omp parallel for collapse(2) num_threads(threads) if (A * H * I >= PARALLEL_MIN_MACS)
    for (int64_t a = 0; a < A; a++)
        for (int64_t r = 0; r < H; r++) {
            const char *row = db + (ids[a] * H + r) * I * elem;
            routed[a * H + r] = round_to(dot(act + a * I, row, I, dtype, 1), dtype);
        }

    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < H; r++) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++) sum += routed[(t * k + j) * H + r] * weights[t * k + j];
            if (dtype == DTYPE_F32) ((float *)out)[t * H + r] = sum;
            else ((uint16_t *)out)[t * H + r] = f32_to_bf16(sum);
        }
    free(logits), free(ids), free(weights), free(h), free(act), free(routed);
    return 0;
}
