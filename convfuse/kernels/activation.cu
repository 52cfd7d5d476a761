// Activation kernels: forward, backward, and the fused activation-backward + bias gradient.
//
// Launched by convfuse/ops/elementwise.py. Each kernel takes the activation as a code (the
// ACT_* values below, mirrored by elementwise.ACTIVATION_CODES) and switches on it once,
// outside the element loop, into a loop specialised for that activation; so one kernel
// name per dtype serves every activation without a per-element branch.
//
// Math is done in float for float/__half/__nv_bfloat16 and in double for double; results
// are rounded once when stored. Meanings follow PyTorch (elu alpha 1, leaky_relu slope
// 0.01, exact-erf gelu). Backward derives from the saved tensor per convfuse/activations.py
// Note [what backward saves]: the output y, or the pre-activation z for elu, silu and gelu.
//
// Nothing here allocates, synchronises with the host or uses atomics, so every kernel can
// be captured in a CUDA graph and gives bit-identical results for identical launches.
// Pointers carry no __restrict__: out may alias an input (in-place activation), which is
// safe because each element is read and written by the same thread at the same index.

#include "common.cuh"

#define ACT_IDENTITY 0
#define ACT_RELU 1
#define ACT_SIGMOID 2
#define ACT_TANH 3
#define ACT_ELU 4
#define ACT_RELU6 5
#define ACT_LEAKY_RELU 6
#define ACT_SILU 7
#define ACT_GELU 8

// Threads per block of the bias kernels; their shared arrays are sized by it.
#define BIAS_BLOCK 256

namespace {


// Explicit overloads so float math never silently promotes to double.
__device__ __forceinline__ float m_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double m_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_fabs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_fabs(double x) { return fabs(x); }
__device__ __forceinline__ float m_erfc(float x) { return erfcf(x); }
__device__ __forceinline__ double m_erfc(double x) { return erfc(x); }

// Note [branches on saved values read their bits]
// CuPy compiles every kernel with -ftz=true (Note [CuPy compiles with -ftz=true] in
// kernels/__init__.py), and a .ftz float comparison reads a subnormal operand as zero:
// `y <= 0` would hold for y = 1e-40, and relu's backward would drop the dy that PyTorch
// (and the NumPy engine) pass on, taking the fused bias gradient with it. So every branch
// on the sign of a value (the saved y or z, and the forward's input) tests the value's bits
// with integer compares, which nothing flushes: the decisions of IEEE comparisons made
// without -ftz at every value (-0.0 is neither > 0 nor < 0, NaN is neither and not <= 0).
// float16 and bfloat16 are converted to float exactly before they are tested, sign and
// bits kept. A comparison with a nonzero constant (relu6's 6) needs no care: a flushed
// subnormal stays on the same side of it.
__device__ __forceinline__ unsigned int bits(float v) { return __float_as_uint(v); }
__device__ __forceinline__ unsigned long long bits(double v) {
    return (unsigned long long)__double_as_longlong(v);
}
__device__ __forceinline__ unsigned int sign_bit(float) { return 0x80000000u; }
__device__ __forceinline__ unsigned long long sign_bit(double) { return 0x8000000000000000ull; }
__device__ __forceinline__ unsigned int inf_bits(float) { return 0x7f800000u; }
__device__ __forceinline__ unsigned long long inf_bits(double) { return 0x7ff0000000000000ull; }

// v > 0: the bits of a positive value, +inf included, lie in [1, inf_bits]
template <typename C>
__device__ __forceinline__ bool gt_zero(C v) { return bits(v) - 1u < inf_bits(v); }
// v < 0: the same test on the bits with the sign flipped
template <typename C>
__device__ __forceinline__ bool lt_zero(C v) {
    return (bits(v) ^ sign_bit(v)) - 1u < inf_bits(v);
}
template <typename C>
__device__ __forceinline__ bool is_nan(C v) { return (bits(v) & ~sign_bit(v)) > inf_bits(v); }
// v <= 0: below zero, or +-0
template <typename C>
__device__ __forceinline__ bool le_zero(C v) {
    return lt_zero(v) || (bits(v) & ~sign_bit(v)) == 0u;
}

// exp(-|z|) never overflows, and for z < 0 the e / (1 + e) form keeps full relative
// accuracy where 1 / (1 + exp(-z)) would round to 0.
template <typename C>
__device__ __forceinline__ C sigmoid(C z) {
    const C e = m_exp(-m_fabs(z));
    return (lt_zero(z) ? e : C(1)) / (C(1) + e);  // the sign from the bits (Note below)
}

// Phi(z) = 0.5 (1 + erf(z / sqrt 2)), written as 0.5 erfc(-z / sqrt 2): the same value
// without the cancellation of 1 + erf for negative z.
template <typename C>
__device__ __forceinline__ C normal_cdf(C z) {
    return C(0.5) * m_erfc(z * C(-0.70710678118654752440));
}

// Expands CALL(code) for the activation code `act`, so each case instantiates a loop
// specialised for that activation (NVRTC allows no device lambdas, hence a macro).
#define ACT_SWITCH(act, CALL)                                   \
    switch (act) {                                              \
        case ACT_IDENTITY: CALL(ACT_IDENTITY); break;           \
        case ACT_RELU: CALL(ACT_RELU); break;                   \
        case ACT_SIGMOID: CALL(ACT_SIGMOID); break;             \
        case ACT_TANH: CALL(ACT_TANH); break;                   \
        case ACT_ELU: CALL(ACT_ELU); break;                     \
        case ACT_RELU6: CALL(ACT_RELU6); break;                 \
        case ACT_LEAKY_RELU: CALL(ACT_LEAKY_RELU); break;       \
        case ACT_SILU: CALL(ACT_SILU); break;                   \
        case ACT_GELU: CALL(ACT_GELU); break;                   \
        default: break; /* the launcher validates names */      \
    }

// ACT is a template constant, so the untaken branches fold away (plain `if`, which every
// branch type-checks for float and double alike, keeps the source valid before C++17).
template <int ACT, typename C>
__device__ __forceinline__ C act_forward(C z) {
    if (ACT == ACT_IDENTITY) {
        return z;
    } else if (ACT == ACT_RELU) {
        return (gt_zero(z) || is_nan(z)) ? z : C(0);  // NaN propagates, as torch.relu
    } else if (ACT == ACT_SIGMOID) {
        return sigmoid(z);
    } else if (ACT == ACT_TANH) {
        return m_tanh(z);
    } else if (ACT == ACT_ELU) {
        return gt_zero(z) ? z : m_expm1(z);  // expm1 keeps accuracy near 0, as PyTorch
    } else if (ACT == ACT_RELU6) {
        return is_nan(z) ? z : (lt_zero(z) ? C(0) : (z > C(6) ? C(6) : z));
    } else if (ACT == ACT_LEAKY_RELU) {
        return gt_zero(z) ? z : C(0.01) * z;
    } else if (ACT == ACT_SILU) {
        return z * sigmoid(z);
    } else {  // ACT_GELU, exact (erf) form: z Phi(z)
        return z * normal_cdf(z);
    }
}

// dz from dy and the saved tensor s (y, or z for elu/silu/gelu); every branch on s reads its
// bits (Note [branches on saved values read their bits]).
template <int ACT, typename C>
__device__ __forceinline__ C act_backward(C dy, C s) {
    if (ACT == ACT_IDENTITY) {
        return dy;
    } else if (ACT == ACT_RELU) {
        return le_zero(s) ? C(0) : dy;  // torch's threshold_backward: NaN y passes dy on
    } else if (ACT == ACT_SIGMOID) {
        return dy * s * (C(1) - s);
    } else if (ACT == ACT_TANH) {
        return dy * (C(1) - s * s);
    } else if (ACT == ACT_ELU) {
        // torch's elu_backward from the input: exp(z), not y + 1, which cancels near y = -1
        return le_zero(s) ? dy * m_exp(s) : dy;  // NaN z: dy; -inf: 0
    } else if (ACT == ACT_RELU6) {
        return (le_zero(s) || s >= C(6)) ? C(0) : dy;  // y in (0, 6) iff z is; NaN y: dy
    } else if (ACT == ACT_LEAKY_RELU) {
        return gt_zero(s) ? dy : C(0.01) * dy;
    } else if (ACT == ACT_SILU) {
        const C sig = sigmoid(s);
        return dy * sig * (C(1) + s * (C(1) - sig));
    } else {  // ACT_GELU: Phi(z) + z phi(z)
        const C pdf = m_exp(C(-0.5) * s * s) * C(0.39894228040143267794);
        return dy * (normal_cdf(s) + s * pdf);
    }
}

__device__ __forceinline__ long long global_thread() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long grid_threads() {
    return (long long)gridDim.x * blockDim.x;
}

template <int A, typename T>
__device__ void forward_loop(const T* z, T* y, long long n) {
    typedef typename Io<T>::C C;
    for (long long i = global_thread(); i < n; i += grid_threads())
        y[i] = Io<T>::store(act_forward<A, C>(Io<T>::load(z[i])));
}

template <int A, typename T>
__device__ void backward_loop(const T* dy, const T* s, T* dz, long long n) {
    typedef typename Io<T>::C C;
    for (long long i = global_thread(); i < n; i += grid_threads())
        dz[i] = Io<T>::store(act_backward<A, C>(Io<T>::load(dy[i]), Io<T>::load(s[i])));
}

template <typename T>
__device__ void forward(const T* z, T* y, long long n, int act) {
#define CALL(A) forward_loop<A, T>(z, y, n)
    ACT_SWITCH(act, CALL)
#undef CALL
}

template <typename T>
__device__ void backward(const T* dy, const T* s, T* dz, long long n, int act) {
#define CALL(A) backward_loop<A, T>(dy, s, dz, n)
    ACT_SWITCH(act, CALL)
#undef CALL
}

// Writes the bias gradient of one channel: sum + beta * db (db not read when beta == 0).
template <typename T>
__device__ __forceinline__ void store_bias(T* db, long long k, typename Io<T>::C sum, double beta) {
    typedef typename Io<T>::C C;
    if (beta != 0.0) sum += C(beta) * Io<T>::load(db[k]);
    db[k] = Io<T>::store(sum);
}

// Sum over a block of BIAS_BLOCK threads (a multiple of 32) in a fixed order; the result
// is valid in thread 0.
template <typename C>
__device__ __forceinline__ C block_sum(C v) {
    __shared__ C warp_sums[BIAS_BLOCK / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : C(0);
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    }
    return v;
}

// Note [fused activation-backward + bias gradient]
// dz = act'(...) * dy is written and summed per channel in the same pass, so dy and the
// saved tensor are read exactly once. The sum is deterministic: no float atomics; every
// partial sum is formed in an order fixed by the launch shape, which the launcher derives
// only from the tensor shape and the device's SM count. Two kernels do the first stage:
//
// bias_channel (channels-first with >= 32 spatial elements): the tensor is (N, K, S).
//   Block b handles part p = b % P of channel k = b / P, i.e. a contiguous range of that
//   channel's N*S elements (flat index j = n*S + s). Consecutive threads take consecutive
//   j, so loads are runs of S contiguous elements; (n, s) is advanced incrementally since
//   a 64-bit division per element would cost more than the load. A shuffle tree sums the
//   block.
// bias_rows (channels-last, and channels-first with few spatial elements): the tensor is
//   rows x cols (NHWC: N*spatial x K, group 1; NCHW: N x K*S, group S, column c belongs
//   to channel c / S). A block owns a tile of W adjacent columns and part p of the rows;
//   thread t owns column t % W and walks rows t / W, t / W + R, ... (R = blockDim / W), so
//   each pass over R rows reads W contiguous elements per row. The R row-sums of each
//   column are then added by a fixed tree in shared memory.
// With one part (P = 1) and group 1 the block writes db itself; otherwise each block
// writes its column sums to partial[p * cols + c] and bias_finish adds, per channel, the
// P * group partials with one warp in a fixed order, then applies beta. The sums are of
// the unrounded dz values in the compute type, so float16/bfloat16 round once, at db.

// This thread's share of part p of channel k (see the Note): the sum of the dz it wrote.
template <int A, typename T>
__device__ typename Io<T>::C channel_loop(const T* dy, const T* sv, T* dz, long long N,
                                          long long K, long long S, long long P, long long k,
                                          long long p) {
    typedef typename Io<T>::C C;
    const long long L = N * S, chunk = (L + P - 1) / P;
    const long long begin = p * chunk, end = min(L, begin + chunk);
    const long long step = blockDim.x, dn = step / S, ds = step - dn * S;
    long long j = begin + threadIdx.x;
    long long n = j / S, s = j - n * S;
    C acc = C(0);
    for (; j < end; j += step) {
        const long long i = (n * K + k) * S + s;
        const C g = act_backward<A, C>(Io<T>::load(dy[i]), Io<T>::load(sv[i]));
        if (dz) dz[i] = Io<T>::store(g);  // NULL: bias gradient only (identity)
        acc += g;
        s += ds;
        n += dn;
        if (s >= S) { s -= S; ++n; }
    }
    return acc;
}

template <typename T>
__device__ void bias_channel(const T* dy, const T* sv, T* dz, long long N, long long K,
                             long long S, long long P, typename Io<T>::C* partial, T* db,
                             double beta, int act) {
    typedef typename Io<T>::C C;
    const long long k = (long long)blockIdx.x / P, p = (long long)blockIdx.x % P;
    C acc = C(0);
#define CALL(A) acc = channel_loop<A, T>(dy, sv, dz, N, K, S, P, k, p)
    ACT_SWITCH(act, CALL)
#undef CALL
    acc = block_sum(acc);
    if (threadIdx.x == 0) {
        if (partial) partial[p * K + k] = acc;
        else store_bias(db, k, acc, beta);
    }
}

// This thread's sum down column c over rows begin + rg, begin + rg + R, ... < end.
template <int A, typename T>
__device__ typename Io<T>::C rows_loop(const T* dy, const T* sv, T* dz, long long cols,
                                       long long c, long long begin, long long end,
                                       long long R) {
    typedef typename Io<T>::C C;
    C acc = C(0);
    for (long long r = begin; r < end; r += R) {
        const long long i = r * cols + c;
        const C g = act_backward<A, C>(Io<T>::load(dy[i]), Io<T>::load(sv[i]));
        if (dz) dz[i] = Io<T>::store(g);  // NULL: bias gradient only (identity)
        acc += g;
    }
    return acc;
}

template <typename T>
__device__ void bias_rows(const T* dy, const T* sv, T* dz, long long rows, long long cols,
                          long long W, typename Io<T>::C* partial, T* db, double beta,
                          int act) {
    typedef typename Io<T>::C C;
    __shared__ C sums[BIAS_BLOCK];
    const long long R = blockDim.x / W, P = gridDim.y, p = blockIdx.y;
    const long long rg = threadIdx.x / W;
    const long long c = (long long)blockIdx.x * W + threadIdx.x % W;
    const long long chunk = (rows + P - 1) / P;
    const long long begin = p * chunk, end = min(rows, begin + chunk);
    C acc = C(0);
    if (c < cols) {
#define CALL(A) acc = rows_loop<A, T>(dy, sv, dz, cols, c, begin + rg, end, R)
        ACT_SWITCH(act, CALL)
#undef CALL
    }
    sums[threadIdx.x] = acc;
    __syncthreads();
    // Fixed tree over the R row groups; R need not be a power of two.
    long long h = 1;
    while (h < R) h <<= 1;
    for (h >>= 1; h > 0; h >>= 1) {
        if (rg < h && rg + h < R) sums[threadIdx.x] += sums[threadIdx.x + h * W];
        __syncthreads();
    }
    if (rg == 0 && c < cols) {
        if (partial) partial[p * cols + c] = sums[threadIdx.x];
        else store_bias(db, c, sums[threadIdx.x], beta);
    }
}

// One warp per channel k adds partial[p * K * G + k * G + g] over p < P, g < G.
template <typename T>
__device__ void bias_finish(const typename Io<T>::C* partial, long long P, long long K,
                            long long G, T* db, double beta) {
    typedef typename Io<T>::C C;
    const int lane = threadIdx.x & 31;
    const long long warps = grid_threads() >> 5;
    const long long count = P * G, cols = K * G;
    for (long long k = global_thread() >> 5; k < K; k += warps) {
        C acc = C(0);
        for (long long q = lane; q < count; q += 32) {
            const long long p = q / G, g = q - p * G;
            acc += partial[p * cols + k * G + g];
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
        if (lane == 0) store_bias(db, k, acc, beta);
    }
}

// Note [bias + activation pass]: the unfused forward (Note [unfused fallback] in
// ops/cudnn/fused.py) runs convolutionForward into y, then this one pass:
// y = act(y + bias[k] + scale * res), the fused call's formula, in the compute type, rounded
// once. bias and res may be NULL. k = (i / inner) % K: inner is the spatial size for
// channels-first data and 1 for channels-last. In place, like forward_loop.
template <int A, typename T>
__device__ void bias_act_loop(T* y, const T* bias, const T* res, long long n, long long K,
                              long long inner, typename Io<T>::C scale) {
    typedef typename Io<T>::C C;
    for (long long i = global_thread(); i < n; i += grid_threads()) {
        C v = Io<T>::load(y[i]);
        if (bias) v += Io<T>::load(bias[(i / inner) % K]);
        if (res) v += scale * Io<T>::load(res[i]);
        y[i] = Io<T>::store(act_forward<A, C>(v));
    }
}

template <typename T>
__device__ void bias_act(T* y, const T* bias, const T* res, long long n, long long K,
                         long long inner, double scale, int act) {
    typedef typename Io<T>::C C;
#define CALL(A) bias_act_loop<A, T>(y, bias, res, n, K, inner, C(scale))
    ACT_SWITCH(act, CALL)
#undef CALL
}

}  // namespace

#define CONVFUSE_ACTIVATION_KERNELS(SUFFIX, T)                                                 \
    extern "C" __global__ void act_forward_##SUFFIX(const T* z, T* y, long long n, int act) {  \
        forward<T>(z, y, n, act);                                                              \
    }                                                                                          \
    extern "C" __global__ void bias_act_forward_##SUFFIX(T* y, const T* bias, const T* res,    \
        long long n, long long K, long long inner, double scale, int act) {                    \
        bias_act<T>(y, bias, res, n, K, inner, scale, act);                                    \
    }                                                                                          \
    extern "C" __global__ void act_backward_##SUFFIX(const T* dy, const T* saved, T* dz,       \
                                                     long long n, int act) {                   \
        backward<T>(dy, saved, dz, n, act);                                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BIAS_BLOCK) act_bias_channel_##SUFFIX(        \
        const T* dy, const T* saved, T* dz, long long N, long long K, long long S, long long P, \
        Io<T>::C* partial, T* db, double beta, int act) {                                      \
        bias_channel<T>(dy, saved, dz, N, K, S, P, partial, db, beta, act);                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(BIAS_BLOCK) act_bias_rows_##SUFFIX(           \
        const T* dy, const T* saved, T* dz, long long rows, long long cols, long long W,       \
        Io<T>::C* partial, T* db, double beta, int act) {                                      \
        bias_rows<T>(dy, saved, dz, rows, cols, W, partial, db, beta, act);                    \
    }                                                                                          \
    extern "C" __global__ void act_bias_finish_##SUFFIX(const Io<T>::C* partial, long long P,  \
                                                        long long K, long long G, T* db,       \
                                                        double beta) {                         \
        bias_finish<T>(partial, P, K, G, db, beta);                                            \
    }

CONVFUSE_ACTIVATION_KERNELS(f32, float)
CONVFUSE_ACTIVATION_KERNELS(f64, double)
CONVFUSE_ACTIVATION_KERNELS(f16, __half)
CONVFUSE_ACTIVATION_KERNELS(bf16, __nv_bfloat16)
