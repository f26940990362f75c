// Backward primitive, one pass over x12 and dh:
//   s = sigmoid(g)
//   h  = g * s * u                     (recomputed, never saved by forward)
//   du = dh * g * s
//   dg = dh * u * s * (1 + g * (1 - s))
// dx12 = [dg | du] uses the x12 layout. dx12 may alias x12 (opt-in in-place
// backward): each thread reads g and u before writing the same positions.
#include "swiglu_common.cuh"

template <int N>
__device__ __forceinline__ void swiglu_backward_rows(
    const scalar_t* x12, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_x12, index_t ld_dh, index_t ld_dx12, index_t ld_h) {
    const index_t col = pack_column<N>();
    if (col >= H) return;
    SWIGLU_FOR_EACH_ROW(row) {
        const GateUp<N> in = load_gate_up<N>(x12, row, col, ld_x12, H);
        const Pack<N> dout = load_pack<N>(dh + row * ld_dh + col);
        Pack<N> dg, du, hv;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const acc_t gi = to_acc(in.gate.v[i]);
            const acc_t ui = to_acc(in.up.v[i]);
            const acc_t di = to_acc(dout.v[i]);
            const acc_t s = sigmoid_acc(gi);
            const acc_t silu = gi * s;
            hv.v[i] = from_acc<scalar_t>(silu * ui);
            du.v[i] = from_acc<scalar_t>(di * silu);
            dg.v[i] = from_acc<scalar_t>(di * ui * s * (acc_t(1) + gi * (acc_t(1) - s)));
        }
        scalar_t* dgate = dx12 + row * ld_dx12 + col;
        store_pack<N>(dgate, dg);
        store_pack<N>(dgate + H, du);
        store_pack<N>(h + row * ld_h + col, hv);
    }
}

// 16-byte accesses: H and all leading dims multiples of SWIGLU_VEC_WIDTH,
// all four base pointers 16-byte aligned.
extern "C" __global__ void swiglu_backward_vec(
    const scalar_t* x12, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_x12, index_t ld_dh, index_t ld_dx12, index_t ld_h) {
    swiglu_backward_rows<SWIGLU_VEC_WIDTH>(x12, dh, dx12, h, M, H, ld_x12, ld_dh, ld_dx12, ld_h);
}

extern "C" __global__ void swiglu_backward_scalar(
    const scalar_t* x12, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_x12, index_t ld_dh, index_t ld_dx12, index_t ld_h) {
    swiglu_backward_rows<1>(x12, dh, dx12, h, M, H, ld_x12, ld_dh, ld_dx12, ld_h);
}
