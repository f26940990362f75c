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

// Each activation: value(g) = act(g), and value_and_grad(g) = (act(g), act'(g)),
// over a math type T (acc_t, or a FloatPair of two elements: swiglu_common.cuh).
// kPaired: whether its math is written over T; the others (erf, selects) run per
// lane. shift_up is the identity except for the OAI form's up + up_offset.
struct PlainUp {
    template <class T> static __device__ __forceinline__ T shift_up(T u, const GluParams&) { return u; }
};

struct SiluAct : PlainUp {  // SwiGLU
    static constexpr bool kPaired = true;
    template <class T> static __device__ __forceinline__ T value(T g, const GluParams&) { return g * sigmoid_acc(g); }
    template <class T> static __device__ __forceinline__ void value_and_grad(T g, const GluParams&, T& a, T& da) {
        const T s = sigmoid_acc(g);
        a = g * s;
        da = s * (T(1) + g * (T(1) - s));
    }
};

// GPT-OSS: g * sigmoid(alpha * g) * (up + up_offset).
struct OaiAct {
    static constexpr bool kPaired = true;
    template <class T> static __device__ __forceinline__ T shift_up(T u, const GluParams& p) { return u + T(p.up_offset); }
    template <class T> static __device__ __forceinline__ T value(T g, const GluParams& p) { return g * sigmoid_acc(g * T(p.alpha)); }
    template <class T> static __device__ __forceinline__ void value_and_grad(T g, const GluParams& p, T& a, T& da) {
        const T z = g * T(p.alpha);
        const T s = sigmoid_acc(z);
        a = g * s;
        da = s * (T(1) + z * (T(1) - s));
    }
};

// GeGLU as Gemma computes it: F.gelu(approximate="tanh"), torch's constants.
// 0.5 * (1 + tanh(y)) is sigmoid(2y) exactly, so the value is g * sigmoid(2 * inner)
// and the derivative needs no tanh: (1 - tanh^2) / 2 = 2 s (1 - s).
struct GeluTanhAct : PlainUp {
    static constexpr bool kPaired = true;
    static constexpr double kBeta = 0.7978845608028654;  // sqrt(2 / pi)
    static constexpr double kKappa = 0.044715;
    template <class T> static __device__ __forceinline__ T value(T g, const GluParams&) {
        const T inner = T(acc_t(kBeta)) * (g + T(acc_t(kKappa)) * (g * g * g));
        return g * sigmoid_acc(T(2) * inner);
    }
    template <class T> static __device__ __forceinline__ void value_and_grad(T g, const GluParams&, T& a, T& da) {
        const T g2 = g * g;
        T s, c;
        sigmoid_and_complement(T(2) * (T(acc_t(kBeta)) * (g + T(acc_t(kKappa)) * (g2 * g))), s, c);
        a = g * s;
        da = s + T(2) * g * (s * c) * (T(acc_t(kBeta)) * (T(1) + T(acc_t(3 * kKappa)) * g2));
    }
};

// GeGLU with the exact (erf) gelu: per lane (erff is the math library's).
struct GeluAct : PlainUp {
    static constexpr bool kPaired = false;
    static constexpr double kSqrtHalf = 0.7071067811865476;       // 1 / sqrt(2)
    static constexpr double kInvSqrt2Pi = 0.3989422804014327;     // 1 / sqrt(2 pi)
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) {
        return g * (acc_t(0.5) * (acc_t(1) + erf_acc(g * acc_t(kSqrtHalf))));
    }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams&, acc_t& a, acc_t& da) {
        const acc_t cdf = acc_t(0.5) * (acc_t(1) + erf_acc(g * acc_t(kSqrtHalf)));
        a = g * cdf;
        da = cdf + g * (exp_neg_acc(acc_t(0.5) * g * g) * acc_t(kInvSqrt2Pi));
    }
};

// ReGLU. NaN passes through the value (as torch.relu); the gradient is 0 there. Per lane (selects).
struct ReluAct : PlainUp {
    static constexpr bool kPaired = false;
    static __device__ __forceinline__ acc_t value(acc_t g, const GluParams&) { return g < acc_t(0) ? acc_t(0) : g; }
    static __device__ __forceinline__ void value_and_grad(acc_t g, const GluParams& p, acc_t& a, acc_t& da) {
        a = value(g, p);
        da = g > acc_t(0) ? acc_t(1) : acc_t(0);
    }
};

// The original GLU: sigmoid(gate) * up.
struct SigmoidAct : PlainUp {
    static constexpr bool kPaired = true;
    template <class T> static __device__ __forceinline__ T value(T g, const GluParams&) { return sigmoid_acc(g); }
    template <class T> static __device__ __forceinline__ void value_and_grad(T g, const GluParams&, T& a, T& da) {
        a = sigmoid_acc(g);
        da = a * (T(1) - a);
    }
};

// Bilinear: gate * up.
struct IdentityAct : PlainUp {
    static constexpr bool kPaired = true;
    template <class T> static __device__ __forceinline__ T value(T g, const GluParams&) { return g; }
    template <class T> static __device__ __forceinline__ void value_and_grad(T g, const GluParams&, T& a, T& da) {
        a = g;
        da = T(1);
    }
};

// One variant: an activation plus the clamp (compile-time on/off). The
// selects below are data-dependent (as torch.clamp), not a variant branch;
// they run per lane, the arithmetic around them over T.
template <class Act, bool CLAMP>
struct Glu {
    static constexpr bool kPaired = Act::kPaired;
    static __device__ __forceinline__ acc_t clamp_gate(acc_t g, const GluParams& p) {
        return (CLAMP && g > p.limit) ? p.limit : g;  // NaN stays NaN, as torch.clamp
    }
    static __device__ __forceinline__ acc_t clamp_up(acc_t u, const GluParams& p) {
        if (!CLAMP) return u;
        return u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
    }
    // The clamps' gradient masks: 0 where the clamp cut (NaN included).
    static __device__ __forceinline__ acc_t mask_gate_grad(acc_t g, acc_t dg, const GluParams& p) {
        return (CLAMP && !(g <= p.grad_bound)) ? acc_t(0) : dg;
    }
    static __device__ __forceinline__ acc_t mask_up_grad(acc_t u, acc_t du, const GluParams& p) {
        return (CLAMP && !(u >= -p.grad_bound && u <= p.grad_bound)) ? acc_t(0) : du;
    }
    static __device__ __forceinline__ FloatPair clamp_gate(FloatPair g, const GluParams& p) {
        return {clamp_gate(g.lo, p), clamp_gate(g.hi, p)};
    }
    static __device__ __forceinline__ FloatPair clamp_up(FloatPair u, const GluParams& p) {
        return {clamp_up(u.lo, p), clamp_up(u.hi, p)};
    }
    static __device__ __forceinline__ FloatPair mask_gate_grad(FloatPair g, FloatPair dg, const GluParams& p) {
        return {mask_gate_grad(g.lo, dg.lo, p), mask_gate_grad(g.hi, dg.hi, p)};
    }
    static __device__ __forceinline__ FloatPair mask_up_grad(FloatPair u, FloatPair du, const GluParams& p) {
        return {mask_up_grad(u.lo, du.lo, p), mask_up_grad(u.hi, du.hi, p)};
    }
    template <class T> static __device__ __forceinline__ T forward(T g, T u, const GluParams& p) {
        return Act::value(clamp_gate(g, p), p) * Act::shift_up(clamp_up(u, p), p);
    }
    // h (recomputed), dgate and dup for one element (or a pair).
    template <class T> static __device__ __forceinline__ void backward(T g, T u, T d, const GluParams& p,
                                                                       T& h, T& dg, T& du) {
        const T uc = Act::shift_up(clamp_up(u, p), p);
        T a, da;
        Act::value_and_grad(clamp_gate(g, p), p, a, da);
        h = a * uc;
        du = d * a;
        dg = d * uc * da;
        if (CLAMP) {
            dg = mask_gate_grad(g, dg, p);
            du = mask_up_grad(u, du, p);
        }
    }
};

// Two elements' math: one FloatPair where the variant's math is written over T
// and runs in fp32 (one paired instruction per operation on sm_100), else one
// element at a time. Every kernel's math goes through these (a lone element
// fills both lanes), so each element is rounded alike in every instance:
// scalar or 16-byte, 8-bit or not, on every arch.
template <class GLU>
constexpr bool kPairedMath = GLU::kPaired && sizeof(acc_t) == sizeof(float);

template <class GLU>
__device__ __forceinline__ void glu_forward_two(acc_t g0, acc_t g1, acc_t u0, acc_t u1, const GluParams& p,
                                                acc_t& h0, acc_t& h1) {
    if constexpr (kPairedMath<GLU>) {
        const FloatPair h = GLU::forward(FloatPair(g0, g1), FloatPair(u0, u1), p);
        h0 = h.lo;
        h1 = h.hi;
    } else {
        h0 = GLU::forward(g0, u0, p);
        h1 = GLU::forward(g1, u1, p);
    }
}

// h (recomputed), dgate and dup of two elements: index 0 and 1 of each array.
template <class GLU>
__device__ __forceinline__ void glu_backward_two(const acc_t g[2], const acc_t u[2], const acc_t d[2],
                                                 const GluParams& p, acc_t h[2], acc_t dg[2], acc_t du[2]) {
    if constexpr (kPairedMath<GLU>) {
        FloatPair hp, dgp, dup;
        GLU::backward(FloatPair(g[0], g[1]), FloatPair(u[0], u[1]), FloatPair(d[0], d[1]), p, hp, dgp, dup);
        h[0] = hp.lo, h[1] = hp.hi, dg[0] = dgp.lo, dg[1] = dgp.hi, du[0] = dup.lo, du[1] = dup.hi;
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) GLU::backward(g[i], u[i], d[i], p, h[i], dg[i], du[i]);
    }
}

// One element through the same math (both lanes of a pair hold it).
template <class GLU>
__device__ __forceinline__ acc_t glu_forward_one(acc_t g, acc_t u, const GluParams& p) {
    acc_t h, unused;
    glu_forward_two<GLU>(g, g, u, u, p, h, unused);
    return h;
}

template <class GLU>
__device__ __forceinline__ void glu_backward_one(acc_t g, acc_t u, acc_t d, const GluParams& p,
                                                 acc_t& h, acc_t& dg, acc_t& du) {
    const acc_t gi[2] = {g, g}, ui[2] = {u, u}, di[2] = {d, d};
    acc_t hi[2], dgi[2], dui[2];
    glu_backward_two<GLU>(gi, ui, di, p, hi, dgi, dui);
    h = hi[0], dg = dgi[0], du = dui[0];
}

// Pack-level math shared by both layouts, two elements at a time (an odd N's last alone).
template <class GLU, int N>
__device__ __forceinline__ void glu_forward_pack(const Pack<N>& g, const Pack<N>& u, const GluParams& p,
                                                 Pack<N>& out) {
#pragma unroll
    for (int i = 0; i + 1 < N; i += 2) {
        acc_t h0, h1;
        glu_forward_two<GLU>(to_acc(g.v[i]), to_acc(g.v[i + 1]), to_acc(u.v[i]), to_acc(u.v[i + 1]), p, h0, h1);
        out.v[i] = from_acc<scalar_t>(h0);
        out.v[i + 1] = from_acc<scalar_t>(h1);
    }
    if constexpr (N % 2) out.v[N - 1] = from_acc<scalar_t>(glu_forward_one<GLU>(to_acc(g.v[N - 1]), to_acc(u.v[N - 1]), p));
}

template <class GLU, int N>
__device__ __forceinline__ void glu_backward_pack(const Pack<N>& g, const Pack<N>& u, const Pack<N>& d,
                                                  const GluParams& p, Pack<N>& dg, Pack<N>& du, Pack<N>& h) {
#pragma unroll
    for (int i = 0; i + 1 < N; i += 2) {
        const acc_t gi[2] = {to_acc(g.v[i]), to_acc(g.v[i + 1])}, ui[2] = {to_acc(u.v[i]), to_acc(u.v[i + 1])},
                    di[2] = {to_acc(d.v[i]), to_acc(d.v[i + 1])};
        acc_t hi[2], dgi[2], dui[2];
        glu_backward_two<GLU>(gi, ui, di, p, hi, dgi, dui);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            h.v[i + k] = from_acc<scalar_t>(hi[k]);
            dg.v[i + k] = from_acc<scalar_t>(dgi[k]);
            du.v[i + k] = from_acc<scalar_t>(dui[k]);
        }
    }
    if constexpr (N % 2) {
        acc_t hl, dgl, dul;
        glu_backward_one<GLU>(to_acc(g.v[N - 1]), to_acc(u.v[N - 1]), to_acc(d.v[N - 1]), p, hl, dgl, dul);
        h.v[N - 1] = from_acc<scalar_t>(hl);
        dg.v[N - 1] = from_acc<scalar_t>(dgl);
        du.v[N - 1] = from_acc<scalar_t>(dul);
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
