/*
 * Fused token sampling on the CPU: temperature, top-k, top-p, min-p and the seeded Gumbel draw
 * of every row in one call (kernels/sampler.py holds the contract, the Triton twin and the ref).
 *
 * A row's parameters are PARAM_WORDS int32 words (kernels/sampler.py: pack_params): the seed's
 * low and high words, the position's low word, top_k (<= 0: none), the float32 bits of the
 * temperature (0: greedy), top_p and min_p; the row's slot in the penalty counts (-1: none),
 * the bits of the repetition, frequency and presence penalties, and up to NEW_TOKENS output
 * tokens to count first. A slot's counts are int16: the sign bit marks a prompt token, the low
 * 15 bits count it in the output. The noise of token v is -log(u(hash(seed, position,
 * v))), the same 32-bit hash as common/sampler.py's, and the token is argmax(probs / noise) over
 * the kept tokens; every filter keeps a prefix of the tokens sorted by logit. Per row:
 *   - greedy: the first largest logit (torch.argmax);
 *   - no top-k and no top-p: one pass (min-p needs only the row's max and sum);
 *   - otherwise: the n largest tokens (quickselect, then a sort of those n) with n = top_k, or
 *     64 growing eightfold until the top-p prefix ends inside them (a flat distribution sorts
 *     more of its row, the whole row at worst).
 * Compiled without -ffast-math: expf/logf are libm's, the sums run in index order.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PARAM_WORDS 16
#define NEW_TOKENS 4
#define FIRST_CANDIDATES 64
#define PARALLEL_MIN_ELEMS (1 << 16)

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

static inline uint32_t row_key(const int32_t *p) {
    const uint32_t lo = (uint32_t)p[0], hi = (uint32_t)p[1], pos = (uint32_t)p[2];
    return fmix32(lo ^ fmix32(hi ^ fmix32(pos * 0x9E3779B1u + 0x7F4A7C15u)));
}

static inline float noise(uint32_t key, int64_t id) {
    const uint32_t bits = fmix32(key ^ fmix32((uint32_t)id * 0x27D4EB2Fu + 0x165667B1u));
    return -logf(((float)(bits >> 8) + 0.5f) * (1.0f / 16777216.0f));
}

/* prob / noise, or -1 where the noise rounds to 0 (see _gumbel_key in kernels/sampler.py). */
static inline float gumbel_key(float prob, uint32_t key, int64_t id) {
    const float n = noise(key, id);
    return n > 0.0f ? prob / n : -1.0f;
}

static inline float word_float(int32_t w) {
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* An int64 that orders as (x, then lower id): the float's order key high, V - 1 - id low. */
static inline int64_t pack(float x, int64_t id, int64_t V) {
    int32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const int32_t key = bits ^ ((bits >> 31) & 0x7FFFFFFF);
    return (int64_t)(((uint64_t)(int64_t)key << 32) | (uint32_t)(V - 1 - id));
}

static inline float unpack_x(int64_t packed) {
    const int32_t key = (int32_t)(packed >> 32);
    const int32_t bits = key ^ ((key >> 31) & 0x7FFFFFFF);
    return word_float(bits);
}

static inline int64_t unpack_id(int64_t packed, int64_t V) {
    return V - 1 - (int64_t)(uint32_t)packed;
}

static void swap(int64_t *a, int64_t *b) {
    const int64_t t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges a[0, n) so that its `k` largest values come first (in no order). */
static void select_largest(int64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (a[mid] > a[lo]) swap(&a[mid], &a[lo]); /* median of three to a[lo] */
        if (a[hi] > a[lo]) swap(&a[hi], &a[lo]);
        if (a[mid] > a[hi]) swap(&a[mid], &a[hi]);
        const int64_t pivot = a[hi];
        int64_t store = lo;
        for (int64_t i = lo; i < hi; i++)
            if (a[i] > pivot) swap(&a[i], &a[store++]);
        swap(&a[store], &a[hi]);
        if (store == k - 1 || store == k) return;
        if (store < k) lo = store + 1;
        else hi = store - 1;
    }
}

static int descending(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

typedef struct {
    const float *logits;
    int64_t V;
    float temperature, top_p, min_p;
    int64_t top_k; /* V when none */
    uint32_t key;
} Row;

static int64_t greedy(const Row *r) {
    int64_t best = 0;
    for (int64_t v = 1; v < r->V; v++)
        if (r->logits[v] > r->logits[best]) best = v;
    return best;
}

/* No top-k, no top-p: probs over the whole row, min-p against the largest (exp(0) / s). */
static int64_t draw_whole_row(const Row *r, float m) {
    float s = 0.0f;
    for (int64_t v = 0; v < r->V; v++) s += expf(r->logits[v] / r->temperature - m);
    const float floor = r->min_p * (1.0f / s);
    float best_key = -1.0f;
    int64_t best = 0;
    for (int64_t v = 0; v < r->V; v++) {
        const float prob = expf(r->logits[v] / r->temperature - m) / s;
        const float key = prob >= floor ? gumbel_key(prob, r->key, v) : -1.0f;
        if (key > best_key) best_key = key, best = v;
    }
    return best;
}

/* How many of the sorted candidates c[0, n) top-k and top-p keep (a prefix), the ref's way:
 * probs renormalised over the top-k, kept while the mass strictly ahead is below top_p. */
static int64_t kept_prefix(const Row *r, const int64_t *c, int64_t n, float m, float s_k) {
    float ahead = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        if (i >= r->top_k || (i > 0 && ahead >= r->top_p)) return i;
        ahead += expf(unpack_x(c[i]) - m) / s_k;
    }
    return n;
}

/* top-k and/or top-p: the kept prefix of the sorted largest tokens, then min-p and the draw. */
static int64_t draw_prefix(const Row *r, float m, int64_t *c) {
    for (int64_t v = 0; v < r->V; v++) c[v] = pack(r->logits[v] / r->temperature, v, r->V);
    float s = 0.0f;
    if (r->top_k == r->V)
        for (int64_t v = 0; v < r->V; v++) s += expf(unpack_x(c[v]) - m);
    int64_t n = r->top_k < r->V ? r->top_k : FIRST_CANDIDATES, kept;
    for (;;) {
        n = n < r->V ? n : r->V;
        select_largest(c, r->V, n);
        qsort(c, (size_t)n, sizeof *c, descending);
        float s_k = s;
        if (r->top_k < r->V) {
            s_k = 0.0f;
            for (int64_t i = 0; i < n; i++) s_k += expf(unpack_x(c[i]) - m);
        }
        kept = kept_prefix(r, c, n, m, s_k);
        if (kept < n || n >= r->top_k) break;
        n *= 8;
    }
    float s_kept = 0.0f;
    for (int64_t i = 0; i < kept; i++) s_kept += expf(unpack_x(c[i]) - m);
    const float floor = r->min_p * (expf(unpack_x(c[0]) - m) / s_kept);
    float best_key = -1.0f;
    int64_t best = unpack_id(c[0], r->V);
    for (int64_t i = 0; i < kept; i++) {
        const float prob = expf(unpack_x(c[i]) - m) / s_kept;
        if (prob < floor) break; /* probs fall along the prefix */
        const int64_t id = unpack_id(c[i], r->V);
        const float key = gumbel_key(prob, r->key, id);
        if (key > best_key) best_key = key, best = id;
    }
    return best;
}

/* The row's new tokens counted, then its logits penalised into `out` (the ref's arithmetic:
 * a separate multiply and subtract, no FMA, as compiled here). */
static void penalise(float *out, const float *logits, const int32_t *p, int16_t *counts,
                     int64_t V) {
    for (int32_t j = 0; j < p[11] && j < NEW_TOKENS; j++)
        if (p[12 + j] >= 0 && p[12 + j] < V) counts[p[12 + j]]++;
    const float repetition = word_float(p[8]), frequency = word_float(p[9]);
    const float presence = word_float(p[10]);
    for (int64_t v = 0; v < V; v++) {
        const int32_t c = counts[v];
        const float count = (float)(c & 0x7FFF), x = logits[v];
        const float seen = c != 0 ? (x > 0.0f ? x / repetition : x * repetition) : x;
        out[v] = seen - frequency * count - presence * (count > 0.0f ? 1.0f : 0.0f);
    }
}

static int64_t sample_row(const float *logits, const int32_t *p, int16_t *counts, int64_t V,
                          int64_t *scratch, float *penalised) {
    if (p[7] >= 0) {
        penalise(penalised, logits, p, counts + (int64_t)p[7] * V, V);
        logits = penalised;
    }
    Row r = {logits, V, word_float(p[4]), word_float(p[5]), word_float(p[6]),
             p[3] > 0 && p[3] < V ? p[3] : V, row_key(p)};
    if (!(r.temperature > 0.0f)) return greedy(&r);
    float m = -INFINITY;
    for (int64_t v = 0; v < V; v++) m = fmaxf(m, logits[v] / r.temperature);
    if (r.top_k == V && r.top_p >= 1.0f) return draw_whole_row(&r, m);
    return draw_prefix(&r, m, scratch);
}

int pdserve_sample_tokens(int64_t *tokens, const float *logits, const int32_t *params,
                          int16_t *counts, int64_t rows, int64_t V, int64_t stride,
                          int num_threads) {
    int status = 0;
    const int parallel = rows > 1 && num_threads > 1 && rows * V >= PARALLEL_MIN_ELEMS;
#pragma omp parallel num_threads(parallel ? num_threads : 1) reduction(max : status)
    {
        int64_t *scratch = malloc((size_t)V * sizeof *scratch);
        float *penalised = malloc((size_t)V * sizeof *penalised);
        const int ok = scratch != NULL && penalised != NULL;
        status = ok ? 0 : 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < rows; i++)
            if (ok)
                tokens[i] = sample_row(logits + i * stride, params + i * PARAM_WORDS, counts, V,
                                       scratch, penalised);
        free(scratch);
        free(penalised);
    }
    return status;
}
