// Shared plumbing of convfuse._cudnn: status checking, the one RAII descriptor template,
// scaling factors, and GIL release. Everything cuDNN-specific beyond that lives in the
// per-area files (descriptors.cpp, convolution.cpp, pooling_activation.cpp).
#pragma once

#include <cudnn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace convfuse {

namespace py = pybind11;

// Thrown by check(); errors.cpp translates it into convfuse.errors.CudnnError. A plain C++
// exception (no Python objects) so that it may be thrown while the GIL is released.
struct CudnnStatusError : std::exception {
  CudnnStatusError(cudnnStatus_t s, const char* fn, std::string msg)
      : status(s), function(fn), message(std::move(msg)) {}
  const char* what() const noexcept override { return function; }
  cudnnStatus_t status;
  const char* function;  // always a string literal: the C function's name
  std::string message;   // cuDNN's own account of the failure (may be empty)
};

// cuDNN's most recent error message (cudnnGetLastErrorString, cuDNN 9): why a call was
// refused (a layout, an algorithm, a dtype), which the status alone does not say. Read in
// check(), on the thread that made the call, right after it returned.
inline std::string lastErrorString() {
  char buffer[1024] = {0};
  cudnnGetLastErrorString(buffer, sizeof buffer);
  buffer[sizeof buffer - 1] = '\0';
  return std::string(buffer);
}

inline void check(cudnnStatus_t status, const char* function) {
  if (status != CUDNN_STATUS_SUCCESS) throw CudnnStatusError(status, function, lastErrorString());
}

// Runs one cuDNN call with the GIL released and returns its status; check() the status
// afterwards. Used for every compute and search call, which may run for milliseconds.
template <typename F>
cudnnStatus_t withoutGil(F&& call) {
  py::gil_scoped_release release;
  return call();
}

// Device memory arrives as a Python int (CuPy's .data.ptr); 0 is NULL.
inline void* devicePtr(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// Descriptors created by this module and not yet destroyed (liveDescriptorCount()).
inline std::atomic<long long> liveDescriptors{0};

// The one owner of every cuDNN descriptor, after ATen's Descriptor<T, create, destroy>:
// created in the constructor, destroyed in the destructor, never copied or moved.
template <typename T, cudnnStatus_t (*Create)(T*), cudnnStatus_t (*Destroy)(T)>
class Descriptor {
 public:
  explicit Descriptor(const char* createName) {
    check(Create(&desc_), createName);
    liveDescriptors.fetch_add(1, std::memory_order_relaxed);
  }
  ~Descriptor() {
    // Destroying a valid descriptor cannot fail, and a destructor must not throw.
    (void)Destroy(desc_);
    liveDescriptors.fetch_sub(1, std::memory_order_relaxed);
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  T get() const { return desc_; }
  std::uintptr_t address() const { return reinterpret_cast<std::uintptr_t>(desc_); }

 private:
  T desc_ = nullptr;
};

// Note [scaling factor types]
// cuDNN reads alpha/beta through `const void*` as double when the output tensor's data
// type is CUDNN_DATA_DOUBLE and as float for every other type (half and bfloat16 data
// included). Python hands us a double; Scaling stores it in the type the call's OUTPUT
// descriptor asks for, which each descriptor wrapper records when it is set. Picking the
// wrong width would make cuDNN read garbage, so every compute call goes through here.
class Scaling {
 public:
  Scaling(double value, cudnnDataType_t outputType)
      : isDouble_(outputType == CUDNN_DATA_DOUBLE), d_(value), f_(static_cast<float>(value)) {}
  const void* ptr() const { return isDouble_ ? static_cast<const void*>(&d_) : &f_; }

 private:
  bool isDouble_;
  double d_;
  float f_;
};

// ValueError helpers, used before any cuDNN call that would read `n` array entries.
void requireSameLength(const char* where, const char* a, std::size_t na, const char* b,
                       std::size_t nb);
void requireLengthIn(const char* where, const char* what, std::size_t n, std::size_t lo,
                     std::size_t hi);

void registerErrors(py::module_& m);
void bindConstants(py::module_& m);
void bindDescriptors(py::module_& m);
void bindConvolution(py::module_& m);
void bindConvolutionAlgorithms(py::module_& m);
void bindPoolingActivation(py::module_& m);
void bindBatchNorm(py::module_& m);

}  // namespace convfuse
