// Backward primitive, one pass over gate, up and dh for one GLU variant
// (glu_activations.cuh): h = act(gate') * up' (recomputed, never saved by
// forward), dup = dh * act(gate') and dgate = dh * up' * act'(gate'), with
// the clamps' gradient masks.
//
// Halves layout: dgate, dup and h are separate pointers with their own row
// strides (the packed dx12 passes dgate = dx12, dup = dx12 + H); h == nullptr
// skips storing h. dgate/dup may alias gate/up (opt-in in-place backward):
// each thread loads its whole tile before storing to the same positions.
//
// Interleaved layout (pairs): x12 and dx12 [M, 2H] hold [g0, u0, g1, u1, ...]
// (dx12 may be x12 itself, by the same rule); dh and h are [M, H].
#include "glu_activations.cuh"

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_backward_halves(
    const scalar_t* gate, const scalar_t* up, const scalar_t* dh,
    scalar_t* dgate, scalar_t* dup, scalar_t* h,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_dh,
    index_t ld_dgate, index_t ld_dup, index_t ld_h, const GluParams prm) {
    SWIGLU_FOR_EACH_TILE(N, PACKS, row, col0) {
        const Tile<N, PACKS> g = load_tile<N, PACKS>(gate + row * ld_gate, col0, H);
        const Tile<N, PACKS> u = load_tile<N, PACKS>(up + row * ld_up, col0, H);
        const Tile<N, PACKS> d = load_tile<N, PACKS>(dh + row * ld_dh, col0, H);
        scalar_t* dgate_row = dgate + row * ld_dgate;
        scalar_t* dup_row = dup + row * ld_dup;
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            const index_t col = pack_column<N>(col0, p);
            if (col >= H) break;  // later packs lie further right
            Pack<N> dg, du, hv;
            glu_backward_pack<GLU, N>(g.v[p], u.v[p], d.v[p], prm, dg, du, hv);
            store_pack<N>(dgate_row + col, dg);
            store_pack<N>(dup_row + col, du);
            if (h != nullptr) store_pack<N>(h + row * ld_h + col, hv);
        }
    }
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_backward_pairs(
    const scalar_t* x12, const scalar_t* dh, scalar_t* dx12, scalar_t* h,
    index_t M, index_t H, index_t ld_x12, index_t ld_dh, index_t ld_dx12, index_t ld_h,
    const GluParams prm) {
    SWIGLU_FOR_EACH_TILE(N, PACKS, row, col0) {
        const Tile<N, 2 * PACKS> x = load_pair_tile<N, PACKS>(x12 + row * ld_x12, col0, H);
        const Tile<N, PACKS> d = load_tile<N, PACKS>(dh + row * ld_dh, col0, H);
        scalar_t* dx12_row = dx12 + row * ld_dx12;
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            const index_t col = pack_column<N>(col0, p);
            if (col >= H) break;
            Pack<N> g, u, dg, du, hv, lo, hi;
            split_pairs<N>(x.v[2 * p], x.v[2 * p + 1], g, u);
            glu_backward_pack<GLU, N>(g, u, d.v[p], prm, dg, du, hv);
            join_pairs<N>(dg, du, lo, hi);
            store_pack<N>(dx12_row + 2 * col, lo);
            store_pack<N>(dx12_row + 2 * col + N, hi);
            if (h != nullptr) store_pack<N>(h + row * ld_h + col, hv);
        }
    }
}

// Same access-width rules as the forward entries, over all pointers.
#define GLU_BACKWARD_ENTRY(name, GLU, N, PACKS)                                                \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* gate, const scalar_t* up, const scalar_t* dh, scalar_t* dgate,          \
        scalar_t* dup, scalar_t* h, index_t M, index_t H, index_t ld_gate, index_t ld_up,       \
        index_t ld_dh, index_t ld_dgate, index_t ld_dup, index_t ld_h,                          \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                          \
        glu_backward_halves<GLU, N, PACKS>(gate, up, dh, dgate, dup, h, M, H, ld_gate, ld_up,   \
                                           ld_dh, ld_dgate, ld_dup, ld_h,                       \
                                           GluParams{limit, alpha, up_offset, grad_bound});     \
    }

#define GLU_BACKWARD_PAIRS_ENTRY(name, GLU, N, PACKS)                                          \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                       \
        const scalar_t* x12, const scalar_t* dh, scalar_t* dx12, scalar_t* h, index_t M,        \
        index_t H, index_t ld_x12, index_t ld_dh, index_t ld_dx12, index_t ld_h,                \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                          \
        glu_backward_pairs<GLU, N, PACKS>(x12, dh, dx12, h, M, H, ld_x12, ld_dh, ld_dx12, ld_h, \
                                          GluParams{limit, alpha, up_offset, grad_bound});      \
    }
