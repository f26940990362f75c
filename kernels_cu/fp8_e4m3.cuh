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

__device__ __forceinline__ unsigned char e4m3_from_float(float v) {
    const unsigned int bits = f32_bits(v);
    const unsigned char sign = (unsigned char)((bits >> 24) & 0x80u);
    const unsigned int mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return sign | 0x7Fu;          // NaN
    if (mag >= 0x43E80000u) return sign | 0x7Eu;         // >= 464 (and inf): rounds past 448, saturates
    if (mag < 0x3C800000u) {                             // below 2^-6: subnormal, m * 2^-9
        // a * 2^9 is exact; rounding it to an integer (ties to even) is e4m3's rounding there
        const float scaled = f32_from_bits(mag) * 512.0f;
        const float rounded = rintf(scaled);
        return sign | (unsigned char)rounded;            // 8 = 0x08 is 2^-6, the smallest normal
    }
    // normal: keep 3 of the 23 mantissa bits, ties to even; a carry moves the exponent
    const unsigned int rounded = mag + 0x7FFFFu + ((mag >> 20) & 1u);
    const unsigned int code = (rounded >> 20) - ((127u - 7u) << 3);
    return sign | (unsigned char)(code > 0x7Eu ? 0x7Eu : code);
}

__device__ __forceinline__ float float_from_e4m3(unsigned char c) {
    const unsigned int sign = (unsigned int)(c & 0x80u) << 24;
    const unsigned int exponent = (c >> 3) & 0xFu;
    const unsigned int mantissa = c & 0x7u;
    if (exponent == 0xFu && mantissa == 0x7u) return f32_from_bits(sign | 0x7FC00000u);  // NaN
    if (exponent == 0) {
        const float value = (float)mantissa * 0.001953125f;  // m * 2^-9, exact
        return sign ? -value : value;
    }
    return f32_from_bits(sign | ((exponent + 127u - 7u) << 23) | (mantissa << 20));
}

// The saved x12's block rule (primitives/saved_x12.py): scale = amax / 448,
// q = e4m3(x / scale), a zero block (scale 0) saves 0; amax propagates NaN.
__device__ __forceinline__ float nan_max_abs(float m, float v) {
    const float a = fabsf(v);
    return (a > m || a != a) ? a : m;
}

__device__ __forceinline__ unsigned char quantize_e4m3(float v, float scale) {
    return scale == 0.0f ? (unsigned char)0 : e4m3_from_float(v / scale);
}
