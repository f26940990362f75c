// Backward primitive, one pass over gate, up and dh:
//   s = sigmoid(g)
//   h  = g * s * u                     (recomputed, never saved by forward)
//   du = dh * g * s
//   dg = dh * u * s * (1 + g * (1 - s))
// dgate, dup and h are separate pointers with their own row strides (the
// packed dx12 passes dgate = dx12, dup = dx12 + H); h == nullptr skips
// storing h. dgate/dup may alias gate/up (opt-in in-place backward): each
// thread loads its whole tile before storing to the same positions.
#include "swiglu_common.cuh"

template <int N, int PACKS>
__device__ __forceinline__ void swiglu_backward_tiles(
    const scalar_t* gate, const scalar_t* up, const scalar_t* dh,
    scalar_t* dgate, scalar_t* dup, scalar_t* h,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_dh,
    index_t ld_dgate, index_t ld_dup, index_t ld_h) {
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
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const acc_t gi = to_acc(g.v[p].v[i]);
                const acc_t ui = to_acc(u.v[p].v[i]);
                const acc_t di = to_acc(d.v[p].v[i]);
                const acc_t s = sigmoid_acc(gi);
                const acc_t silu = gi * s;
                hv.v[i] = from_acc<scalar_t>(silu * ui);
                du.v[i] = from_acc<scalar_t>(di * silu);
                dg.v[i] = from_acc<scalar_t>(di * ui * s * (acc_t(1) + gi * (acc_t(1) - s)));
            }
            store_pack<N>(dgate_row + col, dg);
            store_pack<N>(dup_row + col, du);
            if (h != nullptr) store_pack<N>(h + row * ld_h + col, hv);
        }
    }
}

// Same access-width rules as the forward entries, over all six pointers.
#define SWIGLU_BACKWARD_ENTRY(name, N, PACKS)                                                 \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(const scalar_t* gate, const scalar_t* up, const scalar_t* dh, \
                                    scalar_t* dgate, scalar_t* dup, scalar_t* h,               \
                                    index_t M, index_t H, index_t ld_gate, index_t ld_up,      \
                                    index_t ld_dh, index_t ld_dgate, index_t ld_dup,           \
                                    index_t ld_h) {                                            \
        swiglu_backward_tiles<N, PACKS>(gate, up, dh, dgate, dup, h, M, H, ld_gate, ld_up,     \
                                        ld_dh, ld_dgate, ld_dup, ld_h);                        \
    }
