// The 8-bit saved x12 (saved_x12="fp8"; format in primitives/saved_x12.py):
// the forward writes h AND x12 as float8 e4m3fn with one float32 scale per
// 128-column block, in one pass; the backward reads the 8 bits and the
// scales in place of x12 (h recomputed, dgate/dup with the clamps' masks
// taken from the dequantized values).
//
// A thread owns whole blocks: it reads its block once for the amax, then
// again (from cache) to store h and the quantized values. No cooperation
// between threads (host execution runs them one after another). The grid maps
// blocks like the other kernels map packs (N = 1 over the blocks of a row).
//
// Halves layout: a block is 128 columns of the gate half (scale j) and the
// same 128 columns of the up half (scale blocks + j), so a block never mixes
// gate and up; the thread computes h for those columns. Interleaved: a block
// is 128 columns of x12 (64 gate/up pairs, h columns [64 j, 64 j + 64)).
#include "glu_activations.cuh"
#include "fp8_e4m3.cuh"

// 1 where the entry points below are stamped out (not float64: it refuses saved_x12="fp8").
#ifndef SWIGLU_FP8_SAVED_X12
#error "compile with -DSWIGLU_FP8_SAVED_X12=<0|1>"
#endif

#define SWIGLU_FP8_BLOCK 128
#define SWIGLU_FP8_MAX 448.0f

__device__ __forceinline__ float to_float(scalar_t v) { return (float)to_acc(v); }

// The prologue every fp8 kernel shares: each 128-column block of a row's
// ``width`` columns that this thread owns (the grid maps blocks as the other
// kernels map packs), as body(row, block, blocks, c0, n): c0 its first column,
// n its columns (the row's last block may be short).
template <int PACKS, class Body>
__device__ __forceinline__ void for_each_fp8_block(index_t M, index_t width, Body body) {
    const index_t blocks = (width + SWIGLU_FP8_BLOCK - 1) / SWIGLU_FP8_BLOCK;
    SWIGLU_FOR_EACH_TILE_OF(1, PACKS, row, block0, blocks) {
#pragma unroll 1
        for (int p = 0; p < PACKS; ++p) {
            const index_t block = pack_column<1>(block0, p);
            if (block >= blocks) break;
            const index_t c0 = block * SWIGLU_FP8_BLOCK;
            body(row, block, blocks, c0, (int)(width - c0 < SWIGLU_FP8_BLOCK ? width - c0 : SWIGLU_FP8_BLOCK));
        }
    }
}

template <class GLU, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_halves(
    const scalar_t* gate, const scalar_t* up, scalar_t* h, unsigned char* q, float* scales,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, index_t ld_q, index_t ld_scales,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, H, [&](index_t row, index_t block, index_t blocks, index_t c0, int n) {
        const scalar_t* g = gate + row * ld_gate + c0;
        const scalar_t* u = up + row * ld_up + c0;
        float amax_g = 0.0f, amax_u = 0.0f;
        for (int i = 0; i < n; ++i) {
            amax_g = nan_max_abs(amax_g, to_float(g[i]));
            amax_u = nan_max_abs(amax_u, to_float(u[i]));
        }
        const float scale_g = amax_g / SWIGLU_FP8_MAX, scale_u = amax_u / SWIGLU_FP8_MAX;
        scales[row * ld_scales + block] = scale_g;
        scales[row * ld_scales + blocks + block] = scale_u;
        scalar_t* h_row = h + row * ld_h + c0;
        unsigned char* q_gate = q + row * ld_q + c0;
        unsigned char* q_up = q + row * ld_q + H + c0;
        for (int i = 0; i < n; ++i) {
            const acc_t gv = to_acc(g[i]), uv = to_acc(u[i]);
            h_row[i] = from_acc<scalar_t>(GLU::forward(gv, uv, prm));
            q_gate[i] = quantize_e4m3((float)gv, scale_g);
            q_up[i] = quantize_e4m3((float)uv, scale_u);
        }
    });
}

template <class GLU, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_pairs(
    const scalar_t* x12, scalar_t* h, unsigned char* q, float* scales, index_t M, index_t H,
    index_t ld_x12, index_t ld_h, index_t ld_q, index_t ld_scales, const GluParams prm) {
    // n is even: 2H columns in blocks of 128.
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n) {
        const scalar_t* x = x12 + row * ld_x12 + c0;
        float amax = 0.0f;
        for (int i = 0; i < n; ++i) amax = nan_max_abs(amax, to_float(x[i]));
        const float scale = amax / SWIGLU_FP8_MAX;
        scales[row * ld_scales + block] = scale;
        scalar_t* h_row = h + row * ld_h + c0 / 2;
        unsigned char* q_row = q + row * ld_q + c0;
        for (int i = 0; i < n; i += 2) {
            const acc_t gv = to_acc(x[i]), uv = to_acc(x[i + 1]);
            h_row[i / 2] = from_acc<scalar_t>(GLU::forward(gv, uv, prm));
            q_row[i] = quantize_e4m3((float)gv, scale);
            q_row[i + 1] = quantize_e4m3((float)uv, scale);
        }
    });
}

template <class GLU, int PACKS>
__device__ __forceinline__ void glu_backward_fp8_halves(
    const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dgate, scalar_t* dup, scalar_t* h,
    index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh, index_t ld_dgate, index_t ld_dup,
    index_t ld_h, const GluParams prm) {
    for_each_fp8_block<PACKS>(M, H, [&](index_t row, index_t block, index_t blocks, index_t c0, int n) {
        const float scale_g = scales[row * ld_scales + block];
        const float scale_u = scales[row * ld_scales + blocks + block];
        const unsigned char* q_gate = q + row * ld_q + c0;
        const unsigned char* q_up = q + row * ld_q + H + c0;
        const scalar_t* d = dh + row * ld_dh + c0;
        for (int i = 0; i < n; ++i) {
            acc_t hv, dg, du;
            GLU::backward((acc_t)(float_from_e4m3(q_gate[i]) * scale_g),
                          (acc_t)(float_from_e4m3(q_up[i]) * scale_u), to_acc(d[i]), prm, hv, dg, du);
            dgate[row * ld_dgate + c0 + i] = from_acc<scalar_t>(dg);
            dup[row * ld_dup + c0 + i] = from_acc<scalar_t>(du);
            h[row * ld_h + c0 + i] = from_acc<scalar_t>(hv);
        }
    });
}

template <class GLU, int PACKS>
__device__ __forceinline__ void glu_backward_fp8_pairs(
    const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh, index_t ld_dx12, index_t ld_h,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n) {
        const float scale = scales[row * ld_scales + block];
        const unsigned char* q_row = q + row * ld_q + c0;
        for (int i = 0; i < n; i += 2) {
            const index_t col = (c0 + i) / 2;
            acc_t hv, dg, du;
            GLU::backward((acc_t)(float_from_e4m3(q_row[i]) * scale), (acc_t)(float_from_e4m3(q_row[i + 1]) * scale),
                          to_acc(dh[row * ld_dh + col]), prm, hv, dg, du);
            dx12[row * ld_dx12 + 2 * col] = from_acc<scalar_t>(dg);
            dx12[row * ld_dx12 + 2 * col + 1] = from_acc<scalar_t>(du);
            h[row * ld_h + col] = from_acc<scalar_t>(hv);
        }
    });
}

// One element per access (N is unused: the names keep the other kernels' scheme).
#define GLU_FORWARD_FP8_ENTRY(name, GLU, N, PACKS)                                             \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* gate, const scalar_t* up, scalar_t* h, unsigned char* q, float* scales,  \
        index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, index_t ld_q,        \
        index_t ld_scales, acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {        \
        glu_forward_fp8_halves<GLU, PACKS>(gate, up, h, q, scales, M, H, ld_gate, ld_up, ld_h,  \
                                           ld_q, ld_scales, GluParams{limit, alpha, up_offset, grad_bound}); \
    }

#define GLU_FORWARD_FP8_PAIRS_ENTRY(name, GLU, N, PACKS)                                       \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* x12, scalar_t* h, unsigned char* q, float* scales, index_t M, index_t H, \
        index_t ld_x12, index_t ld_h, index_t ld_q, index_t ld_scales,                           \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                           \
        glu_forward_fp8_pairs<GLU, PACKS>(x12, h, q, scales, M, H, ld_x12, ld_h, ld_q, ld_scales, \
                                          GluParams{limit, alpha, up_offset, grad_bound});        \
    }

#define GLU_BACKWARD_FP8_ENTRY(name, GLU, N, PACKS)                                            \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dgate,        \
        scalar_t* dup, scalar_t* h, index_t M, index_t H, index_t ld_q, index_t ld_scales,        \
        index_t ld_dh, index_t ld_dgate, index_t ld_dup, index_t ld_h,                            \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                            \
        glu_backward_fp8_halves<GLU, PACKS>(q, scales, dh, dgate, dup, h, M, H, ld_q, ld_scales, \
                                            ld_dh, ld_dgate, ld_dup, ld_h,                       \
                                            GluParams{limit, alpha, up_offset, grad_bound});     \
    }

#define GLU_BACKWARD_FP8_PAIRS_ENTRY(name, GLU, N, PACKS)                                      \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dx12,         \
        scalar_t* h, index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh,        \
        index_t ld_dx12, index_t ld_h, acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) { \
        glu_backward_fp8_pairs<GLU, PACKS>(q, scales, dh, dx12, h, M, H, ld_q, ld_scales, ld_dh, \
                                           ld_dx12, ld_h, GluParams{limit, alpha, up_offset, grad_bound}); \
    }
