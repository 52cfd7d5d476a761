// convfuse._cudnn: a thin pybind11 mirror of cuDNN's C API (docs/DESIGN.md, "Binding").
// One Python callable per C function, named like CuPy's bindings (cudnnFooBar -> fooBar),
// arguments in C order, device memory as int addresses. No caches, defaults or heuristics.
#include "descriptors.h"

namespace convfuse {

Handle::Handle() {
  // cudnnCreate loads kernels and may take a while; nothing here touches Python.
  check(withoutGil([this] { return cudnnCreate(&handle_); }), "cudnnCreate");
}

namespace {

// At interpreter exit the handles (kept for the process by convfuse/ops/cudnn/handle.py)
// die with their module, after CuPy's and torch's exit hooks may have torn the CUDA
// context down; cudnnDestroy then synchronises a dead context, holding the GIL. PyTorch
// never destroys its cuDNN handles for this reason (aten/src/ATen/cudnn/Handle.cpp); the
// process's exit frees them.
bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

}  // namespace

Handle::~Handle() {
  // a destructor must not throw
  if (handle_ != nullptr && !finalizing()) (void)cudnnDestroy(handle_);
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
