// Fused optimizer steps over one flat dtype group: one launch updates every parameter.
//
// Launched by convfuse/optim (sgd.py, adam.py). The formulas follow PyTorch's
// single-tensor SGD/Adam/AdamW (maximize=False, amsgrad=False, dampening=0), element by
// element and in the same order, so that the NumPy path in convfuse/optim computes the
// same values. float16/bfloat16 parameters and gradients are read into float, updated in
// float against float32 state, and rounded (to nearest even) once when stored.
//
// Learning rate and step count live in device memory so that a step needs no host work
// beyond the launch and can be captured in a CUDA graph and replayed:
//   lr     : one double, written by the host (an async fill) whenever a schedule changes it.
//   step   : one long long, the number of steps already taken by this group. Each block
//            reads it at its start; the last block to finish writes step + 1 (see
//            finish_step for why no block can read the new value within the same launch).
//   ticket : one unsigned int, zero between launches; counts finished blocks.
// Per-step scalars (bias corrections, step size, decay factor) are computed in double from
// lr and the step count, as PyTorch computes them in Python floats, then rounded once to
// the compute type (float, or double for float64 parameters).

#include "common.cuh"  // Note [kernels need no CUDA headers]

namespace {

template <typename T> struct ComputeOf { using type = float; };
template <> struct ComputeOf<double> { using type = double; };

__device__ __forceinline__ float load(const float* a, long long i) { return a[i]; }
__device__ __forceinline__ double load(const double* a, long long i) { return a[i]; }
__device__ __forceinline__ float load(const __half* a, long long i) { return __half2float(a[i]); }
__device__ __forceinline__ float load(const __nv_bfloat16* a, long long i) {
    return __bfloat162float(a[i]);
}

__device__ __forceinline__ void store(float* a, long long i, float x) { a[i] = x; }
__device__ __forceinline__ void store(double* a, long long i, double x) { a[i] = x; }
__device__ __forceinline__ void store(__half* a, long long i, float x) { a[i] = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* a, long long i, float x) {
    a[i] = __float2bfloat16_rn(x);
}

// PyTorch's lerp (aten/src/ATen/native/Lerp.h): the two forms keep the result exact at
// both ends of the weight range; Adam calls it with weight = 1 - beta1.
template <typename C>
__device__ __forceinline__ C lerp(C self, C end, C weight) {
    return (fabs(weight) < C(0.5)) ? self + weight * (end - self)
                                   : end - (end - self) * (C(1) - weight);
}

// The number (1-based) of the step this launch performs. Thread 0 reads the counter once
// and shares it, so every thread of the block agrees even though the counter changes
// before the launch ends.
__device__ __forceinline__ long long begin_step(const long long* step) {
    __shared__ long long t;
    if (threadIdx.x == 0) t = *step + 1;
    __syncthreads();
    return t;
}

// Why this is race-free: a block reads `step` in begin_step, before its own atomicAdd on
// `ticket` below, and the __threadfence keeps that read ordered before the atomic (the
// release half). The atomic adds are totally ordered, so the block that draws ticket
// gridDim.x - 1 is the last: every other block has already taken its ticket, hence
// already read `step`. Only that last block writes `step`, after its own read and after a
// second __threadfence (the acquire half, as in PyTorch's Reduce.cuh last-block pattern),
// so under the PTX memory model every other block's read happens before that write and
// cannot observe it. So no block of this launch sees the new value, and the next launch
// (ordered after this one on the stream or in the graph) sees it. The last block also
// rewinds `ticket` to 0, which no other block of this launch touches again, so the next
// launch (or graph replay) starts from a clean count.
__device__ __forceinline__ void finish_step(long long* step, unsigned int* ticket, long long t) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned int done = atomicAdd(ticket, 1u);
        if (done == gridDim.x - 1) {
            __threadfence();
            *step = t;
            *ticket = 0u;
        }
    }
}

// SGD (torch.optim.sgd._single_tensor_sgd with dampening = 0):
//   d = g + wd * p;  buf = d on the first step, else momentum * buf + d;
//   d = d + momentum * buf (nesterov) or buf;  p = p - lr * d.
// `buf` is not read when momentum == 0 (it may then be NULL).
template <typename T>
__device__ void sgd_step(T* __restrict__ p, const T* __restrict__ g,
                         typename ComputeOf<T>::type* __restrict__ buf, long long n,
                         const double* __restrict__ lr, long long* step, unsigned int* ticket,
                         double momentum, double weight_decay, int nesterov) {
    using C = typename ComputeOf<T>::type;
    const long long t = begin_step(step);
    const C neg_lr = C(-*lr);
    const C mom = C(momentum);
    const C wd = C(weight_decay);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        C param = load(p, i);
        C d = load(g, i);
        if (weight_decay != 0.0) d = d + wd * param;
        if (momentum != 0.0) {
            const C b = (t == 1) ? d : buf[i] * mom + d;
            buf[i] = b;
            d = nesterov ? d + mom * b : b;
        }
        store(p, i, param + neg_lr * d);
    }
    finish_step(step, ticket, t);
}

// Adam (torch.optim.adam._single_tensor_adam, amsgrad = False), and AdamW when
// `decoupled` is set (p = p * (1 - lr * wd) first, no L2 term in the gradient):
//   d = g + wd * p;  m = lerp(m, d, 1 - b1);  v = v * b2 + (1 - b2) * d * d;
//   p = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
template <typename T>
__device__ void adam_step(T* __restrict__ p, const T* __restrict__ g,
                          typename ComputeOf<T>::type* __restrict__ m,
                          typename ComputeOf<T>::type* __restrict__ v, long long n,
                          const double* __restrict__ lr, long long* step, unsigned int* ticket,
                          double beta1, double beta2, double eps, double weight_decay,
                          int decoupled) {
    using C = typename ComputeOf<T>::type;
    const long long t = begin_step(step);
    // Thread 0 derives the per-step scalars once per block (double pow is slow on GPUs
    // with few FP64 units); the others read them from shared memory.
    __shared__ double scalars[3];
    if (threadIdx.x == 0) {
        const double lr_d = *lr;
        const double bias_correction1 = 1.0 - pow(beta1, (double)t);
        const double bias_correction2 = 1.0 - pow(beta2, (double)t);
        scalars[0] = -(lr_d / bias_correction1);
        scalars[1] = sqrt(bias_correction2);
        scalars[2] = 1.0 - lr_d * weight_decay;
    }
    __syncthreads();
    const C neg_step_size = C(scalars[0]);
    const C bc2_sqrt = C(scalars[1]);
    const C decay = C(scalars[2]);
    const C wd = C(weight_decay);
    const C w1 = C(1.0 - beta1);
    const C b2 = C(beta2);
    const C w2 = C(1.0 - beta2);
    const C eps_c = C(eps);
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        C param = load(p, i);
        C d = load(g, i);
        if (decoupled) {
            param = param * decay;
        } else if (weight_decay != 0.0) {
            d = d + wd * param;
        }
        const C mi = lerp(m[i], d, w1);
        const C vi = v[i] * b2 + (w2 * d) * d;
        m[i] = mi;
        v[i] = vi;
        const C denom = sqrt(vi) / bc2_sqrt + eps_c;
        store(p, i, param + neg_step_size * (mi / denom));
    }
    finish_step(step, ticket, t);
}

}  // namespace

#define CONVFUSE_OPTIM_KERNELS(SUFFIX, T)                                                      \
    extern "C" __global__ void sgd_##SUFFIX(                                                   \
        T* p, const T* g, ComputeOf<T>::type* buf, long long n, const double* lr,              \
        long long* step, unsigned int* ticket, double momentum, double weight_decay,           \
        int nesterov) {                                                                        \
        sgd_step<T>(p, g, buf, n, lr, step, ticket, momentum, weight_decay, nesterov);         \
    }                                                                                          \
    extern "C" __global__ void adam_##SUFFIX(                                                  \
        T* p, const T* g, ComputeOf<T>::type* m, ComputeOf<T>::type* v, long long n,           \
        const double* lr, long long* step, unsigned int* ticket, double beta1, double beta2,   \
        double eps, double weight_decay, int decoupled) {                                      \
        adam_step<T>(p, g, m, v, n, lr, step, ticket, beta1, beta2, eps, weight_decay,         \
                     decoupled);                                                               \
    }

CONVFUSE_OPTIM_KERNELS(f32, float)
CONVFUSE_OPTIM_KERNELS(f64, double)
CONVFUSE_OPTIM_KERNELS(f16, __half)
CONVFUSE_OPTIM_KERNELS(bf16, __nv_bfloat16)
