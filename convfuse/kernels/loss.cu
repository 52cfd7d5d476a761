// Softmax cross-entropy: per-row loss, correct flag and gradient in one pass, then a mean.
//
// Launched by convfuse/loss.py, in this order on one stream:
// xent_kept_<label type> counts the kept rows, those whose label is not ignore_index
// (torch.nn.CrossEntropyLoss's ignore_index), with one block in a fixed order, and stores
// the count at row_correct[N + 1]: the mean's denominator, read on the device, so nothing
// goes back to the host.
// xent_rows_<dtype>_<label type> reads a row of logits (N, C) and its label, and writes
//   row_loss[r]    = logsumexp(x) - x[label]      (max-subtracted, in float or double)
//   row_correct[r] = argmax(x) == label           (as numpy.argmax: first NaN, else first max)
//   dlogits[r, :]  = (softmax(x) - onehot(label)) / kept
// so backward costs nothing extra. A row whose label is ignore_index is not read: its loss
// and correct flag are 0 and its gradient row is zero (even for non-finite logits, where
// torch's log_softmax backward leaves NaN). Any other label outside [0, C) cannot be
// reported without a host sync, so its row gets a NaN loss (making the mean NaN) and a
// zero gradient; it is a kept row, counted in the denominator.
// xent_mean_<compute type> then sums the N row values in a fixed order with one block and
// stores the mean loss (sum / kept: NaN, 0/0, when every row is ignored, as torch) at
// row_loss[N] and the correct count at row_correct[N]: loss.py allocates row_loss with one
// extra element and row_correct with two, and returns views of those.
//
// No atomics, allocation or host synchronisation: results are bit-reproducible and the
// kernels can be captured in a CUDA graph.

#include "common.cuh"

// Threads per block of both kernels (xent_mean's shared arrays are sized by it).
#define XENT_BLOCK 256

namespace {


__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float neg_inf(float) { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ double neg_inf(double) { return -__longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ float quiet_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double quiet_nan(double) { return __longlong_as_double(0x7ff8000000000000LL); }

// Note [argmax compares keys]
// CuPy compiles with -ftz=true, which flushes subnormal operands of a float comparison to
// zero: 1e-40 > 0 would be false, and the argmax would part from numpy.argmax's (and from
// the CPU engine's) on subnormal logits (float32, bfloat16). So the comparisons that
// decide it read the values' bits: an order-preserving unsigned key (a negative value's
// bits inverted, a non-negative one's sign bit set; -0.0 first made +0.0, as IEEE has them
// equal). NaN is decided before any key is compared. double is never flushed, but reads
// the same way. The max itself, m, stays a float: it is only the exp-sum's shift.
__device__ __forceinline__ unsigned int order_key(float v) {
    unsigned int b = __float_as_uint(v);
    if (b == 0x80000000u) b = 0u;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ unsigned long long order_key(double v) {
    unsigned long long b = (unsigned long long)__double_as_longlong(v);
    if (b == 0x8000000000000000ULL) b = 0ULL;
    return (b & 0x8000000000000000ULL) ? ~b : (b | 0x8000000000000000ULL);
}

// One warp per row (grid-stride over rows): lanes stride across the C columns, and
// xor-shuffles combine the lanes so that every lane holds the same row max, argmax and
// exp-sum (float addition is commutative, so both partners of a butterfly agree exactly).
// The gradient's scale 1/kept is divided in the compute type, so the float kernels keep no
// double arithmetic; for kept <= 2^24 the float quotient is exactly float(1.0 / kept).
template <typename T, typename L>
__device__ void xent_rows(const T* logits, const L* labels, long long N, long long C,
                          long long ignore_index, T* dlogits, typename Io<T>::C* row_loss,
                          long long* row_correct) {
    typedef typename Io<T>::C F;
    const unsigned full = 0xffffffffu;
    const int lane = threadIdx.x & 31;
    const long long warps_per_block = blockDim.x >> 5;
    const long long stride = (long long)gridDim.x * warps_per_block;
    // kept == 0 means every row is ignored: the (infinite) scale is then never used.
    const F scale = F(1) / F(row_correct[N + 1]);
    for (long long r = (long long)blockIdx.x * warps_per_block + (threadIdx.x >> 5); r < N;
         r += stride) {
        const T* x = logits + r * C;
        T* g = dlogits + r * C;
        const long long label = (long long)labels[r];
        if (label == ignore_index) {  // the same for the whole warp: no shuffle skipped
            if (lane == 0) {
                row_loss[r] = F(0);
                row_correct[r] = 0;
            }
            for (long long j = lane; j < C; j += 32) g[j] = Io<T>::store(F(0));
            continue;
        }

        // Max and argmax as numpy.argmax: the first NaN if the row has one, else the first
        // maximum (index 0 of an all -inf row). am == C means "no column seen" (a lane
        // with no column, when C < 32). A NaN max makes the exp-sum, hence the loss and
        // the whole gradient row, NaN, as NumPy's max-subtracted form does.
        F m = neg_inf(F(0));
        long long am = C;
        for (long long j = lane; j < C; j += 32) {
            const F v = Io<T>::load(x[j]);
            if (am == C || (m == m && (v != v || order_key(v) > order_key(m)))) {
                m = v;
                am = j;
            }
        }
        // The order (NaN first, then larger value, then smaller index; "none" has index C,
        // so it loses every tie) is total, so both partners of a butterfly agree.
        for (int o = 16; o > 0; o >>= 1) {
            const F om = __shfl_xor_sync(full, m, o);
            const long long oa = __shfl_xor_sync(full, am, o);
            const bool o_nan = om != om, m_nan = m != m;
            const bool take = (o_nan != m_nan) ? o_nan
                            : ((o_nan || order_key(om) == order_key(m)) ? oa < am
                                                                         : order_key(om) > order_key(m));
            if (take) { m = om; am = oa; }
        }

        F s = F(0);
        for (long long j = lane; j < C; j += 32) s += m_exp(Io<T>::load(x[j]) - m);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(full, s, o);

        const bool valid = label >= 0 && label < C;
        if (lane == 0) {
            // logsumexp - x[label] = log(s) - (x[label] - m): no cancellation of m.
            row_loss[r] = valid ? m_log(s) - (Io<T>::load(x[label]) - m) : quiet_nan(F(0));
            row_correct[r] = (valid && am == label) ? 1 : 0;
        }
        const F inv_s = F(1) / s;
        for (long long j = lane; j < C; j += 32) {
            F d = F(0);
            if (valid) {
                d = m_exp(Io<T>::load(x[j]) - m) * inv_s;
                if (j == label) d -= F(1);
                d *= scale;
            }
            g[j] = Io<T>::store(d);
        }
    }
}

// One block of XENT_BLOCK threads: strided partial counts, then a fixed shared-memory tree.
template <typename L>
__device__ void xent_kept(const L* labels, long long N, long long ignore_index,
                          long long* row_correct) {
    __shared__ long long kept_sums[XENT_BLOCK];
    long long k = 0;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) {
        k += ((long long)labels[i] != ignore_index) ? 1 : 0;
    }
    kept_sums[threadIdx.x] = k;
    __syncthreads();
    for (unsigned h = blockDim.x >> 1; h > 0; h >>= 1) {
        if (threadIdx.x < h) kept_sums[threadIdx.x] += kept_sums[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0) row_correct[N + 1] = kept_sums[0];
}

// One block of XENT_BLOCK threads: strided partial sums, then a fixed shared-memory tree.
// Ignored rows hold loss 0, so the sum is over the kept rows; it is divided by their count.
template <typename F>
__device__ void xent_mean(F* row_loss, long long* row_correct, long long N) {
    __shared__ F loss_sums[XENT_BLOCK];
    __shared__ long long correct_sums[XENT_BLOCK];
    F a = F(0);
    long long c = 0;
    for (long long i = threadIdx.x; i < N; i += blockDim.x) {
        a += row_loss[i];
        c += row_correct[i];
    }
    loss_sums[threadIdx.x] = a;
    correct_sums[threadIdx.x] = c;
    __syncthreads();
    for (unsigned h = blockDim.x >> 1; h > 0; h >>= 1) {
        if (threadIdx.x < h) {
            loss_sums[threadIdx.x] += loss_sums[threadIdx.x + h];
            correct_sums[threadIdx.x] += correct_sums[threadIdx.x + h];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        row_loss[N] = loss_sums[0] / F(row_correct[N + 1]);  // 0 kept: 0/0, NaN
        row_correct[N] = correct_sums[0];
    }
}

}  // namespace

#define CONVFUSE_XENT_ROWS(SUFFIX, T, LSUFFIX, L)                                            \
    extern "C" __global__ void __launch_bounds__(XENT_BLOCK) xent_rows_##SUFFIX##_##LSUFFIX( \
        const T* logits, const L* labels, long long N, long long C, long long ignore_index,   \
        T* dlogits, Io<T>::C* row_loss, long long* row_correct) {                            \
        xent_rows<T, L>(logits, labels, N, C, ignore_index, dlogits, row_loss, row_correct); \
    }

#define CONVFUSE_XENT(SUFFIX, T)                  \
    CONVFUSE_XENT_ROWS(SUFFIX, T, i32, int)       \
    CONVFUSE_XENT_ROWS(SUFFIX, T, i64, long long)

CONVFUSE_XENT(f32, float)
CONVFUSE_XENT(f64, double)
CONVFUSE_XENT(f16, __half)
CONVFUSE_XENT(bf16, __nv_bfloat16)

#define CONVFUSE_XENT_KEPT(LSUFFIX, L)                                                   \
    extern "C" __global__ void __launch_bounds__(XENT_BLOCK) xent_kept_##LSUFFIX(         \
        const L* labels, long long N, long long ignore_index, long long* row_correct) {   \
        xent_kept<L>(labels, N, ignore_index, row_correct);                               \
    }

CONVFUSE_XENT_KEPT(i32, int)
CONVFUSE_XENT_KEPT(i64, long long)

// Named by the compute type of the row values: f32 serves float32/float16/bfloat16 logits.
extern "C" __global__ void __launch_bounds__(XENT_BLOCK)
xent_mean_f32(float* row_loss, long long* row_correct, long long N) {
    xent_mean<float>(row_loss, row_correct, N);
}
extern "C" __global__ void __launch_bounds__(XENT_BLOCK)
xent_mean_f64(double* row_loss, long long* row_correct, long long N) {
    xent_mean<double>(row_loss, row_correct, N);
}
