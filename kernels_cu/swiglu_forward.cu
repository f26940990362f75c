// Forward primitive: h = act(gate) * up for one GLU variant (GLU = Glu<Act, CLAMP>,
// see glu_activations.cuh).
//
// Halves layout: gate and up are separate pointers with their own row strides
// (the packed x12 passes gate = x12, up = x12 + H). h may alias gate
// (h == gate, ld_h == ld_gate): each thread loads its whole tile before
// storing to the same positions, so the no-grad path can overwrite x12
// without extra memory. Hence no __restrict__.
//
// Interleaved layout (pairs): x12 [M, 2H] holds [g0, u0, g1, u1, ...]; each
// 16-byte load holds N/2 gate/up pairs, and h [M, H] is compact.
#include "glu_activations.cuh"

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_halves(
    const scalar_t* gate, const scalar_t* up, scalar_t* h,
    index_t M, index_t H, index_t ld_gate, index_t ld_up, index_t ld_h, const GluParams prm) {
    SWIGLU_FOR_EACH_TILE(N, PACKS, row, col0) {
        const Tile<N, PACKS> g = load_tile<N, PACKS>(gate + row * ld_gate, col0, H);
        const Tile<N, PACKS> u = load_tile<N, PACKS>(up + row * ld_up, col0, H);
        scalar_t* h_row = h + row * ld_h;
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            const index_t col = pack_column<N>(col0, p);
            if (col >= H) break;  // later packs lie further right
            Pack<N> out;
            glu_forward_pack<GLU, N>(g.v[p], u.v[p], prm, out);
            store_pack<N>(h_row + col, out);
        }
    }
}

template <class GLU, int N, int PACKS>
__device__ __forceinline__ void glu_forward_pairs(
    const scalar_t* x12, scalar_t* h, index_t M, index_t H, index_t ld_x12, index_t ld_h,
    const GluParams prm) {
    SWIGLU_FOR_EACH_TILE(N, PACKS, row, col0) {
        const Tile<N, 2 * PACKS> x = load_pair_tile<N, PACKS>(x12 + row * ld_x12, col0, H);
        scalar_t* h_row = h + row * ld_h;
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            const index_t col = pack_column<N>(col0, p);
            if (col >= H) break;
            Pack<N> g, u, out;
            split_pairs<N>(x.v[2 * p], x.v[2 * p + 1], g, u);
            glu_forward_pack<GLU, N>(g, u, prm, out);
            store_pack<N>(h_row + col, out);
        }
    }
}

// N = SWIGLU_VEC_WIDTH (16-byte accesses) requires H and every leading dim to
// be multiples of it and every pointer 16-byte aligned; N = 1 takes any layout.
#define GLU_FORWARD_ENTRY(name, GLU, N, PACKS)                                                \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                      \
        const scalar_t* gate, const scalar_t* up, scalar_t* h, index_t M, index_t H,           \
        index_t ld_gate, index_t ld_up, index_t ld_h, acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) { \
        glu_forward_halves<GLU, N, PACKS>(gate, up, h, M, H, ld_gate, ld_up, ld_h,             \
                                          GluParams{limit, alpha, up_offset, grad_bound});     \
    }

#define GLU_FORWARD_PAIRS_ENTRY(name, GLU, N, PACKS)                                          \
    extern "C" __global__ void SWIGLU_LAUNCH_BOUNDS name(                                      \
        const scalar_t* x12, scalar_t* h, index_t M, index_t H, index_t ld_x12, index_t ld_h,  \
        acc_t limit, acc_t alpha, acc_t up_offset, acc_t grad_bound) {                         \
        glu_forward_pairs<GLU, N, PACKS>(x12, h, M, H, ld_x12, ld_h, GluParams{limit, alpha, up_offset, grad_bound}); \
    }
