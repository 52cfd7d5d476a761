// Tensor, filter, convolution, activation and pooling descriptors: Nd setters and getters
// that mirror cudnnSet*/cudnnGet*, with list lengths checked before cuDNN reads them.
#include "descriptors.h"

#include <algorithm>
#include <array>

namespace convfuse {

namespace {

int count(const std::vector<int>& v) { return static_cast<int>(v.size()); }

// cuDNN reports the rank it holds, which may exceed the room we asked it to fill.
std::vector<int> firstN(const int* values, int n, int room) {
  return std::vector<int>(values, values + std::clamp(n, 0, room));
}

}  // namespace

void TensorDescriptor::setNd(int dataType, const std::vector<int>& dims,
                             const std::vector<int>& strides) {
  const char* where = "TensorDescriptor.setNd";
  requireSameLength(where, "dims", dims.size(), "strides", strides.size());
  requireLengthIn(where, "dims", dims.size(), kMinTensorDims, CUDNN_DIM_MAX);
  const auto type = static_cast<cudnnDataType_t>(dataType);
  check(cudnnSetTensorNdDescriptor(get(), type, count(dims), dims.data(), strides.data()),
        "cudnnSetTensorNdDescriptor");
  dataType_ = type;
  nbDims_ = count(dims);
}

py::tuple TensorDescriptor::getNd() const {
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  int nbDims = 0;
  std::array<int, CUDNN_DIM_MAX> dims{}, strides{};
  check(cudnnGetTensorNdDescriptor(get(), CUDNN_DIM_MAX, &type, &nbDims, dims.data(),
                                   strides.data()),
        "cudnnGetTensorNdDescriptor");
  return py::make_tuple(static_cast<int>(type), firstN(dims.data(), nbDims, CUDNN_DIM_MAX),
                        firstN(strides.data(), nbDims, CUDNN_DIM_MAX));
}

void FilterDescriptor::setNd(int dataType, int format, const std::vector<int>& dims) {
  requireLengthIn("FilterDescriptor.setNd", "dims", dims.size(), kMinTensorDims, CUDNN_DIM_MAX);
  const auto type = static_cast<cudnnDataType_t>(dataType);
  check(cudnnSetFilterNdDescriptor(get(), type, static_cast<cudnnTensorFormat_t>(format),
                                   count(dims), dims.data()),
        "cudnnSetFilterNdDescriptor");
  dataType_ = type;
}

py::tuple FilterDescriptor::getNd() const {
  cudnnDataType_t type = CUDNN_DATA_FLOAT;
  cudnnTensorFormat_t format = CUDNN_TENSOR_NCHW;
  int nbDims = 0;
  std::array<int, CUDNN_DIM_MAX> dims{};
  check(cudnnGetFilterNdDescriptor(get(), CUDNN_DIM_MAX, &type, &format, &nbDims, dims.data()),
        "cudnnGetFilterNdDescriptor");
  return py::make_tuple(static_cast<int>(type), static_cast<int>(format),
                        firstN(dims.data(), nbDims, CUDNN_DIM_MAX));
}

void ConvolutionDescriptor::setNd(const std::vector<int>& pads, const std::vector<int>& strides,
                                  const std::vector<int>& dilations, int mode, int computeType) {
  const char* where = "ConvolutionDescriptor.setNd";
  requireSameLength(where, "pads", pads.size(), "strides", strides.size());
  requireSameLength(where, "pads", pads.size(), "dilations", dilations.size());
  requireLengthIn(where, "pads", pads.size(), 1, kMaxSpatialDims);
  check(cudnnSetConvolutionNdDescriptor(get(), count(pads), pads.data(), strides.data(),
                                        dilations.data(),
                                        static_cast<cudnnConvolutionMode_t>(mode),
                                        static_cast<cudnnDataType_t>(computeType)),
        "cudnnSetConvolutionNdDescriptor");
}

py::tuple ConvolutionDescriptor::getNd() const {
  int length = 0;
  std::array<int, kMaxSpatialDims> pads{}, strides{}, dilations{};
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  cudnnDataType_t computeType = CUDNN_DATA_FLOAT;
  check(cudnnGetConvolutionNdDescriptor(get(), kMaxSpatialDims, &length, pads.data(),
                                        strides.data(), dilations.data(), &mode, &computeType),
        "cudnnGetConvolutionNdDescriptor");
  return py::make_tuple(firstN(pads.data(), length, kMaxSpatialDims),
                        firstN(strides.data(), length, kMaxSpatialDims),
                        firstN(dilations.data(), length, kMaxSpatialDims),
                        static_cast<int>(mode), static_cast<int>(computeType));
}

void ConvolutionDescriptor::setGroupCount(int groupCount) {
  check(cudnnSetConvolutionGroupCount(get(), groupCount), "cudnnSetConvolutionGroupCount");
}

int ConvolutionDescriptor::getGroupCount() const {
  int groupCount = 0;
  check(cudnnGetConvolutionGroupCount(get(), &groupCount), "cudnnGetConvolutionGroupCount");
  return groupCount;
}

void ConvolutionDescriptor::setMathType(int mathType) {
  check(cudnnSetConvolutionMathType(get(), static_cast<cudnnMathType_t>(mathType)),
        "cudnnSetConvolutionMathType");
}

int ConvolutionDescriptor::getMathType() const {
  cudnnMathType_t mathType = CUDNN_DEFAULT_MATH;
  check(cudnnGetConvolutionMathType(get(), &mathType), "cudnnGetConvolutionMathType");
  return static_cast<int>(mathType);
}

void ActivationDescriptor::set(int mode, int reluNanOpt, double coef) {
  check(cudnnSetActivationDescriptor(get(), static_cast<cudnnActivationMode_t>(mode),
                                     static_cast<cudnnNanPropagation_t>(reluNanOpt), coef),
        "cudnnSetActivationDescriptor");
}

py::tuple ActivationDescriptor::query() const {
  cudnnActivationMode_t mode = CUDNN_ACTIVATION_IDENTITY;
  cudnnNanPropagation_t nanOpt = CUDNN_NOT_PROPAGATE_NAN;
  double coef = 0.0;
  check(cudnnGetActivationDescriptor(get(), &mode, &nanOpt, &coef),
        "cudnnGetActivationDescriptor");
  return py::make_tuple(static_cast<int>(mode), static_cast<int>(nanOpt), coef);
}

void PoolingDescriptor::setNd(int mode, int maxpoolingNanOpt, const std::vector<int>& windowDims,
                              const std::vector<int>& pads, const std::vector<int>& strides) {
  const char* where = "PoolingDescriptor.setNd";
  requireSameLength(where, "windowDims", windowDims.size(), "pads", pads.size());
  requireSameLength(where, "windowDims", windowDims.size(), "strides", strides.size());
  requireLengthIn(where, "windowDims", windowDims.size(), 1, kMaxSpatialDims);
  check(cudnnSetPoolingNdDescriptor(get(), static_cast<cudnnPoolingMode_t>(mode),
                                    static_cast<cudnnNanPropagation_t>(maxpoolingNanOpt),
                                    count(windowDims), windowDims.data(), pads.data(),
                                    strides.data()),
        "cudnnSetPoolingNdDescriptor");
}

py::tuple PoolingDescriptor::getNd() const {
  cudnnPoolingMode_t mode = CUDNN_POOLING_MAX;
  cudnnNanPropagation_t nanOpt = CUDNN_NOT_PROPAGATE_NAN;
  int nbDims = 0;
  std::array<int, kMaxSpatialDims> window{}, pads{}, strides{};
  check(cudnnGetPoolingNdDescriptor(get(), kMaxSpatialDims, &mode, &nanOpt, &nbDims,
                                    window.data(), pads.data(), strides.data()),
        "cudnnGetPoolingNdDescriptor");
  return py::make_tuple(static_cast<int>(mode), static_cast<int>(nanOpt),
                        firstN(window.data(), nbDims, kMaxSpatialDims),
                        firstN(pads.data(), nbDims, kMaxSpatialDims),
                        firstN(strides.data(), nbDims, kMaxSpatialDims));
}

void bindDescriptors(py::module_& m) {
  py::class_<TensorDescriptor>(m, "TensorDescriptor")
      .def(py::init<>())
      .def("setNd", &TensorDescriptor::setNd, py::arg("dataType"), py::arg("dims"),
           py::arg("strides"))
      .def("getNd", &TensorDescriptor::getNd)
      .def_property_readonly("ptr", &TensorDescriptor::address);

  py::class_<FilterDescriptor>(m, "FilterDescriptor")
      .def(py::init<>())
      .def("setNd", &FilterDescriptor::setNd, py::arg("dataType"), py::arg("format"),
           py::arg("dims"))
      .def("getNd", &FilterDescriptor::getNd)
      .def_property_readonly("ptr", &FilterDescriptor::address);

  py::class_<ConvolutionDescriptor>(m, "ConvolutionDescriptor")
      .def(py::init<>())
      .def("setNd", &ConvolutionDescriptor::setNd, py::arg("pads"), py::arg("strides"),
           py::arg("dilations"), py::arg("mode"), py::arg("computeType"))
      .def("getNd", &ConvolutionDescriptor::getNd)
      .def("setGroupCount", &ConvolutionDescriptor::setGroupCount, py::arg("groupCount"))
      .def("getGroupCount", &ConvolutionDescriptor::getGroupCount)
      .def("setMathType", &ConvolutionDescriptor::setMathType, py::arg("mathType"))
      .def("getMathType", &ConvolutionDescriptor::getMathType)
      .def_property_readonly("ptr", &ConvolutionDescriptor::address);

  py::class_<ActivationDescriptor>(m, "ActivationDescriptor")
      .def(py::init<>())
      .def("set", &ActivationDescriptor::set, py::arg("mode"), py::arg("reluNanOpt"),
           py::arg("coef"))
      .def("get", &ActivationDescriptor::query)
      .def_property_readonly("ptr", &ActivationDescriptor::address);

  py::class_<PoolingDescriptor>(m, "PoolingDescriptor")
      .def(py::init<>())
      .def("setNd", &PoolingDescriptor::setNd, py::arg("mode"), py::arg("maxpoolingNanOpt"),
           py::arg("windowDims"), py::arg("pads"), py::arg("strides"))
      .def("getNd", &PoolingDescriptor::getNd)
      .def_property_readonly("ptr", &PoolingDescriptor::address);
}

}  // namespace convfuse
