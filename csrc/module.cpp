// convfuse._cudnn: a thin pybind11 mirror of cuDNN's C API (docs/DESIGN.md, "Binding").
// One Python callable per C function, named like CuPy's bindings (cudnnFooBar -> fooBar),
// arguments in C order, device memory as int addresses. No caches, defaults or heuristics.
#include "descriptors.h"

namespace convfuse {

Handle::Handle() {
  // cudnnCreate loads kernels and may take a while; nothing here touches Python.
  check(withoutGil([this] { return cudnnCreate(&handle_); }), "cudnnCreate");
}

Handle::~Handle() {
  if (handle_ != nullptr) (void)cudnnDestroy(handle_);  // a destructor must not throw
}

void Handle::setStream(std::uintptr_t stream) {
  check(cudnnSetStream(handle_, reinterpret_cast<cudaStream_t>(stream)), "cudnnSetStream");
}

std::uintptr_t Handle::getStream() const {
  cudaStream_t stream = nullptr;
  check(cudnnGetStream(handle_, &stream), "cudnnGetStream");
  return reinterpret_cast<std::uintptr_t>(stream);
}

namespace {

void bindLibrary(py::module_& m) {
  m.def("getVersion", [] { return static_cast<long long>(cudnnGetVersion()); });
  m.def("getCudartVersion", [] { return static_cast<long long>(cudnnGetCudartVersion()); });
  m.def("liveDescriptorCount", [] { return liveDescriptors.load(std::memory_order_relaxed); },
        "Descriptors this module created and has not yet destroyed (a leak diagnostic).");

  // Per-(device, thread) handle caching is policy and lives in Python.
  py::class_<Handle>(m, "Handle")
      .def(py::init<>())
      .def("setStream", &Handle::setStream, py::arg("stream"))
      .def("getStream", &Handle::getStream)
      .def_property_readonly("ptr", &Handle::address);
}

}  // namespace

}  // namespace convfuse

PYBIND11_MODULE(_cudnn, m) {
  m.doc() = "Thin pybind11 binding of cuDNN's legacy C API for convfuse (see docs/DESIGN.md).";
  convfuse::registerErrors(m);
  convfuse::bindConstants(m);
  convfuse::bindLibrary(m);
  convfuse::bindDescriptors(m);
  convfuse::bindConvolution(m);
  convfuse::bindConvolutionAlgorithms(m);
  convfuse::bindPoolingActivation(m);
  convfuse::bindBatchNorm(m);
}
