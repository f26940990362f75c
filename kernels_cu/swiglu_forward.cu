// Forward primitive: h = silu(gate) * up, read from the packed x12 in place.
//
// h may alias the gate half of x12 (h == x12, ld_h == ld_x12): each thread
// reads its gate/up elements before writing the same gate positions, so the
// no-grad path can overwrite x12 without extra memory. Hence no __restrict__.
#include "swiglu_common.cuh"

template <int N>
__device__ __forceinline__ void swiglu_forward_rows(
    const scalar_t* x12, scalar_t* h, index_t M, index_t H, index_t ld_x12, index_t ld_h) {
    const index_t col = pack_column<N>();
    if (col >= H) return;
    SWIGLU_FOR_EACH_ROW(row) {
        const GateUp<N> in = load_gate_up<N>(x12, row, col, ld_x12, H);
        Pack<N> out;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const acc_t gi = to_acc(in.gate.v[i]);
            out.v[i] = from_acc<scalar_t>(gi * sigmoid_acc(gi) * to_acc(in.up.v[i]));
        }
        store_pack<N>(h + row * ld_h + col, out);
    }
}

// 16-byte accesses: requires H, ld_x12 and ld_h to be multiples of
// SWIGLU_VEC_WIDTH and both base pointers 16-byte aligned.
extern "C" __global__ void swiglu_forward_vec(
    const scalar_t* x12, scalar_t* h, index_t M, index_t H, index_t ld_x12, index_t ld_h) {
    swiglu_forward_rows<SWIGLU_VEC_WIDTH>(x12, h, M, H, ld_x12, ld_h);
}

// One element per access: any H, stride and alignment.
extern "C" __global__ void swiglu_forward_scalar(
    const scalar_t* x12, scalar_t* h, index_t M, index_t H, index_t ld_x12, index_t ld_h) {
    swiglu_forward_rows<1>(x12, h, M, H, ld_x12, ld_h);
}
