/*
 * The element types of the native kernels (fused_ops_cpu.c, paged_attention_cpu.c): the dtype
 * codes the launchers pass (kernels/native.py's DTYPE_CODES) and the bfloat16 <-> float32
 * conversions, bit for bit PyTorch's (c10/util/BFloat16.h).
 *
 * Integer arithmetic only, so the conversions are the same under every floating-point flag the
 * sources are compiled with (-ffast-math included), and branch-free, so loops calling them
 * vectorise.
 */

#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

#define ELEM_SIZE(dtype) ((dtype) == DTYPE_F32 ? sizeof(float) : sizeof(uint16_t))

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even; every NaN becomes the quiet NaN 0x7fc0, as PyTorch's conversion. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

#endif /* PDSERVE_BF16_H */
