// Shared by convfuse's kernel sources: loading and storing each storage dtype through
// its compute type (float for float/__half/__nv_bfloat16, double for double), so a kernel
// template written once serves all four dtypes and rounds only when it stores.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

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
