/*
 * The element types of the native kernels (fused_ops_cpu.c, paged_attention_cpu.c): the dtype
 * codes the launchers pass (kernels/native.py's DTYPE_CODES for the model dtype,
 * CACHE_DTYPE_CODES for the KV cache's) and the conversions between them and float32, bit for
 * bit PyTorch's:
 *   - bfloat16 <-> float32 (c10/util/BFloat16.h);
 *   - float8_e4m3fn (the KV cache only) <-> float32: reading is exact; writing is
 *     `x.to(torch.float8_e4m3fn)`: round to nearest even, saturating to +-448 (inf included),
 *     NaN -> 0x7f with the input's sign.
 *
 * Integer arithmetic only (and, for e4m3's subnormals, the exact conversion of an int below 8
 * to float), so the conversions are the same under every floating-point flag the sources are
 * compiled with (-ffast-math included, and whatever flush-to-zero mode the process runs in),
 * and branch-free, so loops calling them vectorise.
 */

#ifndef PDSERVE_BF16_H
#define PDSERVE_BF16_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_FP8_E4M3 = 2 };

#define ELEM_SIZE(dtype)                                                                       \
    ((dtype) == DTYPE_F32    ? sizeof(float)                                                   \
     : (dtype) == DTYPE_BF16 ? sizeof(uint16_t)                                                \
                             : sizeof(uint8_t))

/* A float's bit pattern and back (memcpy: no aliasing rules broken). */
static inline __attribute__((always_inline)) uint32_t f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

static inline __attribute__((always_inline)) float bits_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t x) {
    return bits_f32((uint32_t)x << 16);
}

/* Round to nearest even; every NaN becomes the quiet NaN 0x7fc0, as PyTorch's conversion. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    const uint32_t bits = f32_bits(f);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0u : (uint16_t)rounded;
}

/* `value` rounded to model dtype `dtype` (DTYPE_F32 or DTYPE_BF16) and widened back: what a
 * PyTorch op in that dtype leaves. */
static inline __attribute__((always_inline)) float round_to(float value, int dtype) {
    return dtype == DTYPE_F32 ? value : bf16_to_f32(f32_to_bf16(value));
}

/* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, 0x7f/0xff NaN,
 * largest 448 (0x7e), subnormals m * 2^-9. */

/* The exact value of e4m3 byte `x` (zero-extended: loops that widen a row of bytes first then
 * convert it on 32-bit lanes, without the byte-lane packing GCC emits otherwise). Normal
 * values (exponent field > 0) move their exponent and mantissa up into place and rebias
 * (+120); a subnormal m * 2^-9 is the float m (an exact int conversion, the same under every
 * flag) with 9 taken off its exponent field; NaN is PyTorch's 0x7ff00000. Selects by masks, no
 * table lookup, so a row converts as vectors (no gathers). */
static inline __attribute__((always_inline)) float e4m3_to_f32(uint32_t x) {
    const uint32_t a = x & 0x7fu, m = x & 0x7u;
    const uint32_t subnormal_mask = 0u - (uint32_t)(a < 8u), nan_mask = 0u - (uint32_t)(a == 0x7fu);
    const uint32_t m_bits = f32_bits((float)(int32_t)m);
    const uint32_t subnormal = (m_bits - (9u << 23)) & (0u - (uint32_t)(m != 0u));
    const uint32_t normal = (a << 20) + (120u << 23);
    uint32_t magnitude = (subnormal & subnormal_mask) | (normal & ~subnormal_mask);
    magnitude = (0x7ff00000u & nan_mask) | (magnitude & ~nan_mask);
    return bits_f32(((x & 0x80u) << 24) | magnitude);
}

/* PyTorch's `x.to(torch.float8_e4m3fn)`. |x| >= 448 (inf too) saturates to 0x7e; a NaN gives
 * 0x7f; |x| >= 2^-6 (normal) rounds the mantissa to 3 bits, to nearest even, and rebiases the
 * exponent (-120); smaller values round the 24-bit significand to a multiple of 2^-9 (shift
 * 141 - exponent, capped at 25, which leaves 0 for everything below 2^-10 and zeros; kept in
 * [20, 25] for the values that take another branch, so no shift is undefined). */
static inline __attribute__((always_inline)) uint8_t f32_to_e4m3(float f) {
    const uint32_t bits = f32_bits(f);
    const uint32_t sign = (bits >> 24) & 0x80u, abs = bits & 0x7fffffffu;
    const uint32_t normal = ((abs + 0x7ffffu + ((abs >> 20) & 1u)) >> 20) - (120u << 3);
    const uint32_t exponent = abs >> 23;
    const uint32_t shift = exponent < 116u ? 25u : exponent > 121u ? 20u : 141u - exponent;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t subnormal =
        (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
    const uint32_t magnitude = abs > 0x7f800000u   ? 0x7fu /* NaN */
                               : abs >= 0x43e00000u ? 0x7eu /* >= 448 */
                               : abs >= 0x3c800000u ? normal /* >= 2^-6 */
                                                    : subnormal;
    return (uint8_t)(sign | magnitude);
}

#endif /* PDSERVE_BF16_H */
