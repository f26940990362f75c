// float8 e4m3fn encode/decode in plain integer/float code (no cuda_fp8.h: the
// same text runs under NVRTC and as host C++), bit-exact with torch's
// float32 -> float8_e4m3fn cast: round to nearest even, saturating to +-448,
// NaN -> 0x7F (sign kept). e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa
// bits; no infinity; subnormals m * 2^-9.
#pragma once
#include "swiglu_common.cuh"

__device__ __forceinline__ unsigned int f32_bits(float v) {
    unsigned int u;
    memcpy(&u, &v, sizeof(u));
    return u;
}

__device__ __forceinline__ float f32_from_bits(unsigned int u) {
    float v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

// Branch-free (selects, no per-element branch): each case's code is computed
// and the magnitude picks one.
__device__ __forceinline__ unsigned char e4m3_from_float(float v) {
    const unsigned int bits = f32_bits(v);
    const unsigned int sign = (bits >> 24) & 0x80u;
    const unsigned int mag = bits & 0x7FFFFFFFu;
    // below 2^-6: subnormal, m * 2^-9. |v| 2^9 < 8 is exact; adding 1.5 * 2^23
    // rounds it to an integer (ties to even, e4m3's rounding there) in the low bits.
    const unsigned int subnormal = f32_bits(f32_from_bits(mag) * 512.0f + 12582912.0f) & 0xFFu;
    // normal: keep 3 of the 23 mantissa bits, ties to even; a carry moves the exponent
    const unsigned int rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
    const unsigned int exact = (rounded >> 20) - ((127u - 7u) << 3);
    const unsigned int normal = exact < 0x7Eu ? exact : 0x7Eu;  // 0x7E: 448, saturated
    unsigned int code = mag < 0x3C800000u ? subnormal : normal;   // 8 = 0x08 is 2^-6, the smallest normal
    code = mag >= 0x43E80000u ? 0x7Eu : code;                     // >= 464 (and inf): rounds past 448, saturates
    code = mag > 0x7F800000u ? 0x7Fu : code;                      // NaN
    return (unsigned char)(sign | code);
}

__device__ __forceinline__ float float_from_e4m3(unsigned char c) {
    const unsigned int sign = (unsigned int)(c & 0x80u) << 24;
    const unsigned int exponent = (c >> 3) & 0xFu;
    const unsigned int mantissa = c & 0x7u;
    const float subnormal = f32_from_bits(sign | f32_bits((float)mantissa * 0.001953125f));  // m * 2^-9, exact
    const float normal = f32_from_bits(sign | ((exponent + 127u - 7u) << 23) | (mantissa << 20));
    const float value = exponent == 0 ? subnormal : normal;
    return (c & 0x7Fu) == 0x7Fu ? f32_from_bits(sign | 0x7FC00000u) : value;  // NaN
}

// The saved x12's block rule (primitives/saved_x12.py): scale = amax / 448,
// q = e4m3(x / scale), a zero block (scale 0) saves 0; amax propagates NaN.
__device__ __forceinline__ float nan_max_abs(float m, float v) {
#ifdef __CUDA_ARCH__
    float r;  // sm_80 on: one FMNMX.NAN, the |v| folded in (plain fmaxf would drop a NaN)
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(v)));
    return r;
#else
    const float a = fabsf(v);
    return (a > m || a != a) ? a : m;
#endif
}

// amax / 448 without the division routine: the product with 1/448 (rounded
// to nearest) and one exact-residual correction, which rounds correctly
// for a quotient in fp32's normal range (the test checks every mantissa).
// A quotient below 2^-126 (every value of the block under 2^-117) may
// differ in its last bit; the GPU flushes it to 0 anyway (-ftz).
__device__ __forceinline__ float fp8_block_scale(float amax) {
    const float r = 0.002232142863795161247253418f;  // 1 / 448 rounded to fp32 (0x3B124925)
    const float q0 = amax * r;
    return amax <= 3.40282346638528859812e38f ? fmaf(r, fmaf(-448.0f, q0, amax), q0) : q0;  // inf, NaN: q0
}

// e4m3(v / scale) for every v of one block, without the IEEE division
// routine (a range test, a branch and a call per element, which keeps the
// elements from interleaving). Built once per block: the reciprocal rounded
// to nearest (the hardware's, refined by a Newton step, then whichever of it
// and its two neighbours leaves the smallest residual |1 - scale r|, each
// residual exact by fma), so that per element the product v r and one
// exact-residual correction give the correctly rounded quotient (Markstein's
// theorem, for operands and quotient in fp32's normal range). A block whose
// scale is below 2^-80 is worked at 2^64 times v and scale (the quotient is
// unchanged; its elements' quotients that round to a nonzero code stay
// normal); a non-finite scale takes v times its reciprocal (0 or NaN), which
// is what v / scale gives. v is one of the block's values (an infinite v
// has an infinite scale).
struct E4m3Quantizer {
    float scale;          // the block's scale, times boost (0 where it is not finite)
    float boost;          // 1, or 2^64 for a tiny scale
    float inv;            // 1 / scale: rounded to nearest where the scale is finite
    unsigned int sign;    // the sign bit a quotient takes from v (none for a zero block)

    __device__ __forceinline__ explicit E4m3Quantizer(float block_scale) {
        boost = block_scale < 0x1p-80f ? 0x1p64f : 1.0f;
        scale = block_scale * boost;
        const float r0 = rcp_fast(scale);
        const bool finite = scale <= 3.40282346638528859812e38f && scale > 0.0f;  // false for 0, inf and NaN
        // a zero block saves +0 for -0 too; a NaN block's quotients are the scale's NaN, as v / NaN
        sign = block_scale == 0.0f || block_scale != block_scale ? 0u : 0x80000000u;
        inv = r0;
        if (finite) {
            const float r = fmaf(r0, fmaf(-scale, r0, 1.0f), r0);
            const float up = f32_from_bits(f32_bits(r) + 1u), down = f32_from_bits(f32_bits(r) - 1u);
            const float e = fabsf(fmaf(-scale, r, 1.0f)), e_up = fabsf(fmaf(-scale, up, 1.0f)),
                        e_down = fabsf(fmaf(-scale, down, 1.0f));
            inv = e_up < e ? up : (e_down < e ? down : r);
        } else {
            // inf: |v| 0 = 0 (v finite) or NaN; NaN: NaN; 0: inv 0 keeps |v| = 0 at 0. The
            // correction below then adds inv |v| to it with scale 0: the same value.
            scale = 0.0f;
            inv = block_scale == 0.0f ? 0.0f : r0;
            boost = 1.0f;
        }
    }

    // v / scale, correctly rounded (+0 for a zero block): the magnitude corrected,
    // with v's sign put back (the correction would lose a -0's). e4m3x2 encodes it.
    __device__ __forceinline__ float quotient(float v) const {
        const float a = fabsf(v) * boost;
        const float q0 = a * inv;
        const float q = fmaf(inv, fmaf(-scale, q0, a), q0);
        return f32_from_bits(f32_bits(q) | (f32_bits(v) & sign));
    }
};

// Two codes in one 16-bit word (lo in bits 0-7): sm_89 on converts a pair in
// one instruction (round to nearest even, saturating finite values to 448 as
// e4m3_from_float does; a NaN gives 0x7F whatever its sign); elsewhere, and
// on the host, the integer encoder.
__device__ __forceinline__ unsigned int e4m3x2_from_floats(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    return pair;
#else
    return (unsigned int)e4m3_from_float(lo) | ((unsigned int)e4m3_from_float(hi) << 8);
#endif
}

// The two codes of a 16-bit word (lo in bits 0-7) as floats: exact either way
// (every e4m3 value is an fp16 value).
__device__ __forceinline__ void floats_from_e4m3x2(unsigned int pair, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned int halves;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"((unsigned short)pair));
    __half2 h2;
    memcpy(&h2, &halves, sizeof(h2));
    const float2 f = __half22float2(h2);
    lo = f.x;
    hi = f.y;
#else
    lo = float_from_e4m3((unsigned char)(pair & 0xFFu));
    hi = float_from_e4m3((unsigned char)((pair >> 8) & 0xFFu));
#endif
}
