// The 8-bit saved x12 (saved_x12="fp8"; format in primitives/saved_x12.py):
// the forward writes h AND x12 as float8 e4m3fn with one float32 scale per
// 128-column block, in one pass; the backward reads the 8 bits and the
// scales in place of x12 (h recomputed, dgate/dup with the clamps' masks
// taken from the dequantized values).
//
// A block is 128 columns of one row; LANES (16 lanes for 16-bit types, 32
// for fp32) own it, each lane COLS = SWIGLU_VEC_WIDTH of its columns, read
// once into registers; the lanes' amaxes meet by shuffles. The grid maps a
// row's blocks times LANES lane slots (rounded up to whole warps) like the
// other kernels map packs (N = 1): a warp holds 2 blocks (16-bit) or 1. The
// 16-byte instances (N > 1; H, the row strides and the pointers allow it, as
// for the other kernels) give a lane columns [COLS l, COLS l + COLS), one
// 16-byte access per operand and COLS bytes of codes as 4-byte words, so a
// warp's access is contiguous. The any-alignment instances give it columns
// l + LANES k, one element per access (pairs: the pairs l + LANES j).
//
// Halves layout: a block is 128 columns of the gate half (scale j) and the
// same 128 columns of the up half (scale blocks + j), so a block never mixes
// gate and up; its lanes compute h for those columns. Interleaved: a block
// is 128 columns of x12 (64 gate/up pairs, h columns [64 j, 64 j + 64)).
#include "glu_activations.cuh"
#include "fp8_e4m3.cuh"

// 1 where the entry points below are stamped out (not float64: it refuses saved_x12="fp8").
#ifndef SWIGLU_FP8_SAVED_X12
#error "compile with -DSWIGLU_FP8_SAVED_X12=<0|1>"
#endif

#define SWIGLU_FP8_BLOCK 128
#define SWIGLU_FP8_COLS SWIGLU_VEC_WIDTH                       // columns per lane
#define SWIGLU_FP8_LANES (SWIGLU_FP8_BLOCK / SWIGLU_FP8_COLS)  // lanes per block

__device__ __forceinline__ float to_float(scalar_t v) { return (float)to_acc(v); }

// The prologue every fp8 kernel shares: each 128-column block of a row's
// ``width`` columns that this lane helps own, as body(row, block, blocks, c0,
// n, lane): c0 the block's first column, n its columns (the row's last block
// may be short; 0 for a lane slot past the row's last block), lane the lane's
// index among the block's. Every loop test here is the same for the whole
// warp (slots come in whole warps, blockDim.x is a multiple of 32), so all
// its lanes reach the shuffles.
template <int PACKS, class Body>
__device__ __forceinline__ void for_each_fp8_block(index_t M, index_t width, Body body) {
    const index_t blocks = (width + SWIGLU_FP8_BLOCK - 1) / SWIGLU_FP8_BLOCK;
    const index_t slots = (blocks * SWIGLU_FP8_LANES + 31) / 32 * 32;
    SWIGLU_FOR_EACH_TILE_OF(1, PACKS, row, slot0, slots) {
#pragma unroll 1
        for (int p = 0; p < PACKS; ++p) {
            const index_t slot = pack_column<1>(slot0, p);
            if (slot >= slots) break;
            const index_t block = slot / SWIGLU_FP8_LANES;
            const index_t c0 = block * SWIGLU_FP8_BLOCK;
            const index_t left = block < blocks ? width - c0 : 0;
            body(row, block, blocks, c0, (int)(left < SWIGLU_FP8_BLOCK ? left : SWIGLU_FP8_BLOCK),
                 (int)(slot % SWIGLU_FP8_LANES));
        }
    }
}

// max |x| over a block's lanes (each lane's own values already folded in).
__device__ __forceinline__ float block_amax(float m) {
#pragma unroll
    for (int offset = SWIGLU_FP8_LANES / 2; offset > 0; offset >>= 1)
        m = nan_max_abs(m, __shfl_xor_sync(0xffffffffu, m, offset));
    return m;
}

// Block-relative column of a lane's element k (k < COLS). The 16-byte form
// (N > 1): COLS l + k, all in the block or none (n is then a multiple of
// COLS). The other: l + LANES k for halves; for pairs (gate and up side by
// side) the pairs l + LANES j, i.e. columns 2 (l + LANES (k / 2)) + k % 2.
template <int N, bool PAIRS> __device__ __forceinline__ int lane_column(int lane, int k) {
    if (N > 1) return SWIGLU_FP8_COLS * lane + k;
    return PAIRS ? 2 * (lane + SWIGLU_FP8_LANES * (k >> 1)) + (k & 1) : lane + SWIGLU_FP8_LANES * k;
}

// K values of one row segment at lane_column-like places: the 16-byte form
// (N > 1) reads [K l, K l + K) as one pack; the other reads l + LANES k.
// K = COLS (a halves lane, or an x12 pairs lane) or COLS / 2 (h and dh of a
// pairs lane: h column j of pair j). Absent values are 0.
template <int N, int K> __device__ __forceinline__ void load_values(const scalar_t* base, int lane, int n,
                                                                    float (&v)[K]) {
    if constexpr (N > 1) {
        const bool in = K * lane < n;
        Pack<K> pack{};
        if (in) pack = load_pack<K>(base + K * lane);
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = in ? to_float(pack.v[k]) : 0.0f;
    } else {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int col = lane + SWIGLU_FP8_LANES * k;
            v[k] = col < n ? to_float(base[col]) : 0.0f;
        }
    }
}

// (The values arrive rounded to storage where they are computed: fewer live
// registers than fp32 ones, which spilled the clamped GELUs' kernels.)
template <int N, int K> __device__ __forceinline__ void store_values(scalar_t* base, int lane, int n,
                                                                     const Pack<K>& v) {
    if constexpr (N > 1) {
        if (K * lane < n) store_pack<K>(base + K * lane, v);
    } else {
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (lane + SWIGLU_FP8_LANES * k < n) base[lane + SWIGLU_FP8_LANES * k] = v.v[k];
    }
}

// A pairs lane's COLS x12 values (the any-alignment form: pairs l + LANES j).
template <int N> __device__ __forceinline__ void load_pairs(const scalar_t* base, int lane, int n,
                                                           float (&v)[SWIGLU_FP8_COLS]) {
    if constexpr (N > 1) {
        load_values<N, SWIGLU_FP8_COLS>(base, lane, n, v);
    } else {
#pragma unroll
        for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
            const int col = lane_column<N, true>(lane, k);
            v[k] = col < n ? to_float(base[col]) : 0.0f;
        }
    }
}

template <int N> __device__ __forceinline__ void store_pairs(scalar_t* base, int lane, int n,
                                                            const Pack<SWIGLU_FP8_COLS>& v) {
    if constexpr (N > 1) {
        store_values<N, SWIGLU_FP8_COLS>(base, lane, n, v);
    } else {
#pragma unroll
        for (int k = 0; k < SWIGLU_FP8_COLS; ++k)
            if (lane_column<N, true>(lane, k) < n) base[lane_column<N, true>(lane, k)] = v.v[k];
    }
}

// A lane's COLS values quantized to its columns of a q row segment: in the
// 16-byte form COLS bytes as 4-byte words (q rows are 4-byte aligned).
template <int N, bool PAIRS> __device__ __forceinline__ void store_codes(
    unsigned char* base, int lane, int n, const E4m3Quantizer& quantize, const float (&v)[SWIGLU_FP8_COLS]) {
    if constexpr (N > 1) {
        unsigned int pairs[SWIGLU_FP8_COLS / 2];
#pragma unroll
        for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j)
            pairs[j] = e4m3x2_from_floats(quantize.quotient(v[2 * j]), quantize.quotient(v[2 * j + 1]));
        if (SWIGLU_FP8_COLS * lane < n) {
#pragma unroll
            for (int w = 0; w < SWIGLU_FP8_COLS / 4; ++w)
                *reinterpret_cast<unsigned int*>(base + SWIGLU_FP8_COLS * lane + 4 * w) =
                    pairs[2 * w] | (pairs[2 * w + 1] << 16);
        }
    } else {
#pragma unroll
        for (int k = 0; k < SWIGLU_FP8_COLS; ++k)  // one at a time: a lane's codes held together spilled
            if (lane_column<N, PAIRS>(lane, k) < n)
                base[lane_column<N, PAIRS>(lane, k)] = (unsigned char)e4m3x2_from_floats(quantize.quotient(v[k]), 0.0f);
    }
}

// A lane's COLS codes of a q row segment, decoded and scaled (absent ones 0).
template <int N, bool PAIRS> __device__ __forceinline__ void load_codes(
    const unsigned char* base, int lane, int n, float scale, float (&out)[SWIGLU_FP8_COLS]) {
    unsigned int pairs[SWIGLU_FP8_COLS / 2];
    if constexpr (N > 1) {
        const bool in = SWIGLU_FP8_COLS * lane < n;
#pragma unroll
        for (int w = 0; w < SWIGLU_FP8_COLS / 4; ++w) {
            const unsigned int word =
                in ? *reinterpret_cast<const unsigned int*>(base + SWIGLU_FP8_COLS * lane + 4 * w) : 0u;
            pairs[2 * w] = word & 0xFFFFu;
            pairs[2 * w + 1] = word >> 16;
        }
    } else {
#pragma unroll
        for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
            const int c0 = lane_column<N, PAIRS>(lane, 2 * j), c1 = lane_column<N, PAIRS>(lane, 2 * j + 1);
            pairs[j] = (c0 < n ? base[c0] : 0u) | ((c1 < n ? (unsigned int)base[c1] : 0u) << 8);
        }
    }
#pragma unroll
    for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
        floats_from_e4m3x2(pairs[j], out[2 * j], out[2 * j + 1]);
        out[2 * j] *= scale;
        out[2 * j + 1] *= scale;
    }
}

__device__ __forceinline__ float lanes_amax(const float (&v)[SWIGLU_FP8_COLS]) {
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < SWIGLU_FP8_COLS; ++k) m = nan_max_abs(m, v[k]);
    return block_amax(m);
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_halves(
    const scalar_t* gate, const scalar_t* up, scalar_t* h, unsigned char* q, float* scales,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, index_t ld_q, index_t ld_scales,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, H, [&](index_t row, index_t block, index_t blocks, index_t c0, int n, int lane) {
        float g[SWIGLU_FP8_COLS], u[SWIGLU_FP8_COLS];
        load_values<N, SWIGLU_FP8_COLS>(gate + row * ld_gate + c0, lane, n, g);
        load_values<N, SWIGLU_FP8_COLS>(up + row * ld_up + c0, lane, n, u);
        const float scale_g = fp8_block_scale(lanes_amax(g)), scale_u = fp8_block_scale(lanes_amax(u));
        if (lane == 0 && n > 0) {
            scales[row * ld_scales + block] = scale_g;
            scales[row * ld_scales + blocks + block] = scale_u;
        }
        Pack<SWIGLU_FP8_COLS> hv;
#pragma unroll
        for (int k = 0; k < SWIGLU_FP8_COLS; ++k) hv.v[k] = from_acc<scalar_t>(GLU::forward((acc_t)g[k], (acc_t)u[k], prm));
        store_values<N, SWIGLU_FP8_COLS>(h + row * ld_h + c0, lane, n, hv);
        store_codes<N, false>(q + row * ld_q + c0, lane, n, E4m3Quantizer(scale_g), g);
        store_codes<N, false>(q + row * ld_q + H + c0, lane, n, E4m3Quantizer(scale_u), u);
    });
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_pairs(
    const scalar_t* x12, scalar_t* h, unsigned char* q, float* scales, index_t M, index_t H,
    index_t ld_x12, index_t ld_h, index_t ld_q, index_t ld_scales, const GluParams prm) {
    // n is even: 2H columns in blocks of 128.
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n, int lane) {
        float x[SWIGLU_FP8_COLS];
        load_pairs<N>(x12 + row * ld_x12 + c0, lane, n, x);
        const float scale = fp8_block_scale(lanes_amax(x));
        if (lane == 0 && n > 0) scales[row * ld_scales + block] = scale;
        Pack<SWIGLU_FP8_COLS / 2> hv;
#pragma unroll
        for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j)
            hv.v[j] = from_acc<scalar_t>(GLU::forward((acc_t)x[2 * j], (acc_t)x[2 * j + 1], prm));
        store_values<N, SWIGLU_FP8_COLS / 2>(h + row * ld_h + c0 / 2, lane, n / 2, hv);
        store_codes<N, true>(q + row * ld_q + c0, lane, n, E4m3Quantizer(scale), x);
    });
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_backward_fp8_halves(
    const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dgate, scalar_t* dup, scalar_t* h,
    index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh, index_t ld_dgate, index_t ld_dup,
    index_t ld_h, const GluParams prm) {
    for_each_fp8_block<PACKS>(M, H, [&](index_t row, index_t block, index_t blocks, index_t c0, int n, int lane) {
        const float scale_g = n > 0 ? scales[row * ld_scales + block] : 0.0f;
        const float scale_u = n > 0 ? scales[row * ld_scales + blocks + block] : 0.0f;
        if constexpr (N == 1) {  // one element at a time: holding a lane's 8 x 6 values spilled
            const unsigned char* q_gate = q + row * ld_q + c0;
            const unsigned char* q_up = q_gate + H;
#pragma unroll
            for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
                const int col = lane_column<N, false>(lane, k);
                if (col >= n) break;  // later columns lie further right
                acc_t hv, dg, du;
                GLU::backward((acc_t)(float_from_e4m3(q_gate[col]) * scale_g),
                              (acc_t)(float_from_e4m3(q_up[col]) * scale_u), to_acc(dh[row * ld_dh + c0 + col]),
                              prm, hv, dg, du);
                dgate[row * ld_dgate + c0 + col] = from_acc<scalar_t>(dg);
                dup[row * ld_dup + c0 + col] = from_acc<scalar_t>(du);
                h[row * ld_h + c0 + col] = from_acc<scalar_t>(hv);
            }
            return;
        }
        float g[SWIGLU_FP8_COLS], u[SWIGLU_FP8_COLS], d[SWIGLU_FP8_COLS];
        load_codes<N, false>(q + row * ld_q + c0, lane, n, scale_g, g);
        load_codes<N, false>(q + row * ld_q + H + c0, lane, n, scale_u, u);
        load_values<N, SWIGLU_FP8_COLS>(dh + row * ld_dh + c0, lane, n, d);
        Pack<SWIGLU_FP8_COLS> hv, dg, du;
#pragma unroll
        for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
            acc_t hk, dgk, duk;
            GLU::backward((acc_t)g[k], (acc_t)u[k], (acc_t)d[k], prm, hk, dgk, duk);
            hv.v[k] = from_acc<scalar_t>(hk);
            dg.v[k] = from_acc<scalar_t>(dgk);
            du.v[k] = from_acc<scalar_t>(duk);
        }
        store_values<N, SWIGLU_FP8_COLS>(dgate + row * ld_dgate + c0, lane, n, dg);
        store_values<N, SWIGLU_FP8_COLS>(dup + row * ld_dup + c0, lane, n, du);
        store_values<N, SWIGLU_FP8_COLS>(h + row * ld_h + c0, lane, n, hv);
    });
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_backward_fp8_pairs(
    const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh, index_t ld_dx12, index_t ld_h,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n, int lane) {
        const float scale = n > 0 ? scales[row * ld_scales + block] : 0.0f;
        if constexpr (N == 1) {  // one pair at a time, as the halves' form
            const unsigned char* q_row = q + row * ld_q + c0;
#pragma unroll
            for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
                const int col = lane_column<N, true>(lane, 2 * j);
                if (col >= n) break;
                const index_t h_col = (c0 + col) / 2;
                acc_t hv, dg, du;
                GLU::backward((acc_t)(float_from_e4m3(q_row[col]) * scale),
                              (acc_t)(float_from_e4m3(q_row[col + 1]) * scale), to_acc(dh[row * ld_dh + h_col]),
                              prm, hv, dg, du);
                dx12[row * ld_dx12 + 2 * h_col] = from_acc<scalar_t>(dg);
                dx12[row * ld_dx12 + 2 * h_col + 1] = from_acc<scalar_t>(du);
                h[row * ld_h + h_col] = from_acc<scalar_t>(hv);
            }
            return;
        }
        float x[SWIGLU_FP8_COLS], d[SWIGLU_FP8_COLS / 2];
        load_codes<N, true>(q + row * ld_q + c0, lane, n, scale, x);
        load_values<N, SWIGLU_FP8_COLS / 2>(dh + row * ld_dh + c0 / 2, lane, n / 2, d);
        Pack<SWIGLU_FP8_COLS / 2> hv;
        Pack<SWIGLU_FP8_COLS> dx;
#pragma unroll
        for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
            acc_t hj, dgj, duj;
            GLU::backward((acc_t)x[2 * j], (acc_t)x[2 * j + 1], (acc_t)d[j], prm, hj, dgj, duj);
            hv.v[j] = from_acc<scalar_t>(hj);
            dx.v[2 * j] = from_acc<scalar_t>(dgj);
            dx.v[2 * j + 1] = from_acc<scalar_t>(duj);
        }
        store_pairs<N>(dx12 + row * ld_dx12 + c0, lane, n, dx);
        store_values<N, SWIGLU_FP8_COLS / 2>(h + row * ld_h + c0 / 2, lane, n / 2, hv);
    });
}

// N = SWIGLU_VEC_WIDTH (16-byte accesses) requires H and every leading dim to
// be multiples of it and every pointer 16-byte aligned; N = 1 takes any layout.
#define GLU_FORWARD_FP8_ENTRY(name, GLU, N, PACKS)                                             \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* gate, const scalar_t* up, scalar_t* h, unsigned char* q, float* scales,  \
        index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, index_t ld_q,        \
        index_t ld_scales, acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {        \
        glu_forward_fp8_halves<GLU, N, PACKS>(gate, up, h, q, scales, M, H, ld_gate, ld_up, ld_h,  \
                                           ld_q, ld_scales, GluParams{limit, alpha, up_offset, grad_bound}); \
    }

#define GLU_FORWARD_FP8_PAIRS_ENTRY(name, GLU, N, PACKS)                                       \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* x12, scalar_t* h, unsigned char* q, float* scales, index_t M, index_t H, \
        index_t ld_x12, index_t ld_h, index_t ld_q, index_t ld_scales,                           \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                           \
        glu_forward_fp8_pairs<GLU, N, PACKS>(x12, h, q, scales, M, H, ld_x12, ld_h, ld_q, ld_scales, \
                                          GluParams{limit, alpha, up_offset, grad_bound});        \
    }

#define GLU_BACKWARD_FP8_ENTRY(name, GLU, N, PACKS)                                            \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dgate,        \
        scalar_t* dup, scalar_t* h, index_t M, index_t H, index_t ld_q, index_t ld_scales,        \
        index_t ld_dh, index_t ld_dgate, index_t ld_dup, index_t ld_h,                            \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                            \
        glu_backward_fp8_halves<GLU, N, PACKS>(q, scales, dh, dgate, dup, h, M, H, ld_q, ld_scales, \
                                            ld_dh, ld_dgate, ld_dup, ld_h,                       \
                                            GluParams{limit, alpha, up_offset, grad_bound});     \
    }

#define GLU_BACKWARD_FP8_PAIRS_ENTRY(name, GLU, N, PACKS)                                      \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dx12,         \
        scalar_t* h, index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh,        \
        index_t ld_dx12, index_t ld_h, acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) { \
        glu_backward_fp8_pairs<GLU, N, PACKS>(q, scales, dh, dx12, h, M, H, ld_q, ld_scales, ld_dh, \
                                           ld_dx12, ld_h, GluParams{limit, alpha, up_offset, grad_bound}); \
    }
