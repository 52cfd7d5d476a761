// Turns CudnnStatusError into convfuse.errors.CudnnError(status, function, status_name,
// context="", detail=cuDNN's own message),
// and holds the ValueError helpers that guard array lengths.
#include "common.h"

namespace convfuse {

namespace {

// Imported once and kept for the life of the process. gil_safe_call_once_and_store never
// releases its object, so the class outlives any module teardown order at exit.
py::object& cudnnErrorClass() {
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
  return storage
      .call_once_and_store_result(
          [] { return py::module_::import("convfuse.errors").attr("CudnnError"); })
      .get_stored();
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const CudnnStatusError& e) {
    try {
      // cuDNN's message is bytes of its own: undecodable ones are replaced, so a message
      // can never turn the CudnnError into a UnicodeDecodeError
      py::object message = py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(
          e.message.data(), static_cast<Py_ssize_t>(e.message.size()), "replace"));
      if (!message) throw py::error_already_set();
      py::object exc = cudnnErrorClass()(static_cast<int>(e.status), e.function,
                                         cudnnGetErrorString(e.status), "", message);
      // the instance's own class: CudnnError picks a subclass for some statuses
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (py::error_already_set& inner) {
      inner.restore();  // e.g. convfuse.errors failed to import: report that instead
    }
  }
}

}  // namespace

void requireSameLength(const char* where, const char* a, std::size_t na, const char* b,
                       std::size_t nb) {
  if (na != nb) {
    throw py::value_error(std::string(where) + ": " + a + " and " + b +
                          " must have the same length, got " + std::to_string(na) + " and " +
                          std::to_string(nb));
  }
}

void requireLengthIn(const char* where, const char* what, std::size_t n, std::size_t lo,
                     std::size_t hi) {
  if (n < lo || n > hi) {
    throw py::value_error(std::string(where) + ": " + what + " must have " + std::to_string(lo) +
                          " to " + std::to_string(hi) + " entries, got " + std::to_string(n));
  }
}

void registerErrors(py::module_& m) {
  cudnnErrorClass();  // fail at import, not at the first error, if the class is missing
  py::register_local_exception_translator(&translate);
  m.def(
      "getErrorString",
      [](int status) {
        return std::string(cudnnGetErrorString(static_cast<cudnnStatus_t>(status)));
      },
      py::arg("status"));
}

}  // namespace convfuse
