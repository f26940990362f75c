// The 8-bit saved x12 (saved_x12="fp8"; format in primitives/saved_x12.py):
// the forward writes h AND x12 as float8 e4m3fn with one float32 scale per
// 128-column block, in one pass; the backward reads the 8 bits and the
// scales in place of x12 (h recomputed, dgate/dup with the clamps' masks
// taken from the dequantized values).
//
// A block is 128 columns of one row; LANES lanes own it (8 for 16-bit types,
// 16 for fp32), each lane COLS = SWIGLU_FP8_LANE_PACKS x SWIGLU_VEC_WIDTH of
// its columns, read once into registers; the lanes' amaxes meet by shuffles.
// The grid maps a row's blocks times LANES lane slots (rounded up to whole
// warps) like the other kernels map packs (N = 1): a warp holds 4 blocks
// (16-bit) or 2. More than one pack per lane amortizes a block's fixed work
// (its amax shuffles, its quantizer, the tile's index math) over more
// elements. The 16-byte instances (N > 1; H, the row strides and the
// pointers allow it, as for the other kernels) give lane l the packs at
// columns VEC l + 128 p / LANE_PACKS, one 16-byte access per pack and
// operand and VEC bytes of codes as 4-byte words, so each of a warp's
// accesses covers whole 32-byte sectors. The any-alignment instances give it
// columns l + LANES k, one element per access (pairs: the pairs l + LANES j).
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

#ifndef SWIGLU_FP8_LANE_PACKS
#error "compile with -DSWIGLU_FP8_LANE_PACKS=<packs per lane>"
#endif

#define SWIGLU_FP8_BLOCK 128
#define SWIGLU_FP8_COLS (SWIGLU_VEC_WIDTH * SWIGLU_FP8_LANE_PACKS)  // columns per lane
#define SWIGLU_FP8_LANES (SWIGLU_FP8_BLOCK / SWIGLU_FP8_COLS)       // lanes per block

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

// Block-relative column of a lane's element k (k < COLS) in the any-alignment
// form (N = 1): l + LANES k for halves; for pairs (gate and up side by side)
// the pairs l + LANES j, i.e. columns 2 (l + LANES (k / 2)) + k % 2.
template <bool PAIRS> __device__ __forceinline__ int lane_column(int lane, int k) {
    return PAIRS ? 2 * (lane + SWIGLU_FP8_LANES * (k >> 1)) + (k & 1) : lane + SWIGLU_FP8_LANES * k;
}

// The 16-byte form's pieces: a lane's K values of a row segment come as
// LANE_PACKS pieces of S = K / LANE_PACKS, piece p at S (l + LANES p); each
// piece lies wholly in the segment or wholly past its n columns (n, H and
// the pieces are multiples of S).
template <int K> __device__ __forceinline__ int piece_start(int lane, int p) {
    return K / SWIGLU_FP8_LANE_PACKS * (lane + SWIGLU_FP8_LANES * p);
}

// The 16-byte form's K values of one row segment, in storage precision
// (converted where used: a lane's values held as floats spilled at the 64
// registers SwiGLU's 8-bit kernels had), every piece read before any is
// used. K = COLS (a halves lane, or an x12 pairs lane) or COLS / 2 (h and
// dh of a pairs lane: h column j of pair j). Absent values are 0.
template <int K> __device__ __forceinline__ void load_values(const scalar_t* base, int lane, int n, Pack<K>& v) {
    constexpr int S = K / SWIGLU_FP8_LANE_PACKS;
#pragma unroll
    for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
        const int start = piece_start<K>(lane, p);
        Pack<S> piece{};
        if (start < n) piece = load_pack<S>(base + start);
#pragma unroll
        for (int k = 0; k < S; ++k) v.v[S * p + k] = piece.v[k];
    }
}

template <int K> __device__ __forceinline__ void store_values(scalar_t* base, int lane, int n, const Pack<K>& v) {
    constexpr int S = K / SWIGLU_FP8_LANE_PACKS;
#pragma unroll
    for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
        const int start = piece_start<K>(lane, p);
        if (start < n) {
            Pack<S> piece;
#pragma unroll
            for (int k = 0; k < S; ++k) piece.v[k] = v.v[S * p + k];
            store_pack<S>(base + start, piece);
        }
    }
}

// The 16-byte form's COLS values quantized to a lane's columns of a q row
// segment: each piece's S codes as S / 4 4-byte words (q rows are 4-byte
// aligned).
__device__ __forceinline__ void store_codes(unsigned char* base, int lane, int n, const E4m3Quantizer& quantize,
                                            const Pack<SWIGLU_FP8_COLS>& v) {
    constexpr int S = SWIGLU_FP8_COLS / SWIGLU_FP8_LANE_PACKS;
#pragma unroll
    for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
        const int start = piece_start<SWIGLU_FP8_COLS>(lane, p);
        unsigned int pairs[S / 2];
#pragma unroll
        for (int j = 0; j < S / 2; ++j)
            pairs[j] = e4m3x2_from_floats(quantize.quotient(to_float(v.v[S * p + 2 * j])),
                                          quantize.quotient(to_float(v.v[S * p + 2 * j + 1])));
        if (start < n) {
#pragma unroll
            for (int w = 0; w < S / 4; ++w)
                *reinterpret_cast<unsigned int*>(base + start + 4 * w) = pairs[2 * w] | (pairs[2 * w + 1] << 16);
        }
    }
}

// One code of the any-alignment form (the pair's high half unused).
__device__ __forceinline__ unsigned char e4m3_code(const E4m3Quantizer& quantize, float v) {
    return (unsigned char)e4m3x2_from_floats(quantize.quotient(v), 0.0f);
}

// The 16-byte form's codes of a q row segment as words (absent ones 0),
// all read before any is decoded; word w holds the lane's codes 4 w .. 4 w + 3.
__device__ __forceinline__ void load_code_words(const unsigned char* base, int lane, int n,
                                                unsigned int (&words)[SWIGLU_FP8_COLS / 4]) {
    constexpr int S = SWIGLU_FP8_COLS / SWIGLU_FP8_LANE_PACKS;
#pragma unroll
    for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
        const int start = piece_start<SWIGLU_FP8_COLS>(lane, p);
#pragma unroll
        for (int w = 0; w < S / 4; ++w)
            words[S / 4 * p + w] = start < n ? *reinterpret_cast<const unsigned int*>(base + start + 4 * w) : 0u;
    }
}

// A lane's codes 2 j and 2 j + 1 (of load_code_words), decoded and scaled.
__device__ __forceinline__ void decode_pair(const unsigned int (&words)[SWIGLU_FP8_COLS / 4], int j, float scale,
                                            float& lo, float& hi) {
    float code_lo, code_hi;
    floats_from_e4m3x2(j & 1 ? words[j >> 1] >> 16 : words[j >> 1] & 0xFFFFu, code_lo, code_hi);
    const FloatPair scaled = FloatPair(code_lo, code_hi) * FloatPair(scale);  // one paired multiply on sm_100
    lo = scaled.lo;
    hi = scaled.hi;
}

template <int K> __device__ __forceinline__ float lanes_amax(const Pack<K>& v) {
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) m = nan_max_abs(m, to_float(v.v[k]));
    return block_amax(m);
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_halves(
    const scalar_t* gate, const scalar_t* up, scalar_t* h, unsigned char* q, float* scales,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, index_t ld_q, index_t ld_scales,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, H, [&](index_t row, index_t block, index_t blocks, index_t c0, int n, int lane) {
        const scalar_t* gate_row = gate + row * ld_gate + c0;
        const scalar_t* up_row = up + row * ld_up + c0;
        if constexpr (N == 1) {  // two passes (amaxes, then the rest): a lane's values held across both spilled
            float mg = 0.0f, mu = 0.0f;
#pragma unroll
            for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
                const int col = lane_column<false>(lane, k);
                if (col < n) {
                    mg = nan_max_abs(mg, to_float(gate_row[col]));
                    mu = nan_max_abs(mu, to_float(up_row[col]));
                }
            }
            const float scale_g = fp8_block_scale(block_amax(mg)), scale_u = fp8_block_scale(block_amax(mu));
            if (lane == 0 && n > 0) {
                scales[row * ld_scales + block] = scale_g;
                scales[row * ld_scales + blocks + block] = scale_u;
            }
            const E4m3Quantizer quantize_g(scale_g), quantize_u(scale_u);
            unsigned char* q_row = q + row * ld_q + c0;
#pragma unroll 1  // rolled: unrolled, the compiler keeps the first pass's loads in registers instead
            for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
                const int col = lane_column<false>(lane, k);
                if (col >= n) break;  // later columns lie further right
                const float g = to_float(gate_row[col]), u = to_float(up_row[col]);
                h[row * ld_h + c0 + col] = from_acc<scalar_t>(glu_forward_one<GLU>((acc_t)g, (acc_t)u, prm));
                q_row[col] = e4m3_code(quantize_g, g);
                q_row[H + col] = e4m3_code(quantize_u, u);
            }
        } else {  // the 16-byte form: every load first
            Pack<SWIGLU_FP8_COLS> g, u;
            load_values<SWIGLU_FP8_COLS>(gate_row, lane, n, g);
            load_values<SWIGLU_FP8_COLS>(up_row, lane, n, u);
            const float scale_g = fp8_block_scale(lanes_amax(g)), scale_u = fp8_block_scale(lanes_amax(u));
            if (lane == 0 && n > 0) {
                scales[row * ld_scales + block] = scale_g;
                scales[row * ld_scales + blocks + block] = scale_u;
            }
            Pack<SWIGLU_FP8_COLS> hv;
            glu_forward_pack<GLU, SWIGLU_FP8_COLS>(g, u, prm, hv);
            store_values<SWIGLU_FP8_COLS>(h + row * ld_h + c0, lane, n, hv);
            store_codes(q + row * ld_q + c0, lane, n, E4m3Quantizer(scale_g), g);
            store_codes(q + row * ld_q + H + c0, lane, n, E4m3Quantizer(scale_u), u);
        }
    });
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_fp8_pairs(
    const scalar_t* x12, scalar_t* h, unsigned char* q, float* scales, index_t M, index_t H,
    index_t ld_x12, index_t ld_h, index_t ld_q, index_t ld_scales, const GluParams prm) {
    // n is even: 2H columns in blocks of 128.
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n, int lane) {
        const scalar_t* x_row = x12 + row * ld_x12 + c0;
        if constexpr (N == 1) {  // two passes, as the halves' form
            float m = 0.0f;
#pragma unroll
            for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
                const int col = lane_column<true>(lane, k);
                if (col < n) m = nan_max_abs(m, to_float(x_row[col]));
            }
            const float scale = fp8_block_scale(block_amax(m));
            if (lane == 0 && n > 0) scales[row * ld_scales + block] = scale;
            const E4m3Quantizer quantize(scale);
            unsigned char* q_row = q + row * ld_q + c0;
#pragma unroll 1  // rolled, as the halves' form
            for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
                const int col = lane_column<true>(lane, 2 * j);  // the gate of a pair; its up is next
                if (col >= n) break;
                const float g = to_float(x_row[col]), u = to_float(x_row[col + 1]);
                h[row * ld_h + (c0 + col) / 2] = from_acc<scalar_t>(glu_forward_one<GLU>((acc_t)g, (acc_t)u, prm));
                q_row[col] = e4m3_code(quantize, g);
                q_row[col + 1] = e4m3_code(quantize, u);
            }
        } else {  // the 16-byte form: every load first
            Pack<SWIGLU_FP8_COLS> x;
            load_values<SWIGLU_FP8_COLS>(x_row, lane, n, x);
            const float scale = fp8_block_scale(lanes_amax(x));
            if (lane == 0 && n > 0) scales[row * ld_scales + block] = scale;
            Pack<SWIGLU_FP8_COLS / 2> hv;
#pragma unroll
            for (int j = 0; j < SWIGLU_FP8_COLS / 2; j += 2) {  // h columns j and j + 1: x pairs 2j and 2j + 2
                acc_t h0, h1;
                glu_forward_two<GLU>(to_acc(x.v[2 * j]), to_acc(x.v[2 * j + 2]), to_acc(x.v[2 * j + 1]),
                                     to_acc(x.v[2 * j + 3]), prm, h0, h1);
                hv.v[j] = from_acc<scalar_t>(h0);
                hv.v[j + 1] = from_acc<scalar_t>(h1);
            }
            store_values<SWIGLU_FP8_COLS / 2>(h + row * ld_h + c0 / 2, lane, n / 2, hv);
            store_codes(q + row * ld_q + c0, lane, n, E4m3Quantizer(scale), x);
        }
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
        const unsigned char* q_gate = q + row * ld_q + c0;
        const unsigned char* q_up = q_gate + H;
        if constexpr (N == 1) {  // one element at a time: holding a lane's 8 x 6 values spilled
#pragma unroll
            for (int k = 0; k < SWIGLU_FP8_COLS; ++k) {
                const int col = lane_column<false>(lane, k);
                if (col >= n) break;  // later columns lie further right
                acc_t hv, dg, du;
                glu_backward_one<GLU>((acc_t)(float_from_e4m3(q_gate[col]) * scale_g),
                              (acc_t)(float_from_e4m3(q_up[col]) * scale_u), to_acc(dh[row * ld_dh + c0 + col]),
                              prm, hv, dg, du);
                dgate[row * ld_dgate + c0 + col] = from_acc<scalar_t>(dg);
                dup[row * ld_dup + c0 + col] = from_acc<scalar_t>(du);
                h[row * ld_h + c0 + col] = from_acc<scalar_t>(hv);
            }
        } else {  // every load first, then piece by piece (a piece's values live only there)
            constexpr int S = SWIGLU_FP8_COLS / SWIGLU_FP8_LANE_PACKS;
            unsigned int gw[SWIGLU_FP8_COLS / 4], uw[SWIGLU_FP8_COLS / 4];
            load_code_words(q_gate, lane, n, gw);
            load_code_words(q_up, lane, n, uw);
            Pack<SWIGLU_FP8_COLS> d;
            load_values<SWIGLU_FP8_COLS>(dh + row * ld_dh + c0, lane, n, d);
#pragma unroll
            for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
                const int start = piece_start<SWIGLU_FP8_COLS>(lane, p);
                if (start >= n) break;  // later pieces lie further right
                Pack<S> hv, dg, du;
#pragma unroll
                for (int j = 0; j < S / 2; ++j) {
                    float gf[2], uf[2];
                    decode_pair(gw, S / 2 * p + j, scale_g, gf[0], gf[1]);
                    decode_pair(uw, S / 2 * p + j, scale_u, uf[0], uf[1]);
                    const acc_t g[2] = {gf[0], gf[1]}, u[2] = {uf[0], uf[1]},
                                dk[2] = {to_acc(d.v[S * p + 2 * j]), to_acc(d.v[S * p + 2 * j + 1])};
                    acc_t hk[2], dgk[2], duk[2];
                    glu_backward_two<GLU>(g, u, dk, prm, hk, dgk, duk);
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        hv.v[2 * j + i] = from_acc<scalar_t>(hk[i]);
                        dg.v[2 * j + i] = from_acc<scalar_t>(dgk[i]);
                        du.v[2 * j + i] = from_acc<scalar_t>(duk[i]);
                    }
                }
                store_pack<S>(dgate + row * ld_dgate + c0 + start, dg);
                store_pack<S>(dup + row * ld_dup + c0 + start, du);
                store_pack<S>(h + row * ld_h + c0 + start, hv);
            }
        }
    });
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_backward_fp8_pairs(
    const unsigned char* q, const float* scales, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_q, index_t ld_scales, index_t ld_dh, index_t ld_dx12, index_t ld_h,
    const GluParams prm) {
    for_each_fp8_block<PACKS>(M, 2 * H, [&](index_t row, index_t block, index_t, index_t c0, int n, int lane) {
        const float scale = n > 0 ? scales[row * ld_scales + block] : 0.0f;
        const unsigned char* q_row = q + row * ld_q + c0;
        if constexpr (N == 1) {  // one pair at a time, as the halves' form
#pragma unroll
            for (int j = 0; j < SWIGLU_FP8_COLS / 2; ++j) {
                const int col = lane_column<true>(lane, 2 * j);
                if (col >= n) break;
                const index_t h_col = (c0 + col) / 2;
                acc_t hv, dg, du;
                glu_backward_one<GLU>((acc_t)(float_from_e4m3(q_row[col]) * scale),
                              (acc_t)(float_from_e4m3(q_row[col + 1]) * scale), to_acc(dh[row * ld_dh + h_col]),
                              prm, hv, dg, du);
                dx12[row * ld_dx12 + 2 * h_col] = from_acc<scalar_t>(dg);
                dx12[row * ld_dx12 + 2 * h_col + 1] = from_acc<scalar_t>(du);
                h[row * ld_h + h_col] = from_acc<scalar_t>(hv);
            }
        } else {  // as the halves' form: x12 piece p holds the pairs of h piece p
            constexpr int S = SWIGLU_FP8_COLS / SWIGLU_FP8_LANE_PACKS;
            unsigned int xw[SWIGLU_FP8_COLS / 4];
            load_code_words(q_row, lane, n, xw);
            Pack<SWIGLU_FP8_COLS / 2> d;
            load_values<SWIGLU_FP8_COLS / 2>(dh + row * ld_dh + c0 / 2, lane, n / 2, d);
#pragma unroll
            for (int p = 0; p < SWIGLU_FP8_LANE_PACKS; ++p) {
                const int start = piece_start<SWIGLU_FP8_COLS>(lane, p);
                if (start >= n) break;
                Pack<S / 2> hv;
                Pack<S> dx;
#pragma unroll
                for (int j = 0; j < S / 2; j += 2) {  // h columns j and j + 1 of the piece
                    float gf[2], uf[2];
                    decode_pair(xw, S / 2 * p + j, scale, gf[0], uf[0]);
                    decode_pair(xw, S / 2 * p + j + 1, scale, gf[1], uf[1]);
                    const acc_t g[2] = {gf[0], gf[1]}, u[2] = {uf[0], uf[1]},
                                dj[2] = {to_acc(d.v[S / 2 * p + j]), to_acc(d.v[S / 2 * p + j + 1])};
                    acc_t hj[2], dgj[2], duj[2];
                    glu_backward_two<GLU>(g, u, dj, prm, hj, dgj, duj);
#pragma unroll
                    for (int i = 0; i < 2; ++i) {
                        hv.v[j + i] = from_acc<scalar_t>(hj[i]);
                        dx.v[2 * (j + i)] = from_acc<scalar_t>(dgj[i]);
                        dx.v[2 * (j + i) + 1] = from_acc<scalar_t>(duj[i]);
                    }
                }
                store_pack<S>(dx12 + row * ld_dx12 + c0 + start, dx);
                store_pack<S / 2>(h + row * ld_h + (c0 + start) / 2, hv);
            }
        }
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
