// Pooling, activation and tensor-add calls. Every call taking a handle runs without the GIL;
// alpha/beta follow Note [scaling factor types] with the output descriptor's data type.
#include <array>

#include "descriptors.h"

namespace convfuse {

namespace {

using std::uintptr_t;

std::vector<int> getPoolingNdForwardOutputDim(const PoolingDescriptor& poolingDesc,
                                              const TensorDescriptor& xDesc) {
  std::array<int, CUDNN_DIM_MAX> dims{};
  const int nbDims = xDesc.nbDims();
  check(cudnnGetPoolingNdForwardOutputDim(poolingDesc.get(), xDesc.get(), nbDims, dims.data()),
        "cudnnGetPoolingNdForwardOutputDim");
  return std::vector<int>(dims.begin(), dims.begin() + nbDims);
}

void activationForward(const Handle& handle, const ActivationDescriptor& activationDesc,
                       double alpha, const TensorDescriptor& xDesc, uintptr_t x, double beta,
                       const TensorDescriptor& yDesc, uintptr_t y) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnActivationForward(handle.get(), activationDesc.get(), a.ptr(), xDesc.get(),
                                        devicePtr(x), b.ptr(), yDesc.get(), devicePtr(y));
        }),
        "cudnnActivationForward");
}

void activationBackward(const Handle& handle, const ActivationDescriptor& activationDesc,
                        double alpha, const TensorDescriptor& yDesc, uintptr_t y,
                        const TensorDescriptor& dyDesc, uintptr_t dy,
                        const TensorDescriptor& xDesc, uintptr_t x, double beta,
                        const TensorDescriptor& dxDesc, uintptr_t dx) {
  const Scaling a(alpha, dxDesc.dataType()), b(beta, dxDesc.dataType());
  check(withoutGil([&] {
          return cudnnActivationBackward(handle.get(), activationDesc.get(), a.ptr(), yDesc.get(),
                                         devicePtr(y), dyDesc.get(), devicePtr(dy), xDesc.get(),
                                         devicePtr(x), b.ptr(), dxDesc.get(), devicePtr(dx));
        }),
        "cudnnActivationBackward");
}

void addTensor(const Handle& handle, double alpha, const TensorDescriptor& aDesc, uintptr_t A,
               double beta, const TensorDescriptor& cDesc, uintptr_t C) {
  const Scaling a(alpha, cDesc.dataType()), b(beta, cDesc.dataType());
  check(withoutGil([&] {
          return cudnnAddTensor(handle.get(), a.ptr(), aDesc.get(), devicePtr(A), b.ptr(),
                                cDesc.get(), devicePtr(C));
        }),
        "cudnnAddTensor");
}

void poolingForward(const Handle& handle, const PoolingDescriptor& poolingDesc, double alpha,
                    const TensorDescriptor& xDesc, uintptr_t x, double beta,
                    const TensorDescriptor& yDesc, uintptr_t y) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnPoolingForward(handle.get(), poolingDesc.get(), a.ptr(), xDesc.get(),
                                     devicePtr(x), b.ptr(), yDesc.get(), devicePtr(y));
        }),
        "cudnnPoolingForward");
}

void poolingBackward(const Handle& handle, const PoolingDescriptor& poolingDesc, double alpha,
                     const TensorDescriptor& yDesc, uintptr_t y, const TensorDescriptor& dyDesc,
                     uintptr_t dy, const TensorDescriptor& xDesc, uintptr_t x, double beta,
                     const TensorDescriptor& dxDesc, uintptr_t dx) {
  const Scaling a(alpha, dxDesc.dataType()), b(beta, dxDesc.dataType());
  check(withoutGil([&] {
          return cudnnPoolingBackward(handle.get(), poolingDesc.get(), a.ptr(), yDesc.get(),
                                      devicePtr(y), dyDesc.get(), devicePtr(dy), xDesc.get(),
                                      devicePtr(x), b.ptr(), dxDesc.get(), devicePtr(dx));
        }),
        "cudnnPoolingBackward");
}

}  // namespace

void bindPoolingActivation(py::module_& m) {
  using py::arg;
  m.def("getPoolingNdForwardOutputDim", &getPoolingNdForwardOutputDim, arg("poolDesc"),
        arg("xDesc"));
  m.def("activationForward", &activationForward, arg("handle"), arg("activationDesc"),
        arg("alpha"), arg("xDesc"), arg("x"), arg("beta"), arg("yDesc"), arg("y"));
  m.def("activationBackward", &activationBackward, arg("handle"), arg("activationDesc"),
        arg("alpha"), arg("yDesc"), arg("y"), arg("dyDesc"), arg("dy"), arg("xDesc"), arg("x"),
        arg("beta"), arg("dxDesc"), arg("dx"));
  m.def("addTensor", &addTensor, arg("handle"), arg("alpha"), arg("aDesc"), arg("A"),
        arg("beta"), arg("cDesc"), arg("C"));
  m.def("poolingForward", &poolingForward, arg("handle"), arg("poolingDesc"), arg("alpha"),
        arg("xDesc"), arg("x"), arg("beta"), arg("yDesc"), arg("y"));
  m.def("poolingBackward", &poolingBackward, arg("handle"), arg("poolingDesc"), arg("alpha"),
        arg("yDesc"), arg("y"), arg("dyDesc"), arg("dy"), arg("xDesc"), arg("x"), arg("beta"),
        arg("dxDesc"), arg("dx"));
}

}  // namespace convfuse
