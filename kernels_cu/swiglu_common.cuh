// Shared definitions for the SwiGLU elementwise kernels.
//
// Compiled once per storage dtype: the loader passes -DSWIGLU_SCALAR=<type>.
// All math runs in acc_t (fp32, or fp64 for double storage) and every output
// is rounded to scalar_t exactly once.
//
// Layout contract (row-major, unit inner stride, row strides in elements):
//   x12  [M, 2H]  gate in columns 0..H-1, up in columns H..2H-1
//   h    [M, H]   silu(gate) * up
// Indices are 64-bit everywhere: M * 2H may exceed 2^31.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef SWIGLU_SCALAR
#error "compile with -DSWIGLU_SCALAR=<__half|__nv_bfloat16|float|double>"
#endif

typedef SWIGLU_SCALAR scalar_t;
typedef long long index_t;

template <typename T> struct MathTypeOf { typedef float type; };
template <> struct MathTypeOf<double> { typedef double type; };
typedef MathTypeOf<scalar_t>::type acc_t;

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(acc_t v);
template <> __device__ __forceinline__ __half from_acc<__half>(acc_t v) { return __float2half_rn((float)v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(acc_t v) { return __float2bfloat16_rn((float)v); }
template <> __device__ __forceinline__ float from_acc<float>(acc_t v) { return (float)v; }
template <> __device__ __forceinline__ double from_acc<double>(acc_t v) { return (double)v; }

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

// 1 / (1 + e^-g): exp overflows to +inf for very negative g, giving exactly 0,
// so no branch is needed for stability.
__device__ __forceinline__ acc_t sigmoid_acc(acc_t g) {
    return acc_t(1) / (acc_t(1) + exp_acc(-g));
}

// Elements per 16-byte vector access.
#define SWIGLU_VEC_WIDTH (16 / (int)sizeof(scalar_t))

template <int N> struct alignas(sizeof(scalar_t) * N) Pack { scalar_t v[N]; };

template <int N> __device__ __forceinline__ Pack<N> load_pack(const scalar_t* p) {
    return *reinterpret_cast<const Pack<N>*>(p);
}
template <int N> __device__ __forceinline__ void store_pack(scalar_t* p, const Pack<N>& v) {
    *reinterpret_cast<Pack<N>*>(p) = v;
}

// Grid mapping shared by every kernel: x covers column packs of one row,
// y covers rows with a grid-stride loop (gridDim.y is capped at 65535).
#define SWIGLU_FOR_EACH_ROW(row)                                              \
    for (index_t row = (index_t)blockIdx.y * blockDim.y + threadIdx.y; row < M; \
         row += (index_t)gridDim.y * blockDim.y)

// First column of this thread's pack (x covers the packs of one row).
template <int N> __device__ __forceinline__ index_t pack_column() {
    return ((index_t)blockIdx.x * blockDim.x + threadIdx.x) * N;
}

template <int N> struct GateUp { Pack<N> gate, up; };

// The gate and up packs of one row, read from the packed x12 in place.
template <int N> __device__ __forceinline__ GateUp<N> load_gate_up(
    const scalar_t* x12, index_t row, index_t col, index_t ld_x12, index_t H) {
    const scalar_t* gate = x12 + row * ld_x12 + col;
    return GateUp<N>{load_pack<N>(gate), load_pack<N>(gate + H)};
}
