// Shared by convfuse's kernel sources: loading and storing each storage dtype through
// its compute type (float for float/__half/__nv_bfloat16, double for double), so a kernel
// template written once serves all four dtypes and rounds only when it stores.
//
// Note [kernels need no CUDA headers]
// NVRTC ships no cuda_fp16.h / cuda_bf16.h; they come from a CUDA toolkit or the
// nvidia-cuda-runtime wheel. The kernels use only storage types and four conversions, so
// this file defines those itself (under the CUDA names, bit-compatible with the toolkit's
// types), and kernels.source() pastes it into each source: NVRTC needs no -I at all, and
// a RawModule compile passes CuPy no include folder.
// CuPy itself still needs both NVRTC and the headers. CuPy 14.2 compiles its own
// elementwise and reduction kernels (astype, fill, arithmetic: convfuse's layers use
// them) through assemble_cupy_compiler_options, which raises "Failed to find CUDA
// headers" when no cuda_runtime.h is found (CUDA_PATH, a toolkit, or the runtime wheel
// located through the NVRTC that cuda.pathfinder loads), and it loads NVRTC from a wheel
// or a toolkit; nvidia-cudnn-cu13 depends on cuBLAS only, and CuPy on numpy and
// cuda-pathfinder only. So the cu12/cu13 extras add cuda-toolkit[cudart,nvrtc]
// (pyproject.toml): without them a user's first CuPy kernel fails, not convfuse's.
// Conversions match cuda_fp16.hpp / cuda_bf16.hpp: half through PTX cvt (exact, and
// round-to-nearest-even on store); bfloat16 by shifting (exact) and, on store, the
// round-to-nearest-even with NaN -> 0x7fff that cuda_bf16.hpp uses below sm_80.
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
struct __align__(2) __half { unsigned short x; };
struct __align__(2) __nv_bfloat16 { unsigned short x; };

__device__ __forceinline__ float __half2float(__half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x));
    return f;
}
__device__ __forceinline__ __half __float2half_rn(float f) {
    __half h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f));
    return h;
}
__device__ __forceinline__ float __bfloat162float(__nv_bfloat16 b) {
    return __uint_as_float(static_cast<unsigned int>(b.x) << 16);
}
__device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) {
    const unsigned int u = __float_as_uint(f);
    __nv_bfloat16 b;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        b.x = 0x7fffu;  // NaN stays NaN
    } else {
        b.x = static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return b;
}
#endif

template <typename T> struct Io;
template <> struct Io<float> {
    typedef float C;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};
template <> struct Io<double> {
    typedef double C;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};
template <> struct Io<__half> {
    typedef float C;
    static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
    static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <> struct Io<__nv_bfloat16> {
    typedef float C;
    static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
    static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
