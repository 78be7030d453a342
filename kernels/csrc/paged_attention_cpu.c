/*
 * Decode attention over the paged KV cache on the CPU, reading every block in place.
 *
 * Built on first use by kernels/native.py (gcc or cc, -O3 for the host CPU, OpenMP) and
 * called through ctypes with raw pointers by kernels/cpu_attention.py, which checks every shape,
 * dtype and stride before a call, so nothing here re-validates.
 *
 * Why a native kernel: a CPU decode step is bound by memory traffic. The PyTorch path copies
 * each sequence's blocks into a contiguous workspace and then runs SDPA over it, so every K/V
 * byte is read twice and written once. Here a task reads each K and V row once, straight out
 * of its block, for all the query heads that share the kv head (GQA).
 *
 * One task = one (sequence, kv head), or one partition of its context when there are too few
 * sequences to keep every thread busy (flash-decoding's split: each partition leaves its max,
 * sum and unnormalised accumulator, and a second pass merges them). Tasks are spread over the
 * threads dynamically because context lengths differ. A task:
 *
 *     q_g * scale            for the G = H / Hkv query heads of the group   (G x D, fp32)
 *     s[g][t] = q_g . k_t    t = 0 .. seq_len-1, k_t read in place          (pass over K)
 *     p[g][t] = exp(s - max) and the row sums                               (in the buffer)
 *     acc[g] += p[g][t] v_t                                                 (pass over V)
 *     out = acc / sum
 *
 * The cache of one layer is (2, num_blocks, block_size, Hkv, D), contiguous: token slot
 * `b * block_size + i` of kv head h starts at element ((b * block_size + i) * Hkv + h) * D of
 * the K (or V) half. Its elements are of the query's dtype or float8_e4m3fn (`cache_dtype`);
 * fp8 rows are widened to fp32 exactly, so the result equals that over the cache converted to
 * the query's dtype, bit for bit. Sequences whose query length is not 1 (prefill chunks) are
 * skipped; the caller computes those rows itself.
 *
 * Compile the math with -ffast-math (vectorised expf, reassociated dot products) but link the
 * shared object without it: GCC < 13 would otherwise link crtfastmath.o, which turns on
 * flush-to-zero for the whole process on load.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

/* Row `elem` of `base` as fp32: a pointer into the cache itself for fp32, else converted into
 * `buf`. */
INLINE const float *row_f32(const void *base, int64_t elem, int n, int dtype, float *buf) {
    if (dtype == DTYPE_F32) return (const float *)base + elem;
    if (dtype == DTYPE_FP8_E4M3) {
        const uint8_t *src = (const uint8_t *)base + elem;
        uint32_t wide[n]; /* widened first: the conversion then runs on 32-bit lanes */
        for (int i = 0; i < n; i++) wide[i] = src[i];
        for (int i = 0; i < n; i++) buf[i] = e4m3_to_f32(wide[i]);
        return buf;
    }
    const uint16_t *src = (const uint16_t *)base + elem;
    for (int i = 0; i < n; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

INLINE void store_row(void *base, int64_t elem, const float *src, float mul, int n, int dtype) {
    if (dtype == DTYPE_F32) {
        float *dst = (float *)base + elem;
        for (int i = 0; i < n; i++) dst[i] = src[i] * mul;
    } else {
        uint16_t *dst = (uint16_t *)base + elem;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * mul);
    }
}

/* Ask for the rows of one head in one block ahead of use: blocks lie anywhere in the cache, so
 * the hardware prefetcher cannot run ahead across them on its own. */
INLINE void prefetch_block(const void *cache, int64_t first, int64_t stride, int n, int row_bytes,
                           size_t elem) {
    const char *base = (const char *)cache + first * (int64_t)elem;
    for (int i = 0; i < n; i++)
        for (int off = 0; off < row_bytes; off += 64)
            __builtin_prefetch(base + (int64_t)i * stride * (int64_t)elem + off, 0, 0);
}

/* One task: kv head h of one sequence over `len` tokens whose blocks are table[0..]; the whole
 * context, or one partition of it (then `table` starts at the partition's first block). With
 * `partial` NULL it writes the normalised output rows; otherwise, per query head g,
 * partial[g * (head_dim + 2) ...] = (max score, sum of exp, unnormalised acc[head_dim]) for
 * merge_partials. `work` holds (2 * group + block_size) * head_dim + group * len floats.
 * Always inlined into the dispatcher below, so the common head sizes and each (query dtype,
 * cache dtype) pair get their own copy with constant trip counts (unrolled loops, accumulators
 * in registers). `dtype`: query and output; `cache_dtype`: K and V (`dtype` or fp8). */
INLINE void decode_task(void *out, float *partial, const void *query, const void *k_cache,
                        const void *v_cache, const int32_t *table, int64_t q_elem, int len, int h,
                        int group, int num_kv_heads, const int head_dim, int block_size,
                        float scale, const int dtype, const int cache_dtype, float *work) {
    float *q = work;                    /* group x head_dim, pre-scaled */
    float *acc = q + group * head_dim;  /* group x head_dim */
    float *buf = acc + group * head_dim; /* block_size x head_dim: converted bf16/fp8 rows */
    float *probs = buf + block_size * head_dim; /* group x len */
    const int64_t stride = (int64_t)num_kv_heads * head_dim; /* between token slots */
    const int64_t head = (int64_t)h * head_dim;
    const int num_blocks = (len + block_size - 1) / block_size;

    const float *qsrc = row_f32(query, q_elem, group * head_dim, dtype, acc);
    for (int i = 0; i < group * head_dim; i++) q[i] = qsrc[i] * scale;

    const size_t elem = ELEM_SIZE(cache_dtype);
    const int row_bytes = head_dim * (int)elem;
#define PREFETCH(cache, b)                                                                     \
    do {                                                                                       \
        if ((b) < num_blocks)                                                                  \
            prefetch_block(cache, (int64_t)table[b] * block_size * stride + head, stride,      \
                           block_size, row_bytes, elem);                                       \
    } while (0)

    /* pass over K: scores, block by block, fetching two blocks ahead (then V's first two) */
    PREFETCH(k_cache, 0);
    PREFETCH(k_cache, 1);
    if (num_blocks == 1) PREFETCH(v_cache, 0);
    for (int b = 0, t = 0; b < num_blocks; b++) {
        const int64_t first = (int64_t)table[b] * block_size * stride + head;
        const int n = len - t < block_size ? len - t : block_size;
        PREFETCH(k_cache, b + 2);
        if (b + 2 >= num_blocks) PREFETCH(v_cache, b + 2 - num_blocks);
        for (int i = 0; i < n; i++, t++) {
            const float *k = row_f32(k_cache, first + i * stride, head_dim, cache_dtype, buf);
            for (int g = 0; g < group; g++) {
                const float *qg = q + g * head_dim;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; d++) dot += qg[d] * k[d];
                probs[(int64_t)g * len + t] = dot;
            }
        }
    }
    /* softmax numerators in place */
    float inv_sum[group], max_score[group];
    for (int g = 0; g < group; g++) {
        float *p = probs + (int64_t)g * len;
        float m = p[0];
        for (int t = 1; t < len; t++) m = p[t] > m ? p[t] : m;
        float sum = 0.0f;
        for (int t = 0; t < len; t++) {
            p[t] = expf(p[t] - m);
            sum += p[t];
        }
        inv_sum[g] = 1.0f / sum;
        max_score[g] = m;
    }
    /* pass over V, a block at a time: each query head's accumulator stays in registers while
     * it sweeps the block's rows (cache-hot after the first head), instead of a load and a
     * store of the accumulator per row */
    memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int b = 0, t = 0; b < num_blocks; b++) {
        const int64_t first = (int64_t)table[b] * block_size * stride + head;
        const int n = len - t < block_size ? len - t : block_size;
        PREFETCH(v_cache, b + 2);
        const float *v0 = row_f32(v_cache, first, head_dim, cache_dtype, buf);
        int64_t v_stride = stride;
        if (cache_dtype != DTYPE_F32) { /* convert the block's rows once for all heads */
            for (int i = 1; i < n; i++)
                row_f32(v_cache, first + i * stride, head_dim, cache_dtype, buf + i * head_dim);
            v_stride = head_dim;
        }
        for (int g = 0; g < group; g++) {
            const float *p = probs + (int64_t)g * len + t;
            float a[head_dim];
            memcpy(a, acc + g * head_dim, sizeof a);
            for (int i = 0; i < n; i++) {
                const float *v = v0 + i * v_stride;
                for (int d = 0; d < head_dim; d++) a[d] += p[i] * v[d];
            }
            memcpy(acc + g * head_dim, a, sizeof a);
        }
        t += n;
    }
#undef PREFETCH
    for (int g = 0; g < group; g++) {
        if (partial == NULL) {
            store_row(out, q_elem + (int64_t)g * head_dim, acc + g * head_dim, inv_sum[g],
                      head_dim, dtype);
        } else {
            float *dst = partial + (int64_t)g * (head_dim + 2);
            dst[0] = max_score[g];
            dst[1] = 1.0f / inv_sum[g];
            memcpy(dst + 2, acc + g * head_dim, sizeof(float) * (size_t)head_dim);
        }
    }
}

/* Output rows of kv head h's query group from `num_parts` partitions' partial results:
 * out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M), M = max_p m_p. `acc` is scratch
 * (head_dim floats). */
static void merge_partials(void *out, const float *partials, int num_parts, int64_t part_stride,
                           int64_t q_elem, int group, int head_dim, int dtype, float *acc) {
    for (int g = 0; g < group; g++) {
        const float *first = partials + (int64_t)g * (head_dim + 2);
        float m = first[0];
        for (int p = 1; p < num_parts; p++) {
            const float mp = first[p * part_stride];
            m = mp > m ? mp : m;
        }
        float sum = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)head_dim);
        for (int p = 0; p < num_parts; p++) {
            const float *part = first + p * part_stride;
            const float w = expf(part[0] - m);
            sum += part[1] * w;
            for (int d = 0; d < head_dim; d++) acc[d] += part[2 + d] * w;
        }
        store_row(out, q_elem + (int64_t)g * head_dim, acc, 1.0f / sum, head_dim, dtype);
    }
}

#define TASK(HEAD_DIM, DTYPE, CACHE_DTYPE)                                                     \
    decode_task(out, partial, query, k_cache, v_cache, table, q_elem, span, h, group,         \
                num_kv_heads, HEAD_DIM, block_size, scale, DTYPE, CACHE_DTYPE, work)
/* the pairs the launcher passes: a cache of the query's dtype, or fp8 */
#define TASK_FOR_DTYPE(HEAD_DIM)                                                               \
    do {                                                                                       \
        if (cache_dtype == DTYPE_FP8_E4M3) {                                                   \
            if (dtype == DTYPE_F32) TASK(HEAD_DIM, DTYPE_F32, DTYPE_FP8_E4M3);                 \
            else TASK(HEAD_DIM, DTYPE_BF16, DTYPE_FP8_E4M3);                                   \
        } else if (dtype == DTYPE_F32) {                                                       \
            TASK(HEAD_DIM, DTYPE_F32, DTYPE_F32);                                              \
        } else {                                                                               \
            TASK(HEAD_DIM, DTYPE_BF16, DTYPE_BF16);                                            \
        }                                                                                      \
    } while (0)

/* K (or V) elements of a call below which it runs on the calling thread alone: an OpenMP
 * fork/join costs more than a few short contexts (one 64-token context of 2 kv heads of 32 is
 * 4096 elements, about 1 us of work) */
#define PARALLEL_MIN_ELEMS (1 << 15)

#define MIN_PARTITION 256 /* tokens: smaller tasks cost more in merging than they gain */

/* Tokens per task. Decoding few sequences on many threads, whole contexts would leave threads
 * idle (one task per (sequence, kv head)), so contexts are cut into partitions until there are
 * about four tasks per thread, none shorter than MIN_PARTITION; on one thread they stay whole
 * (a split would only add merging). `asked` > 0 forces a size. */
static int partition_tokens(int asked, const int32_t *seq_lens, const int32_t *query_start_loc,
                            int num_seqs, int num_kv_heads, int block_size, int max_seq_len,
                            int num_threads) {
    int64_t part = asked;
    if (part <= 0) {
        int64_t tokens = 0, seqs = 0;
        for (int s = 0; s < num_seqs; s++) {
            if (query_start_loc[s + 1] - query_start_loc[s] == 1 && seq_lens[s] > 0) {
                tokens += seq_lens[s];
                seqs++;
            }
        }
        const int64_t target = 4 * (int64_t)num_threads;
        if (num_threads < 2 || seqs * num_kv_heads >= target)
            return max_seq_len > 0 ? max_seq_len : 1;
        part = (tokens * num_kv_heads + target - 1) / target;
        part = part < MIN_PARTITION ? MIN_PARTITION : part;
    }
    part = (part + block_size - 1) / block_size * block_size; /* whole blocks */
    return part < max_seq_len ? (int)part : (max_seq_len > 0 ? max_seq_len : 1);
}

/* Returns 0; 1 when a work buffer could not be allocated, 2 when a sequence is longer than
 * max_seq_len (refused before anything is read). Rows are undefined after a non-zero return.
 * `dtype`: query and out (DTYPE_F32 or DTYPE_BF16); `cache_dtype`: kv_layer, `dtype` or
 * DTYPE_FP8_E4M3. `partition_size`: tokens per task, 0 = automatic (partition_tokens). */
int pdserve_paged_decode(void *out, const void *query, const void *kv_layer,
                         const int32_t *block_tables, const int32_t *seq_lens,
                         const int32_t *query_start_loc, int num_seqs, int num_heads,
                         int num_kv_heads, int head_dim, int block_size, int num_blocks,
                         int table_stride, int max_seq_len, float scale, int dtype,
                         int cache_dtype, int partition_size, int num_threads) {
    const int group = num_heads / num_kv_heads;
    const int64_t half = (int64_t)num_blocks * block_size * num_kv_heads * head_dim;
    const size_t elem = ELEM_SIZE(cache_dtype);
    const void *k_cache = kv_layer;
    const void *v_cache = (const char *)kv_layer + half * (int64_t)elem;
    int64_t tokens = 0; /* of the decode rows' contexts */
    for (int s = 0; s < num_seqs; s++) {
        if (seq_lens[s] > max_seq_len) return 2;
        if (query_start_loc[s + 1] - query_start_loc[s] == 1) tokens += seq_lens[s];
    }
    /* a few short contexts take less time than waking the other threads would */
    const int threads = tokens * num_kv_heads * head_dim < PARALLEL_MIN_ELEMS ? 1 : num_threads;
    const int part = partition_tokens(partition_size, seq_lens, query_start_loc, num_seqs,
                                      num_kv_heads, block_size, max_seq_len, threads);

    /* the task list: partition i of the decode rows belongs to sequence owner[i] */
    int *first_part = malloc(sizeof(int) * (size_t)(num_seqs + 1));
    if (first_part == NULL) return 1;
    int num_parts = 0, split = 0;
    for (int s = 0; s < num_seqs; s++) {
        first_part[s] = num_parts;
        if (query_start_loc[s + 1] - query_start_loc[s] == 1 && seq_lens[s] > 0) {
            const int n = (seq_lens[s] + part - 1) / part;
            num_parts += n;
            split |= n > 1;
        }
    }
    first_part[num_seqs] = num_parts;
    const int64_t part_stride = (int64_t)group * (head_dim + 2); /* one (part, kv head) */
    int *owner = malloc(sizeof(int) * (size_t)(num_parts > 0 ? num_parts : 1));
    float *partials = split ? malloc(sizeof(float) * (size_t)num_parts * num_kv_heads *
                                     (size_t)part_stride)
                            : NULL;
    if (owner == NULL || (split && partials == NULL)) {
        free(first_part);
        free(owner);
        free(partials);
        return 1;
    }
    for (int s = 0; s < num_seqs; s++)
        for (int i = first_part[s]; i < first_part[s + 1]; i++) owner[i] = s;

    int failed = 0;
#pragma omp parallel if (threads > 1) num_threads(threads) reduction(max : failed)
    {
        const size_t floats = (size_t)(2 * group + block_size) * head_dim + (size_t)group * part;
        float *work = malloc(sizeof(float) * floats);
        failed = work == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < (int64_t)num_parts * num_kv_heads; task++) {
            if (work == NULL) continue;
            const int i = (int)(task / num_kv_heads), h = (int)(task % num_kv_heads);
            const int s = owner[i], p = i - first_part[s];
            const int t0 = p * part;
            const int span = seq_lens[s] - t0 < part ? seq_lens[s] - t0 : part;
            const int64_t q_elem =
                ((int64_t)query_start_loc[s] * num_heads + (int64_t)h * group) * head_dim;
            const int32_t *table = block_tables + (int64_t)s * table_stride + t0 / block_size;
            float *partial = first_part[s + 1] - first_part[s] > 1
                                 ? partials + ((int64_t)i * num_kv_heads + h) * part_stride
                                 : NULL;
            switch (head_dim) { /* constant head sizes: unrolled, vectorised copies */
            case 32: TASK_FOR_DTYPE(32); break;
            case 64: TASK_FOR_DTYPE(64); break;
            case 128: TASK_FOR_DTYPE(128); break;
            default: TASK_FOR_DTYPE(head_dim); break;
            }
        }
        if (split) { /* after the implicit barrier: every partition is done */
#pragma omp for schedule(dynamic, 1) collapse(2)
            for (int s = 0; s < num_seqs; s++) {
                for (int h = 0; h < num_kv_heads; h++) {
                    const int n = first_part[s + 1] - first_part[s];
                    if (work == NULL || n < 2) continue;
                    const int64_t q_elem =
                        ((int64_t)query_start_loc[s] * num_heads + (int64_t)h * group) * head_dim;
                    merge_partials(out, partials + ((int64_t)first_part[s] * num_kv_heads + h) *
                                                       part_stride,
                                   n, num_kv_heads * part_stride, q_elem, group, head_dim, dtype,
                                   work);
                }
            }
        }
        free(work);
    }
    free(first_part);
    free(owner);
    free(partials);
    return failed;
}
