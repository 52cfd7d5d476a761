// Choosing convolution algorithms: AlgoPerf, the *_v7 heuristics, the Find*Ex autotuners,
// the algorithm max counts and the workspace queries. All need a handle (so a GPU).
#include <algorithm>

#include "descriptors.h"

namespace convfuse {

namespace {

using std::size_t;
using std::uintptr_t;

// One entry of cudnnConvolution{Fwd,BwdData,BwdFilter}AlgoPerf_t, enums as ints.
struct AlgoPerf {
  int algo;
  int status;
  float time;
  size_t memory;
  int determinism;
  int mathType;

  template <typename Perf>
  static AlgoPerf from(const Perf& p) {
    return {static_cast<int>(p.algo), static_cast<int>(p.status), p.time, p.memory,
            static_cast<int>(p.determinism), static_cast<int>(p.mathType)};
  }
};

// Runs one search that fills `requested` perf structs and reports how many it filled.
template <typename Perf, typename Search>
std::vector<AlgoPerf> search(int requested, const char* function, Search&& call) {
  if (requested < 1) {
    throw py::value_error(std::string(function) + ": requestedAlgoCount must be >= 1, got " +
                          std::to_string(requested));
  }
  std::vector<Perf> perfs(static_cast<size_t>(requested));
  int returned = 0;
  check(withoutGil([&] { return call(requested, &returned, perfs.data()); }), function);
  std::vector<AlgoPerf> out;
  const int valid = std::clamp(returned, 0, requested);
  for (int i = 0; i < valid; ++i) out.push_back(AlgoPerf::from(perfs[i]));
  return out;
}

// The max-count and workspace queries: one output scalar.
template <typename T, typename Query>
T query(const char* function, Query&& call) {
  T value{};
  check(withoutGil([&] { return call(&value); }), function);
  return value;
}

using Fwd = cudnnConvolutionFwdAlgoPerf_t;
using BwdData = cudnnConvolutionBwdDataAlgoPerf_t;
using BwdFilter = cudnnConvolutionBwdFilterAlgoPerf_t;
using TD = const TensorDescriptor&;
using FD = const FilterDescriptor&;
using CD = const ConvolutionDescriptor&;

std::vector<AlgoPerf> getConvolutionForwardAlgorithm_v7(const Handle& h, TD xDesc, FD wDesc,
                                                        CD convDesc, TD yDesc, int n) {
  return search<Fwd>(n, "cudnnGetConvolutionForwardAlgorithm_v7", [&](int c, int* r, Fwd* p) {
    return cudnnGetConvolutionForwardAlgorithm_v7(h.get(), xDesc.get(), wDesc.get(),
                                                  convDesc.get(), yDesc.get(), c, r, p);
  });
}

std::vector<AlgoPerf> getConvolutionBackwardDataAlgorithm_v7(const Handle& h, FD wDesc,
                                                             TD dyDesc, CD convDesc, TD dxDesc,
                                                             int n) {
  const char* fn = "cudnnGetConvolutionBackwardDataAlgorithm_v7";
  return search<BwdData>(n, fn, [&](int c, int* r, BwdData* p) {
    return cudnnGetConvolutionBackwardDataAlgorithm_v7(h.get(), wDesc.get(), dyDesc.get(),
                                                       convDesc.get(), dxDesc.get(), c, r, p);
  });
}

std::vector<AlgoPerf> getConvolutionBackwardFilterAlgorithm_v7(const Handle& h, TD xDesc,
                                                               TD dyDesc, CD convDesc,
                                                               FD dwDesc, int n) {
  const char* fn = "cudnnGetConvolutionBackwardFilterAlgorithm_v7";
  return search<BwdFilter>(n, fn, [&](int c, int* r, BwdFilter* p) {
    return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h.get(), xDesc.get(), dyDesc.get(),
                                                         convDesc.get(), dwDesc.get(), c, r, p);
  });
}

std::vector<AlgoPerf> findConvolutionForwardAlgorithmEx(const Handle& h, TD xDesc, uintptr_t x,
                                                        FD wDesc, uintptr_t w, CD convDesc,
                                                        TD yDesc, uintptr_t y, int n,
                                                        uintptr_t workSpace,
                                                        size_t workSpaceSizeInBytes) {
  return search<Fwd>(n, "cudnnFindConvolutionForwardAlgorithmEx", [&](int c, int* r, Fwd* p) {
    return cudnnFindConvolutionForwardAlgorithmEx(
        h.get(), xDesc.get(), devicePtr(x), wDesc.get(), devicePtr(w), convDesc.get(),
        yDesc.get(), devicePtr(y), c, r, p, devicePtr(workSpace), workSpaceSizeInBytes);
  });
}

std::vector<AlgoPerf> findConvolutionBackwardDataAlgorithmEx(
    const Handle& h, FD wDesc, uintptr_t w, TD dyDesc, uintptr_t dy, CD convDesc, TD dxDesc,
    uintptr_t dx, int n, uintptr_t workSpace, size_t workSpaceSizeInBytes) {
  const char* fn = "cudnnFindConvolutionBackwardDataAlgorithmEx";
  return search<BwdData>(n, fn, [&](int c, int* r, BwdData* p) {
    return cudnnFindConvolutionBackwardDataAlgorithmEx(
        h.get(), wDesc.get(), devicePtr(w), dyDesc.get(), devicePtr(dy), convDesc.get(),
        dxDesc.get(), devicePtr(dx), c, r, p, devicePtr(workSpace), workSpaceSizeInBytes);
  });
}

std::vector<AlgoPerf> findConvolutionBackwardFilterAlgorithmEx(
    const Handle& h, TD xDesc, uintptr_t x, TD dyDesc, uintptr_t dy, CD convDesc, FD dwDesc,
    uintptr_t dw, int n, uintptr_t workSpace, size_t workSpaceSizeInBytes) {
  const char* fn = "cudnnFindConvolutionBackwardFilterAlgorithmEx";
  return search<BwdFilter>(n, fn, [&](int c, int* r, BwdFilter* p) {
    return cudnnFindConvolutionBackwardFilterAlgorithmEx(
        h.get(), xDesc.get(), devicePtr(x), dyDesc.get(), devicePtr(dy), convDesc.get(),
        dwDesc.get(), devicePtr(dw), c, r, p, devicePtr(workSpace), workSpaceSizeInBytes);
  });
}

int getConvolutionForwardAlgorithmMaxCount(const Handle& h) {
  return query<int>("cudnnGetConvolutionForwardAlgorithmMaxCount", [&](int* n) {
    return cudnnGetConvolutionForwardAlgorithmMaxCount(h.get(), n);
  });
}

int getConvolutionBackwardDataAlgorithmMaxCount(const Handle& h) {
  return query<int>("cudnnGetConvolutionBackwardDataAlgorithmMaxCount", [&](int* n) {
    return cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h.get(), n);
  });
}

int getConvolutionBackwardFilterAlgorithmMaxCount(const Handle& h) {
  return query<int>("cudnnGetConvolutionBackwardFilterAlgorithmMaxCount", [&](int* n) {
    return cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h.get(), n);
  });
}

size_t getConvolutionForwardWorkspaceSize(const Handle& h, TD xDesc, FD wDesc, CD convDesc,
                                          TD yDesc, int algo) {
  return query<size_t>("cudnnGetConvolutionForwardWorkspaceSize", [&](size_t* s) {
    return cudnnGetConvolutionForwardWorkspaceSize(h.get(), xDesc.get(), wDesc.get(),
                                                   convDesc.get(), yDesc.get(),
                                                   static_cast<cudnnConvolutionFwdAlgo_t>(algo), s);
  });
}

size_t getConvolutionBackwardDataWorkspaceSize(const Handle& h, FD wDesc, TD dyDesc,
                                               CD convDesc, TD dxDesc, int algo) {
  return query<size_t>("cudnnGetConvolutionBackwardDataWorkspaceSize", [&](size_t* s) {
    return cudnnGetConvolutionBackwardDataWorkspaceSize(
        h.get(), wDesc.get(), dyDesc.get(), convDesc.get(), dxDesc.get(),
        static_cast<cudnnConvolutionBwdDataAlgo_t>(algo), s);
  });
}

size_t getConvolutionBackwardFilterWorkspaceSize(const Handle& h, TD xDesc, TD dyDesc,
                                                 CD convDesc, FD dwDesc, int algo) {
  return query<size_t>("cudnnGetConvolutionBackwardFilterWorkspaceSize", [&](size_t* s) {
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(
        h.get(), xDesc.get(), dyDesc.get(), convDesc.get(), dwDesc.get(),
        static_cast<cudnnConvolutionBwdFilterAlgo_t>(algo), s);
  });
}

void bindSearches(py::module_& m) {
  using py::arg;
  m.def("getConvolutionForwardAlgorithm_v7", &getConvolutionForwardAlgorithm_v7, arg("handle"),
        arg("xDesc"), arg("wDesc"), arg("convDesc"), arg("yDesc"), arg("requestedAlgoCount"));
  m.def("getConvolutionBackwardDataAlgorithm_v7", &getConvolutionBackwardDataAlgorithm_v7,
        arg("handle"), arg("wDesc"), arg("dyDesc"), arg("convDesc"), arg("dxDesc"),
        arg("requestedAlgoCount"));
  m.def("getConvolutionBackwardFilterAlgorithm_v7", &getConvolutionBackwardFilterAlgorithm_v7,
        arg("handle"), arg("xDesc"), arg("dyDesc"), arg("convDesc"), arg("dwDesc"),
        arg("requestedAlgoCount"));
  m.def("findConvolutionForwardAlgorithmEx", &findConvolutionForwardAlgorithmEx, arg("handle"),
        arg("xDesc"), arg("x"), arg("wDesc"), arg("w"), arg("convDesc"), arg("yDesc"), arg("y"),
        arg("requestedAlgoCount"), arg("workSpace"), arg("workSpaceSizeInBytes"));
  m.def("findConvolutionBackwardDataAlgorithmEx", &findConvolutionBackwardDataAlgorithmEx,
        arg("handle"), arg("wDesc"), arg("w"), arg("dyDesc"), arg("dy"), arg("convDesc"),
        arg("dxDesc"), arg("dx"), arg("requestedAlgoCount"), arg("workSpace"),
        arg("workSpaceSizeInBytes"));
  m.def("findConvolutionBackwardFilterAlgorithmEx", &findConvolutionBackwardFilterAlgorithmEx,
        arg("handle"), arg("xDesc"), arg("x"), arg("dyDesc"), arg("dy"), arg("convDesc"),
        arg("dwDesc"), arg("dw"), arg("requestedAlgoCount"), arg("workSpace"),
        arg("workSpaceSizeInBytes"));
}

void bindQueries(py::module_& m) {
  using py::arg;
  m.def("getConvolutionForwardAlgorithmMaxCount", &getConvolutionForwardAlgorithmMaxCount,
        arg("handle"));
  m.def("getConvolutionBackwardDataAlgorithmMaxCount",
        &getConvolutionBackwardDataAlgorithmMaxCount, arg("handle"));
  m.def("getConvolutionBackwardFilterAlgorithmMaxCount",
        &getConvolutionBackwardFilterAlgorithmMaxCount, arg("handle"));
  m.def("getConvolutionForwardWorkspaceSize", &getConvolutionForwardWorkspaceSize,
        arg("handle"), arg("xDesc"), arg("wDesc"), arg("convDesc"), arg("yDesc"), arg("algo"));
  m.def("getConvolutionBackwardDataWorkspaceSize", &getConvolutionBackwardDataWorkspaceSize,
        arg("handle"), arg("wDesc"), arg("dyDesc"), arg("convDesc"), arg("dxDesc"), arg("algo"));
  m.def("getConvolutionBackwardFilterWorkspaceSize", &getConvolutionBackwardFilterWorkspaceSize,
        arg("handle"), arg("xDesc"), arg("dyDesc"), arg("convDesc"), arg("dwDesc"), arg("algo"));
}

}  // namespace

void bindConvolutionAlgorithms(py::module_& m) {
  py::class_<AlgoPerf>(m, "AlgoPerf")
      // Constructible from Python so that algorithm-choice logic can be tested on the CPU.
      .def(py::init([](int algo, int status, float time, size_t memory, int determinism,
                       int mathType) {
             return AlgoPerf{algo, status, time, memory, determinism, mathType};
           }),
           py::arg("algo"), py::arg("status"), py::arg("time"), py::arg("memory"),
           py::arg("determinism"), py::arg("mathType"))
      .def_readonly("algo", &AlgoPerf::algo)
      .def_readonly("status", &AlgoPerf::status)
      .def_readonly("time", &AlgoPerf::time)
      .def_readonly("memory", &AlgoPerf::memory)
      .def_readonly("determinism", &AlgoPerf::determinism)
      .def_readonly("mathType", &AlgoPerf::mathType)
      .def("__repr__", [](const AlgoPerf& p) {
        return "AlgoPerf(algo=" + std::to_string(p.algo) + ", status=" +
               std::to_string(p.status) + ", time=" + std::to_string(p.time) +
               ", memory=" + std::to_string(p.memory) + ", determinism=" +
               std::to_string(p.determinism) + ", mathType=" + std::to_string(p.mathType) + ")";
      });
  bindSearches(m);
  bindQueries(m);
}

}  // namespace convfuse
