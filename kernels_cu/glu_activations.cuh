// The GLU family as compile-time functors: every variant is its own
// instance (activation kind x clamp on/off; the layout is the entry point),
// never a per-element runtime branch on the kind.
//
//   h = act(gate') * up'      gate' = min(gate, limit), up' = clamp(up, -limit, limit)
//                             when clamped; OAI: up' += up_offset
//
// The runtime scalars (limit, OAI's alpha and up_offset, grad_bound) are
// kernel arguments in acc_t. Backward gradients follow torch's autograd of
// the eager expression: a clamp passes the gradient where |x| <= grad_bound
// (gate: x <= grad_bound; 0 for NaN). The host sets grad_bound to the limit
// where the installed torch passes the gradient at exactly the bound (up to
// 2.13), and to the next value below it where torch cuts there (2.14 on):
// for floats, x < L is x <= nextafter(L, -inf), so either rule costs the
// same compare.
#pragma once
#include "swiglu_common.cuh"

struct GluParams {
    acc_t limit;      // read by clamped instances only
    acc_t alpha;      // OaiAct only
    acc_t up_offset;  // OaiAct only
    acc_t grad_bound; // clamped backward only: the gradient passes where |x| <= grad_bound
};

__device__ __forceinline__ float erf_acc(float v) { return erff(v); }
// fp64 erf is a long libdevice routine: inlined into a multi-pack tile,
// ptxas interleaves several of them and spills. One out-of-line copy keeps
// every instance spill-free (fp64 storage is the checking dtype, not the fast one).
__device__ __noinline__ double erf_acc(double v) { return erf(v); }

// Each activation: value(g) = act(g), and value_and_grad(g) = (act(g), act'(g)).
// shift_up is the identity except for the OAI form's up + up_offset.
struct PlainUp {
    static __device__ __forceinline__ acc_t shift_up(acc_t u, const GluParams&) { return u; }
};

struct SiluAct : PlainUp {  // SwiGLU
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) { return g * sigmoid_acc(g); }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        const acc_t s = sigmoid_acc(g);
        a = g * s;
        da = s * (acc_t(1) + g * (acc_t(1) - s));
    }
};

// GPT-OSS: g * sigmoid(alpha * g) * (up + up_offset).
struct OaiAct {
    static __device__ __forceinline__ acc_t shift_up(acc_t u, const GluParams& p) { return u + p.up_offset; }
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams& p) { return g * sigmoid_acc(g * p.alpha); }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams& p, acc_t& a, acc_t& da) {
        const acc_t z = g * p.alpha;
        const acc_t s = sigmoid_acc(z);
        a = g * s;
        da = s * (acc_t(1) + z * (acc_t(1) - s));
    }
};

// GeGLU as Gemma computes it: F.gelu(approximate="tanh"), torch's constants.
// 0.5 * (1 + tanh(y)) is sigmoid(2y) exactly, so the value is g * sigmoid(2 * inner)
// and the derivative needs no tanh: (1 - tanh^2) / 2 = 2 s (1 - s).
struct GeluTanhAct : PlainUp {
    static constexpr double kBeta = 0.7978845608028654;  // sqrt(2 / pi)
    static constexpr double kKappa = 0.044715;
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) {
        const acc_t inner = acc_t(kBeta) * (g + acc_t(kKappa) * (g * g * g));
        return g * sigmoid_acc(acc_t(2) * inner);
    }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        const acc_t g2 = g * g;
        acc_t s, c;
        sigmoid_and_complement(acc_t(2) * (acc_t(kBeta) * (g + acc_t(kKappa) * (g2 * g))), s, c);
        a = g * s;
        da = s + acc_t(2) * g * (s * c) * (acc_t(kBeta) * (acc_t(1) + acc_t(3 * kKappa) * g2));
    }
};

// GeGLU with the exact (erf) gelu.
struct GeluAct : PlainUp {
    static constexpr double kSqrtHalf = 0.7071067811865476;       // 1 / sqrt(2)
    static constexpr double kInvSqrt2Pi = 0.3989422804014327;     // 1 / sqrt(2 pi)
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) {
        return g * (acc_t(0.5) * (acc_t(1) + erf_acc(g * acc_t(kSqrtHalf))));
    }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        const acc_t cdf = acc_t(0.5) * (acc_t(1) + erf_acc(g * acc_t(kSqrtHalf)));
        a = g * cdf;
        da = cdf + g * (exp_acc(acc_t(-0.5) * g * g) * acc_t(kInvSqrt2Pi));
    }
};

// ReGLU. NaN passes through the value (as torch.relu); the gradient is 0 there.
struct ReluAct : PlainUp {
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) { return g < acc_t(0) ? acc_t(0) : g; }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams& p, acc_t& a, acc_t& da) {
        a = value(g, p);
        da = g > acc_t(0) ? acc_t(1) : acc_t(0);
    }
};

// The original GLU: sigmoid(gate) * up.
struct SigmoidAct : PlainUp {
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) { return sigmoid_acc(g); }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        a = sigmoid_acc(g);
        da = a * (acc_t(1) - a);
    }
};

// Bilinear: gate * up.
struct IdentityAct : PlainUp {
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) { return g; }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        a = g;
        da = acc_t(1);
    }
};

// One variant: an activation plus the clamp (compile-time on/off). The
// selects below are data-dependent (as torch.clamp), not a variant branch.
template <class Act, bool CLAMP>
struct Glu {
    static __device__ __forceinline__ acc_t clamp_gate(acc_t g, const GluParams& p) {
        return (CLAMP && g > p.limit) ? p.limit : g;  // NaN stays NaN, as torch.clamp
    }
    static __device__ __forceinline__ acc_t clamp_up(acc_t u, const GluParams& p) {
        if (!CLAMP) return u;
        return u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
    }
    static __device__ __forceinline__ acc_t forward(acc_t g, acc_t u, const GluParams& p) {
        return Act::value(clamp_gate(g, p), p) * Act::shift_up(clamp_up(u, p), p);
    }
    // h (recomputed), dgate and dup for one element.
    static __device__ __forceinline__ void backward(acc_t g, acc_t u, acc_t d, const GluParams& p,
                                                    acc_t& h, acc_t& dg, acc_t& du) {
        const acc_t uc = Act::shift_up(clamp_up(u, p), p);
        acc_t a, da;
        Act::value_and_grad(clamp_gate(g, p), p, a, da);
        h = a * uc;
        du = d * a;
        dg = d * uc * da;
        if (CLAMP) {
            if (!(g <= p.grad_bound)) dg = acc_t(0);
            if (!(u >= -p.grad_bound && u <= p.grad_bound)) du = acc_t(0);
        }
    }
};

// Pack-level math shared by both layouts.
template <class GLU, int N>
__device__ __forceinline__ void glu_forward_pack(const Pack<N>& g, const Pack<N>& u, const GluParams& p,
                                                 Pack<N>& out) {
#pragma unroll
    for (int i = 0; i < N; ++i) out.v[i] = from_acc<scalar_t>(GLU::forward(to_acc(g.v[i]), to_acc(u.v[i]), p));
}

template <class GLU, int N>
__device__ __forceinline__ void glu_backward_pack(const Pack<N>& g, const Pack<N>& u, const Pack<N>& d,
                                                  const GluParams& p, Pack<N>& dg, Pack<N>& du, Pack<N>& h) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        acc_t hi, dgi, dui;
        GLU::backward(to_acc(g.v[i]), to_acc(u.v[i]), to_acc(d.v[i]), p, hi, dgi, dui);
        h.v[i] = from_acc<scalar_t>(hi);
        dg.v[i] = from_acc<scalar_t>(dgi);
        du.v[i] = from_acc<scalar_t>(dui);
    }
}

// ---- interleaved layout: x12 row = [g0, u0, g1, u1, ...] -------------------------------
// h columns [c, c + N) read x12 columns [2c, 2c + 2N): two packs, lo and hi.
// Splitting and joining are compile-time register moves.
template <int N>
__device__ __forceinline__ void split_pairs(const Pack<N>& lo, const Pack<N>& hi, Pack<N>& g, Pack<N>& u) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        g.v[i] = 2 * i < N ? lo.v[2 * i] : hi.v[2 * i - N];
        u.v[i] = 2 * i + 1 < N ? lo.v[2 * i + 1] : hi.v[2 * i + 1 - N];
    }
}

template <int N>
__device__ __forceinline__ void join_pairs(const Pack<N>& g, const Pack<N>& u, Pack<N>& lo, Pack<N>& hi) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (2 * i < N) lo.v[2 * i] = g.v[i]; else hi.v[2 * i - N] = g.v[i];
        if (2 * i + 1 < N) lo.v[2 * i + 1] = u.v[i]; else hi.v[2 * i + 1 - N] = u.v[i];
    }
}

// A thread's tile of pairs: packs 2p and 2p+1 hold the pairs of its h pack p
// (the same past-the-end rule as load_tile).
template <int N, int PACKS> __device__ __forceinline__ Tile<N, 2 * PACKS> load_pair_tile(
    const scalar_t* row_start, index_t col0, index_t H) {
    Tile<N, 2 * PACKS> tile;
#pragma unroll
    for (int p = 0; p < PACKS; ++p) {
        const index_t col = pack_column<N>(col0, p);
        const scalar_t* at = row_start + 2 * (col < H ? col : H - N);
        tile.v[2 * p] = load_pack<N>(at);
        tile.v[2 * p + 1] = load_pack<N>(at + N);
    }
    return tile;
}
