// Convolution calls: output shape, the fused conv + bias + activation forward, the plain
// forward, and the three gradients. Every call taking a handle runs without the GIL.
#include <array>

#include "descriptors.h"

namespace convfuse {

namespace {

using std::size_t;
using std::uintptr_t;

std::vector<int> getConvolutionNdForwardOutputDim(const ConvolutionDescriptor& convDesc,
                                                  const TensorDescriptor& xDesc,
                                                  const FilterDescriptor& wDesc) {
  // The output has the input's rank; the buffer has room for any rank cuDNN allows.
  std::array<int, CUDNN_DIM_MAX> dims{};
  const int nbDims = xDesc.nbDims();
  check(cudnnGetConvolutionNdForwardOutputDim(convDesc.get(), xDesc.get(), wDesc.get(), nbDims,
                                              dims.data()),
        "cudnnGetConvolutionNdForwardOutputDim");
  return std::vector<int>(dims.begin(), dims.begin() + nbDims);
}

void convolutionBiasActivationForward(
    const Handle& handle, double alpha1, const TensorDescriptor& xDesc, uintptr_t x,
    const FilterDescriptor& wDesc, uintptr_t w, const ConvolutionDescriptor& convDesc, int algo,
    uintptr_t workSpace, size_t workSpaceSizeInBytes, double alpha2,
    const TensorDescriptor& zDesc, uintptr_t z, const TensorDescriptor& biasDesc, uintptr_t bias,
    const ActivationDescriptor& activationDesc, const TensorDescriptor& yDesc, uintptr_t y) {
  const Scaling a1(alpha1, yDesc.dataType()), a2(alpha2, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnConvolutionBiasActivationForward(
              handle.get(), a1.ptr(), xDesc.get(), devicePtr(x), wDesc.get(), devicePtr(w),
              convDesc.get(), static_cast<cudnnConvolutionFwdAlgo_t>(algo), devicePtr(workSpace),
              workSpaceSizeInBytes, a2.ptr(), zDesc.get(), devicePtr(z), biasDesc.get(),
              devicePtr(bias), activationDesc.get(), yDesc.get(), devicePtr(y));
        }),
        "cudnnConvolutionBiasActivationForward");
}

void convolutionForward(const Handle& handle, double alpha, const TensorDescriptor& xDesc,
                        uintptr_t x, const FilterDescriptor& wDesc, uintptr_t w,
                        const ConvolutionDescriptor& convDesc, int algo, uintptr_t workSpace,
                        size_t workSpaceSizeInBytes, double beta, const TensorDescriptor& yDesc,
                        uintptr_t y) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnConvolutionForward(
              handle.get(), a.ptr(), xDesc.get(), devicePtr(x), wDesc.get(), devicePtr(w),
              convDesc.get(), static_cast<cudnnConvolutionFwdAlgo_t>(algo), devicePtr(workSpace),
              workSpaceSizeInBytes, b.ptr(), yDesc.get(), devicePtr(y));
        }),
        "cudnnConvolutionForward");
}

void convolutionBackwardBias(const Handle& handle, double alpha, const TensorDescriptor& dyDesc,
                             uintptr_t dy, double beta, const TensorDescriptor& dbDesc,
                             uintptr_t db) {
  const Scaling a(alpha, dbDesc.dataType()), b(beta, dbDesc.dataType());
  check(withoutGil([&] {
          return cudnnConvolutionBackwardBias(handle.get(), a.ptr(), dyDesc.get(),
                                              devicePtr(dy), b.ptr(), dbDesc.get(),
                                              devicePtr(db));
        }),
        "cudnnConvolutionBackwardBias");
}

void convolutionBackwardData(const Handle& handle, double alpha, const FilterDescriptor& wDesc,
                             uintptr_t w, const TensorDescriptor& dyDesc, uintptr_t dy,
                             const ConvolutionDescriptor& convDesc, int algo, uintptr_t workSpace,
                             size_t workSpaceSizeInBytes, double beta,
                             const TensorDescriptor& dxDesc, uintptr_t dx) {
  const Scaling a(alpha, dxDesc.dataType()), b(beta, dxDesc.dataType());
  check(withoutGil([&] {
          return cudnnConvolutionBackwardData(
              handle.get(), a.ptr(), wDesc.get(), devicePtr(w), dyDesc.get(), devicePtr(dy),
              convDesc.get(), static_cast<cudnnConvolutionBwdDataAlgo_t>(algo),
              devicePtr(workSpace), workSpaceSizeInBytes, b.ptr(), dxDesc.get(), devicePtr(dx));
        }),
        "cudnnConvolutionBackwardData");
}

void convolutionBackwardFilter(const Handle& handle, double alpha, const TensorDescriptor& xDesc,
                               uintptr_t x, const TensorDescriptor& dyDesc, uintptr_t dy,
                               const ConvolutionDescriptor& convDesc, int algo,
                               uintptr_t workSpace, size_t workSpaceSizeInBytes, double beta,
                               const FilterDescriptor& dwDesc, uintptr_t dw) {
  const Scaling a(alpha, dwDesc.dataType()), b(beta, dwDesc.dataType());
  check(withoutGil([&] {
          return cudnnConvolutionBackwardFilter(
              handle.get(), a.ptr(), xDesc.get(), devicePtr(x), dyDesc.get(), devicePtr(dy),
              convDesc.get(), static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo),
              devicePtr(workSpace), workSpaceSizeInBytes, b.ptr(), dwDesc.get(), devicePtr(dw));
        }),
        "cudnnConvolutionBackwardFilter");
}

}  // namespace

void bindConvolution(py::module_& m) {
  using py::arg;
  m.def("getConvolutionNdForwardOutputDim", &getConvolutionNdForwardOutputDim, arg("convDesc"),
        arg("xDesc"), arg("wDesc"));
  m.def("convolutionBiasActivationForward", &convolutionBiasActivationForward, arg("handle"),
        arg("alpha1"), arg("xDesc"), arg("x"), arg("wDesc"), arg("w"), arg("convDesc"),
        arg("algo"), arg("workSpace"), arg("workSpaceSizeInBytes"), arg("alpha2"), arg("zDesc"),
        arg("z"), arg("biasDesc"), arg("bias"), arg("activationDesc"), arg("yDesc"), arg("y"));
  m.def("convolutionForward", &convolutionForward, arg("handle"), arg("alpha"), arg("xDesc"),
        arg("x"), arg("wDesc"), arg("w"), arg("convDesc"), arg("algo"), arg("workSpace"),
        arg("workSpaceSizeInBytes"), arg("beta"), arg("yDesc"), arg("y"));
  m.def("convolutionBackwardBias", &convolutionBackwardBias, arg("handle"), arg("alpha"),
        arg("dyDesc"), arg("dy"), arg("beta"), arg("dbDesc"), arg("db"));
  m.def("convolutionBackwardData", &convolutionBackwardData, arg("handle"), arg("alpha"),
        arg("wDesc"), arg("w"), arg("dyDesc"), arg("dy"), arg("convDesc"), arg("algo"),
        arg("workSpace"), arg("workSpaceSizeInBytes"), arg("beta"), arg("dxDesc"), arg("dx"));
  m.def("convolutionBackwardFilter", &convolutionBackwardFilter, arg("handle"), arg("alpha"),
        arg("xDesc"), arg("x"), arg("dyDesc"), arg("dy"), arg("convDesc"), arg("algo"),
        arg("workSpace"), arg("workSpaceSizeInBytes"), arg("beta"), arg("dwDesc"), arg("dw"));
}

}  // namespace convfuse
