// The Python-visible descriptor and handle classes. Each owns one cuDNN object through
// Descriptor<> (common.h) and remembers what the calls need to know about it: the data
// type (Note [scaling factor types]) and, for tensors, the rank to size output arrays.
#pragma once

#include "common.h"

namespace convfuse {

// Length limits cuDNN documents for the Nd setters. Tensors and filters need 3 to
// CUDNN_DIM_MAX dims (filters reject fewer; tensors are documented "do not use 2").
// Convolution and pooling arrays hold the spatial dims only: 1 to CUDNN_DIM_MAX - 2
// (cuDNN 9.28 answers NOT_SUPPORTED to a get with room for more).
constexpr int kMinTensorDims = 3;
constexpr int kMaxSpatialDims = CUDNN_DIM_MAX - 2;

// Note [1-D convolutions in cuDNN]
// cuDNN 9.28 accepts 3-d tensor/filter descriptors and a 1-entry convolution descriptor,
// and cudnnGetConvolutionNdForwardOutputDim answers for them. Its convolution kernels are
// documented for 4-d and 5-d tensors only (PyTorch and OpenCV reshape 1-D to 2-D), so
// callers should describe a 1-D convolution as [N, C, 1, W] with a unit H (pad 0,
// stride 1, dilation 1 along H). The binding allows both; tests/test_binding_shapes.py checks
// that the two forms give the same output shape.

// Enum arguments arrive as Python ints and are static_cast to cuDNN's C enums, which
// GCC and Clang store as int; cuDNN validates the value itself (BAD_PARAM).

class Handle {
 public:
  Handle();
  ~Handle();
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  void setStream(std::uintptr_t stream);
  std::uintptr_t getStream() const;
  cudnnHandle_t get() const { return handle_; }
  std::uintptr_t address() const { return reinterpret_cast<std::uintptr_t>(handle_); }

 private:
  cudnnHandle_t handle_ = nullptr;
};

class TensorDescriptor {
 public:
  void setNd(int dataType, const std::vector<int>& dims, const std::vector<int>& strides);
  py::tuple getNd() const;
  cudnnTensorDescriptor_t get() const { return desc_.get(); }
  std::uintptr_t address() const { return desc_.address(); }
  cudnnDataType_t dataType() const { return dataType_; }
  int nbDims() const { return nbDims_; }

 private:
  Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>
      desc_{"cudnnCreateTensorDescriptor"};
  cudnnDataType_t dataType_ = CUDNN_DATA_FLOAT;
  int nbDims_ = 0;  // 0 until set: cuDNN then rejects the descriptor with BAD_PARAM
};

class FilterDescriptor {
 public:
  void setNd(int dataType, int format, const std::vector<int>& dims);
  py::tuple getNd() const;
  cudnnFilterDescriptor_t get() const { return desc_.get(); }
  std::uintptr_t address() const { return desc_.address(); }
  cudnnDataType_t dataType() const { return dataType_; }

 private:
  Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>
      desc_{"cudnnCreateFilterDescriptor"};
  cudnnDataType_t dataType_ = CUDNN_DATA_FLOAT;
};

class ConvolutionDescriptor {
 public:
  void setNd(const std::vector<int>& pads, const std::vector<int>& strides,
             const std::vector<int>& dilations, int mode, int computeType);
  py::tuple getNd() const;
  void setGroupCount(int groupCount);
  int getGroupCount() const;
  void setMathType(int mathType);
  int getMathType() const;
  cudnnConvolutionDescriptor_t get() const { return desc_.get(); }
  std::uintptr_t address() const { return desc_.address(); }

 private:
  Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
             cudnnDestroyConvolutionDescriptor>
      desc_{"cudnnCreateConvolutionDescriptor"};
};

class ActivationDescriptor {
 public:
  void set(int mode, int reluNanOpt, double coef);
  py::tuple query() const;  // Python: .get()
  cudnnActivationDescriptor_t get() const { return desc_.get(); }
  std::uintptr_t address() const { return desc_.address(); }

 private:
  Descriptor<cudnnActivationDescriptor_t, cudnnCreateActivationDescriptor,
             cudnnDestroyActivationDescriptor>
      desc_{"cudnnCreateActivationDescriptor"};
};

class PoolingDescriptor {
 public:
  void setNd(int mode, int maxpoolingNanOpt, const std::vector<int>& windowDims,
             const std::vector<int>& pads, const std::vector<int>& strides);
  py::tuple getNd() const;
  cudnnPoolingDescriptor_t get() const { return desc_.get(); }
  std::uintptr_t address() const { return desc_.address(); }

 private:
  Descriptor<cudnnPoolingDescriptor_t, cudnnCreatePoolingDescriptor,
             cudnnDestroyPoolingDescriptor>
      desc_{"cudnnCreatePoolingDescriptor"};
};

}  // namespace convfuse
