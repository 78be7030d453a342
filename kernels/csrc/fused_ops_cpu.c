/*
 * The fused ops of a Llama-family decoder layer on the CPU: RMSNorm (alone, or after the
 * residual add), SiLU-and-mul of the fused gate|up projection, and RoPE of the fused q|k|v
 * projection with the rotated K and the V written into the paged KV cache (of the model dtype,
 * or float8_e4m3fn: the same values converted).
 *
 * Built with paged_attention_cpu.c into one library by kernels/native.py and called through
 * ctypes by the CPU launchers of kernels/{rms_norm,activation,rotary}.py, which check every
 * shape, dtype and stride first; nothing here re-validates, except the positions and slots the
 * rotary op indexes memory with (values the launcher cannot see without reading them).
 *
 * Numerics. The engine's greedy output must equal HF transformers' token for token, so each op
 * repeats the rounding sequence of HF's PyTorch code as PyTorch's CPU kernels run it, bit for
 * bit (tests/kernels/test_fused_ops_cpu.py holds them to torch.equal):
 *   - every op HF runs in the model dtype rounds its fp32 result to that dtype (bf16: to
 *     nearest even), so intermediate values are rounded exactly where HF's would be;
 *   - the RMSNorm sum of squares adds in the order of PyTorch's own sum (sum_of_squares);
 *   - SiLU computes x / (1 + exp(-x)) with SLEEF's expf_u10 algorithm, the exp PyTorch's
 *     vectorised silu calls (PyTorch's scalar tail loop uses libm's expf instead; HF's tensors
 *     have whole vectors in practice: I % 32 == 0).
 * Hence this file is compiled with -ffp-contract=off (no a*b+c contracted into an FMA) and
 * without -ffast-math (no reassociation); the fmaf calls in sleef_expf are SLEEF's own FMAs.
 *
 * Threads: a decode step's rows are tiny (one token of a small model is a few hundred floats),
 * and an OpenMP fork/join costs more than such a row, so rows are spread over threads only when
 * a call has at least PARALLEL_MIN_ELEMS elements.
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_MIN_ELEMS (1 << 16)

#define INLINE static inline __attribute__((always_inline))

/* Element i of `base` as fp32. `dtype` is a constant wherever this is inlined, so each loop
 * gets a branch-free copy per dtype. */
INLINE float load(const void *base, int64_t i, int dtype) {
    return dtype == DTYPE_F32 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

INLINE void store(void *base, int64_t i, float value, int dtype) {
    if (dtype == DTYPE_F32) ((float *)base)[i] = value;
    else ((uint16_t *)base)[i] = f32_to_bf16(value);
}

/* Store `value`, a result of an op in `dtype`, into a KV cache of `cache_dtype` (`dtype`, or
 * DTYPE_FP8_E4M3): rounded to `dtype` first, then for fp8 converted as
 * `.to(torch.float8_e4m3fn)` would convert the cache of `dtype` holding it. */
INLINE void store_cache(void *base, int64_t i, float value, int dtype, int cache_dtype) {
    if (cache_dtype == DTYPE_FP8_E4M3)
        ((uint8_t *)base)[i] = f32_to_e4m3(round_to(value, dtype));
    else store(base, i, value, dtype);
}

/* fn(args, first, last) computes rows [first, last) and returns a status (0 = done). */
typedef int (*RowsFn)(const void *args, int64_t first, int64_t last);

/* Runs fn over rows [0, rows): on the calling thread when the call has fewer than
 * PARALLEL_MIN_ELEMS elements (no OpenMP call at all), else split evenly between num_threads.
 * Returns the largest status. */
static int for_rows(RowsFn fn, const void *args, int64_t rows, int64_t row_elems,
                    int num_threads) {
    if (rows < 2 || num_threads < 2 || rows * row_elems < PARALLEL_MIN_ELEMS)
        return fn(args, 0, rows);
    int status = 0;
#pragma omp parallel num_threads(num_threads) reduction(max : status)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        status = fn(args, rows * t / n, rows * (t + 1) / n);
    }
    return status;
}

/* --------------------------------------------------------------------------------------- */
/* RMSNorm                                                                                  */
/* --------------------------------------------------------------------------------------- */

/* The sum of squares in the order of PyTorch's CPU sum (aten/src/ATen/native/cpu/
 * SumKernel.cpp: cascade_sum -> vectorized_inner_sum -> row_sum -> multi_row_sum), which HF's
 * `hidden_states.pow(2).mean(-1)` runs. It reads a row as vectors of LANES floats, taken ILP
 * at a time (a group) into ILP interleaved vector accumulators, each a cascade of LEVELS
 * partial sums: level 0 takes the groups, and after every 2^level_power groups each level is
 * added into the next while the group count is a multiple of its span. Then the levels are
 * summed, the vectors left over after the last whole group join accumulator 0, the
 * accumulators are added 0+1+2+3, and a scalar total adds the elements left over after the
 * last whole vector and then the LANES lanes in order. Rows shorter than one vector go
 * through row_sum on scalars. PyTorch dispatches its sum to the AVX2 kernel on AVX-512 CPUs
 * too, so LANES is 8 on every x86 CPU with AVX2. */
#define LANES 8
#define ILP 4
#define LEVELS 4

static int ceil_log2(int64_t x) { /* utils::CeilLog2 */
    int bits = 1;
    while (x > 2 && ((int64_t)1 << bits) < x) bits++;
    return bits;
}

INLINE void add_squares(float acc[ILP][LANES], const float *h, int64_t group) {
    for (int k = 0; k < ILP; k++)
        for (int l = 0; l < LANES; l++) {
            const float x = h[(group * ILP + k) * LANES + l];
            acc[k][l] += x * x;
        }
}

static float sum_of_squares(const float *h, int64_t n) {
    if (n < LANES) { /* scalar_inner_sum: row_sum over single elements */
        float part[ILP] = {0};
        int64_t i = 0;
        for (; i + ILP <= n; i += ILP)
            for (int k = 0; k < ILP; k++) part[k] += h[i + k] * h[i + k];
        for (; i < n; i++) part[0] += h[i] * h[i];
        return ((part[0] + part[1]) + part[2]) + part[3];
    }
    const int64_t vectors = n / LANES, groups = vectors / ILP; /* groups of ILP vectors */
    /* level_power = max(4, CeilLog2(groups) / LEVELS): 4 for any row under 2^21 floats */
    const int power = ceil_log2(groups) / LEVELS > 4 ? ceil_log2(groups) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][ILP][LANES];
    memset(acc, 0, sizeof acc);
    int64_t g = 0;
    while (g + step <= groups) {
        for (int64_t j = 0; j < step; j++, g++) add_squares(acc[0], h, g);
        for (int level = 1; level < LEVELS; level++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < LANES; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((g & (mask << (level * power))) != 0) break;
        }
    }
    for (; g < groups; g++) add_squares(acc[0], h, g);
    for (int level = 1; level < LEVELS; level++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < LANES; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = groups * ILP; v < vectors; v++) /* leftover vectors, into accumulator 0 */
        for (int l = 0; l < LANES; l++) acc[0][0][l] += h[v * LANES + l] * h[v * LANES + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < LANES; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t i = vectors * LANES; i < n; i++) total += h[i] * h[i];
    for (int l = 0; l < LANES; l++) total += acc[0][0][l];
    return total;
}

/* One row. HF: r = residual + x (model dtype); h = float(r); h *= rsqrt(mean(h^2) + eps);
 * out = weight * h.to(dtype). `h` is n floats of scratch. */
INLINE void rms_norm_row(void *out, void *residual_out, const void *x, const void *residual,
                         const void *weight, int64_t n, float eps, int dtype, float *h) {
    if (residual != NULL) {
        for (int64_t i = 0; i < n; i++) {
            h[i] = round_to(load(residual, i, dtype) + load(x, i, dtype), dtype);
            store(residual_out, i, h[i], dtype);
        }
    } else {
        for (int64_t i = 0; i < n; i++) h[i] = load(x, i, dtype);
    }
    const float inv_rms = 1.0f / sqrtf(sum_of_squares(h, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++)
        store(out, i, load(weight, i, dtype) * round_to(h[i] * inv_rms, dtype), dtype);
}

typedef struct {
    void *out, *residual_out;
    const void *x, *residual, *weight;
    int64_t n, x_stride, residual_stride;
    float eps;
    int dtype;
} RmsNormArgs;

static int rms_norm_rows(const void *args, int64_t first, int64_t last) {
    const RmsNormArgs *a = args;
    const size_t elem = ELEM_SIZE(a->dtype);
    float *h = malloc(sizeof(float) * (size_t)a->n);
    if (h == NULL) return 1;
    for (int64_t row = first; row < last; row++) {
        void *out = (char *)a->out + row * a->n * elem;
        const void *x = (const char *)a->x + row * a->x_stride * elem;
        void *residual_out = NULL;
        const void *residual = NULL;
        if (a->residual != NULL) {
            residual_out = (char *)a->residual_out + row * a->n * elem;
            residual = (const char *)a->residual + row * a->residual_stride * elem;
        }
        if (a->dtype == DTYPE_F32)
            rms_norm_row(out, residual_out, x, residual, a->weight, a->n, a->eps, DTYPE_F32, h);
        else
            rms_norm_row(out, residual_out, x, residual, a->weight, a->n, a->eps, DTYPE_BF16, h);
    }
    free(h);
    return 0;
}

/* out (rows, n), contiguous; x (rows, n) with row stride x_stride (elements). With `residual`
 * non-NULL (row stride residual_stride), residual_out (rows, n, contiguous) = residual + x and
 * out = RMSNorm(residual_out). Returns 0, or 1 when scratch memory could not be allocated. */
int pdserve_rms_norm(void *out, void *residual_out, const void *x, const void *residual,
                     const void *weight, int64_t rows, int64_t n, int64_t x_stride,
                     int64_t residual_stride, float eps, int dtype, int num_threads) {
    const RmsNormArgs args = {.out = out, .residual_out = residual_out, .x = x,
                              .residual = residual, .weight = weight, .n = n,
                              .x_stride = x_stride, .residual_stride = residual_stride,
                              .eps = eps, .dtype = dtype};
    return for_rows(rms_norm_rows, &args, rows, n, num_threads);
}

/* --------------------------------------------------------------------------------------- */
/* SiLU and mul                                                                             */
/* --------------------------------------------------------------------------------------- */

/* SLEEF's xexpf (sleefsimdsp.c, the u10 expf of Sleef_expf8_u10), step for step: n = rint(d /
 * ln 2); s = d - n ln 2 in two parts; a degree-6 polynomial by FMAs; times 2^n in two factors.
 * Branch-free, so the loop that calls it vectorises. */
INLINE float pow2i(int32_t q) {
    const uint32_t bits = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE float sleef_expf(float d) {
    /* n from d clamped to (-104, 100), which keeps the conversion to int defined: outside
     * that range the result is replaced below, and a NaN d still yields NaN through s */
    const float bounded = d > -104.0f ? (d < 100.0f ? d : 100.0f) : -104.0f;
    const float n = rintf(bounded * 1.442695040888963407359924681001892137f);
    const int32_t q = (int32_t)n;
    float s = fmaf(n, -0.693145751953125f, d);
    s = fmaf(n, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    return d > 100.0f ? INFINITY : u;
}

/* One row: x = [gate | up], each n wide. HF: act_fn(gate) * up, both ops in the model dtype. */
INLINE void silu_and_mul_row(void *out, const void *x, int64_t n, int dtype) {
    for (int64_t i = 0; i < n; i++) {
        const float gate = load(x, i, dtype);
        const float silu = round_to(gate / (1.0f + sleef_expf(-gate)), dtype);
        store(out, i, silu * load(x, n + i, dtype), dtype);
    }
}

typedef struct {
    void *out;
    const void *x;
    int64_t n, x_stride;
    int dtype;
} SiluAndMulArgs;

static int silu_and_mul_rows(const void *args, int64_t first, int64_t last) {
    const SiluAndMulArgs *a = args;
    const size_t elem = ELEM_SIZE(a->dtype);
    for (int64_t row = first; row < last; row++) {
        void *out = (char *)a->out + row * a->n * elem;
        const void *x = (const char *)a->x + row * a->x_stride * elem;
        if (a->dtype == DTYPE_F32) silu_and_mul_row(out, x, a->n, DTYPE_F32);
        else silu_and_mul_row(out, x, a->n, DTYPE_BF16);
    }
    return 0;
}

/* out (rows, n) contiguous; x (rows, 2n) with row stride x_stride (elements). Returns 0. */
int pdserve_silu_and_mul(void *out, const void *x, int64_t rows, int64_t n, int64_t x_stride,
                         int dtype, int num_threads) {
    const SiluAndMulArgs args = {.out = out, .x = x, .n = n, .x_stride = x_stride,
                                 .dtype = dtype};
    return for_rows(silu_and_mul_rows, &args, rows, n, num_threads);
}

/* --------------------------------------------------------------------------------------- */
/* Rotary embedding + KV cache write                                                        */
/* --------------------------------------------------------------------------------------- */

/* `heads` heads of `dim` elements from src, rotated into dst (both contiguous). HF:
 * x * cos + rotate_half(x) * sin in the model dtype, i.e. per half
 *   out1 = x1 * c + (-x2) * s,  out2 = x2 * c + x1 * s,  each product and sum rounded.
 * dst is of `dst_dtype`: `dtype`, or fp8 for an fp8 cache (store_cache). */
INLINE void rotate_heads(void *dst, const void *src, int heads, int dim, const float *c,
                         const float *s, int dtype, int dst_dtype) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++) {
        const int64_t base = (int64_t)h * dim;
        for (int i = 0; i < half; i++) {
            const float x1 = load(src, base + i, dtype), x2 = load(src, base + half + i, dtype);
            const float out1 = round_to(x1 * c[i], dtype) + round_to(-x2 * s[i], dtype);
            const float out2 = round_to(x2 * c[i], dtype) + round_to(x1 * s[i], dtype);
            store_cache(dst, base + i, out1, dtype, dst_dtype);
            store_cache(dst, base + half + i, out2, dtype, dst_dtype);
        }
    }
}

typedef struct {
    void *q_out, *cache;
    const void *qkv, *cos_sin;
    const int64_t *positions, *slots;
    int num_heads, num_kv_heads, head_dim, block_size;
    int64_t qkv_stride;                          /* elements of qkv */
    int64_t cache_kv_stride, cache_block_stride; /* elements of the cache */
    int dtype, cache_dtype;
} RotaryArgs;

/* Token t: q rotated into q_out; unless its slot is negative (-1: padding), K rotated and V
 * copied (fp8: converted) into the slot's row of the K and V planes. */
INLINE void rotary_token(const RotaryArgs *a, int64_t t, int dtype, int cache_dtype) {
    const int dim = a->head_dim, half = dim / 2;
    const size_t elem = ELEM_SIZE(dtype);
    float c[half], s[half];
    const int64_t table = a->positions[t] * dim;
    for (int i = 0; i < half; i++) {
        c[i] = load(a->cos_sin, table + i, dtype);
        s[i] = load(a->cos_sin, table + half + i, dtype);
    }
    const char *q = (const char *)a->qkv + t * a->qkv_stride * (int64_t)elem;
    void *q_out = (char *)a->q_out + t * (int64_t)a->num_heads * dim * (int64_t)elem;
    rotate_heads(q_out, q, a->num_heads, dim, c, s, dtype, dtype);
    const int64_t slot = a->slots[t];
    if (slot < 0) return;
    const int64_t kv_row = (int64_t)a->num_kv_heads * dim;
    const size_t cache_elem = ELEM_SIZE(cache_dtype);
    const char *k = q + (int64_t)a->num_heads * dim * (int64_t)elem;
    const char *v = k + kv_row * (int64_t)elem;
    char *k_dst = (char *)a->cache + ((slot / a->block_size) * a->cache_block_stride +
                                      (slot % a->block_size) * kv_row) * (int64_t)cache_elem;
    char *v_dst = k_dst + a->cache_kv_stride * (int64_t)cache_elem;
    rotate_heads(k_dst, k, a->num_kv_heads, dim, c, s, dtype, cache_dtype);
    if (cache_dtype == DTYPE_FP8_E4M3) {
        uint8_t *dst = (uint8_t *)v_dst;
        for (int64_t i = 0; i < kv_row; i++) dst[i] = f32_to_e4m3(load(v, i, dtype));
    } else {
        memcpy(v_dst, v, (size_t)kv_row * elem);
    }
}

static int rotary_rows(const void *args, int64_t first, int64_t last) {
    const RotaryArgs *a = args;
    const int fp8 = a->cache_dtype == DTYPE_FP8_E4M3;
    for (int64_t t = first; t < last; t++) {
        if (a->dtype == DTYPE_F32) {
            if (fp8) rotary_token(a, t, DTYPE_F32, DTYPE_FP8_E4M3);
            else rotary_token(a, t, DTYPE_F32, DTYPE_F32);
        } else {
            if (fp8) rotary_token(a, t, DTYPE_BF16, DTYPE_FP8_E4M3);
            else rotary_token(a, t, DTYPE_BF16, DTYPE_BF16);
        }
    }
    return 0;
}

/* qkv (tokens, (H + 2 Hkv) * D) with row stride qkv_stride; q_out (tokens, H, D) contiguous;
 * cache (2, N, block_size, Hkv, D), the inner three dims contiguous, strides in its elements;
 * cos_sin (max_position, D) contiguous. qkv, q_out and cos_sin are of `dtype` (DTYPE_F32 or
 * DTYPE_BF16), the cache of `cache_dtype` (`dtype`, or DTYPE_FP8_E4M3: the values a cache of
 * `dtype` would hold, converted). Returns 0; 2 when a position is outside [0, max_position) or
 * a slot is >= num_slots (refused before anything is written). */
int pdserve_rotary_embedding_and_cache(void *q_out, void *cache, const void *qkv,
                                       const int64_t *positions, const void *cos_sin,
                                       const int64_t *slots, int64_t tokens, int num_heads,
                                       int num_kv_heads, int head_dim, int block_size,
                                       int64_t qkv_stride, int64_t cache_kv_stride,
                                       int64_t cache_block_stride, int64_t max_position,
                                       int64_t num_slots, int dtype, int cache_dtype,
                                       int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position || slots[t] >= num_slots) return 2;
    const RotaryArgs args = {.q_out = q_out, .cache = cache, .qkv = qkv, .cos_sin = cos_sin,
                             .positions = positions, .slots = slots, .num_heads = num_heads,
                             .num_kv_heads = num_kv_heads, .head_dim = head_dim,
                             .block_size = block_size, .qkv_stride = qkv_stride,
                             .cache_kv_stride = cache_kv_stride,
                             .cache_block_stride = cache_block_stride, .dtype = dtype,
                             .cache_dtype = cache_dtype};
    const int64_t row = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    return for_rows(rotary_rows, &args, tokens, row, num_threads);
}

/* --------------------------------------------------------------------------------------- */
/* float8_e4m3fn conversions, exported for the tests (bf16.h's, as the kernels use them)    */
/* --------------------------------------------------------------------------------------- */

/* dst[i] = src[i].to(torch.float8_e4m3fn), as bytes. Returns 0. */
int pdserve_f32_to_e4m3(const float *src, uint8_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f32_to_e4m3(src[i]);
    return 0;
}

/* dst[i] = the fp32 value of e4m3 byte src[i]. Returns 0. */
int pdserve_e4m3_to_f32(const uint8_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = e4m3_to_f32(src[i]);
    return 0;
}
