// Forward primitive: h = silu(gate) * up.
//
// gate and up are separate pointers with their own row strides (the packed
// x12 passes gate = x12, up = x12 + H). h may alias gate (h == gate,
// ld_h == ld_gate): each thread loads its whole tile before storing to the
// same positions, so the no-grad path can overwrite x12 without extra memory.
// Hence no __restrict__.
#include "swiglu_common.cuh"

template <int N, int PACKS>
__device__ __forceinline__ void swiglu_forward_tiles(
    const scalar_t* gate, const scalar_t* up, scalar_t* h,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h) {
    SWIGLU_FOR_EACH_TILE(N, PACKS, row, col0) {
        const Tile<N, PACKS> g = load_tile<N, PACKS>(gate + row * ld_gate, col0, H);
        const Tile<N, PACKS> u = load_tile<N, PACKS>(up + row * ld_up, col0, H);
        scalar_t* h_row = h + row * ld_h;
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            const index_t col = pack_column<N>(col0, p);
            if (col >= H) break;  // later packs lie further right
            Pack<N> out;
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const acc_t gi = to_acc(g.v[p].v[i]);
                out.v[i] = from_acc<scalar_t>(gi * sigmoid_acc(gi) * to_acc(u.v[p].v[i]));
            }
            store_pack<N>(h_row + col, out);
        }
    }
}

// N = SWIGLU_VEC_WIDTH (16-byte accesses) requires H and every leading dim to
// be multiples of it and every pointer 16-byte aligned; N = 1 takes any layout.
#define SWIGLU_FORWARD_ENTRY(name, N, PACKS)                                              \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(const scalar_t* gate, const scalar_t* up, scalar_t* h, \
                                    index_t M, index_t H, index_t ld_gate, index_t ld_up,  \
                                    index_t ld_h) {                                        \
        swiglu_forward_tiles<N, PACKS>(gate, up, h, M, H, ld_gate, ld_up, ld_h);           \
    }
