// Batch normalization: the derived-descriptor helper, the size queries, and the training,
// inference and backward calls (plain and Ex). Every call taking a handle runs without the
// GIL; alpha/beta follow Note [scaling factor types] with the output descriptor's data type
// (y for forward, dx for the data gradient, the derived BN descriptor for the parameter
// gradients). Pointers arguments cuDNN documents as optional accept 0 (NULL).
#include "descriptors.h"

namespace convfuse {

namespace {

using std::uintptr_t;

// cudnnDeriveBNTensorDescriptor fills a descriptor behind the wrapper's back. Re-setting it
// with what cuDNN derived (through the public setter) makes the wrapper record the data type
// and rank like any other set, so Note [scaling factor types] holds for it too.
void deriveBNTensorDescriptor(TensorDescriptor& derivedBnDesc, const TensorDescriptor& xDesc,
                              int mode) {
  check(cudnnDeriveBNTensorDescriptor(derivedBnDesc.get(), xDesc.get(),
                                      static_cast<cudnnBatchNormMode_t>(mode)),
        "cudnnDeriveBNTensorDescriptor");
  py::tuple got = derivedBnDesc.getNd();
  derivedBnDesc.setNd(got[0].cast<int>(), got[1].cast<std::vector<int>>(),
                      got[2].cast<std::vector<int>>());
}

std::size_t getBatchNormalizationForwardTrainingExWorkspaceSize(
    const Handle& handle, int mode, int bnOps, const TensorDescriptor& xDesc,
    const TensorDescriptor* zDesc, const TensorDescriptor& yDesc,
    const TensorDescriptor& bnScaleBiasMeanVarDesc, const ActivationDescriptor* activationDesc) {
  std::size_t size = 0;
  check(cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
            handle.get(), static_cast<cudnnBatchNormMode_t>(mode),
            static_cast<cudnnBatchNormOps_t>(bnOps), xDesc.get(),
            zDesc ? zDesc->get() : nullptr, yDesc.get(), bnScaleBiasMeanVarDesc.get(),
            activationDesc ? activationDesc->get() : nullptr, &size),
        "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize");
  return size;
}

std::size_t getBatchNormalizationBackwardExWorkspaceSize(
    const Handle& handle, int mode, int bnOps, const TensorDescriptor& xDesc,
    const TensorDescriptor* yDesc, const TensorDescriptor& dyDesc, const TensorDescriptor* dzDesc,
    const TensorDescriptor& dxDesc, const TensorDescriptor& dBnScaleBiasDesc,
    const ActivationDescriptor* activationDesc) {
  std::size_t size = 0;
  check(cudnnGetBatchNormalizationBackwardExWorkspaceSize(
            handle.get(), static_cast<cudnnBatchNormMode_t>(mode),
            static_cast<cudnnBatchNormOps_t>(bnOps), xDesc.get(), yDesc ? yDesc->get() : nullptr,
            dyDesc.get(), dzDesc ? dzDesc->get() : nullptr, dxDesc.get(), dBnScaleBiasDesc.get(),
            activationDesc ? activationDesc->get() : nullptr, &size),
        "cudnnGetBatchNormalizationBackwardExWorkspaceSize");
  return size;
}

std::size_t getBatchNormalizationTrainingExReserveSpaceSize(
    const Handle& handle, int mode, int bnOps, const ActivationDescriptor* activationDesc,
    const TensorDescriptor& xDesc) {
  std::size_t size = 0;
  check(cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
            handle.get(), static_cast<cudnnBatchNormMode_t>(mode),
            static_cast<cudnnBatchNormOps_t>(bnOps),
            activationDesc ? activationDesc->get() : nullptr, xDesc.get(), &size),
        "cudnnGetBatchNormalizationTrainingExReserveSpaceSize");
  return size;
}

void batchNormalizationForwardInference(const Handle& handle, int mode, double alpha,
                                        double beta, const TensorDescriptor& xDesc, uintptr_t x,
                                        const TensorDescriptor& yDesc, uintptr_t y,
                                        const TensorDescriptor& bnScaleBiasMeanVarDesc,
                                        uintptr_t bnScale, uintptr_t bnBias,
                                        uintptr_t estimatedMean, uintptr_t estimatedVariance,
                                        double epsilon) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnBatchNormalizationForwardInference(
              handle.get(), static_cast<cudnnBatchNormMode_t>(mode), a.ptr(), b.ptr(),
              xDesc.get(), devicePtr(x), yDesc.get(), devicePtr(y), bnScaleBiasMeanVarDesc.get(),
              devicePtr(bnScale), devicePtr(bnBias), devicePtr(estimatedMean),
              devicePtr(estimatedVariance), epsilon);
        }),
        "cudnnBatchNormalizationForwardInference");
}

void batchNormalizationForwardTraining(
    const Handle& handle, int mode, double alpha, double beta, const TensorDescriptor& xDesc,
    uintptr_t x, const TensorDescriptor& yDesc, uintptr_t y,
    const TensorDescriptor& bnScaleBiasMeanVarDesc, uintptr_t bnScale, uintptr_t bnBias,
    double exponentialAverageFactor, uintptr_t resultRunningMean,
    uintptr_t resultRunningVariance, double epsilon, uintptr_t resultSaveMean,
    uintptr_t resultSaveInvVariance) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnBatchNormalizationForwardTraining(
              handle.get(), static_cast<cudnnBatchNormMode_t>(mode), a.ptr(), b.ptr(),
              xDesc.get(), devicePtr(x), yDesc.get(), devicePtr(y), bnScaleBiasMeanVarDesc.get(),
              devicePtr(bnScale), devicePtr(bnBias), exponentialAverageFactor,
              devicePtr(resultRunningMean), devicePtr(resultRunningVariance), epsilon,
              devicePtr(resultSaveMean), devicePtr(resultSaveInvVariance));
        }),
        "cudnnBatchNormalizationForwardTraining");
}

void batchNormalizationForwardTrainingEx(
    const Handle& handle, int mode, int bnOps, double alpha, double beta,
    const TensorDescriptor& xDesc, uintptr_t xData, const TensorDescriptor* zDesc,
    uintptr_t zData, const TensorDescriptor& yDesc, uintptr_t yData,
    const TensorDescriptor& bnScaleBiasMeanVarDesc, uintptr_t bnScale, uintptr_t bnBias,
    double exponentialAverageFactor, uintptr_t resultRunningMean,
    uintptr_t resultRunningVariance, double epsilon, uintptr_t resultSaveMean,
    uintptr_t resultSaveInvVariance, const ActivationDescriptor* activationDesc,
    uintptr_t workspace, std::size_t workSpaceSizeInBytes, uintptr_t reserveSpace,
    std::size_t reserveSpaceSizeInBytes) {
  const Scaling a(alpha, yDesc.dataType()), b(beta, yDesc.dataType());
  check(withoutGil([&] {
          return cudnnBatchNormalizationForwardTrainingEx(
              handle.get(), static_cast<cudnnBatchNormMode_t>(mode),
              static_cast<cudnnBatchNormOps_t>(bnOps), a.ptr(), b.ptr(), xDesc.get(),
              devicePtr(xData), zDesc ? zDesc->get() : nullptr, devicePtr(zData), yDesc.get(),
              devicePtr(yData), bnScaleBiasMeanVarDesc.get(), devicePtr(bnScale),
              devicePtr(bnBias), exponentialAverageFactor, devicePtr(resultRunningMean),
              devicePtr(resultRunningVariance), epsilon, devicePtr(resultSaveMean),
              devicePtr(resultSaveInvVariance), activationDesc ? activationDesc->get() : nullptr,
              devicePtr(workspace), workSpaceSizeInBytes, devicePtr(reserveSpace),
              reserveSpaceSizeInBytes);
        }),
        "cudnnBatchNormalizationForwardTrainingEx");
}

void batchNormalizationBackward(const Handle& handle, int mode, double alphaDataDiff,
                                double betaDataDiff, double alphaParamDiff, double betaParamDiff,
                                const TensorDescriptor& xDesc, uintptr_t x,
                                const TensorDescriptor& dyDesc, uintptr_t dy,
                                const TensorDescriptor& dxDesc, uintptr_t dx,
                                const TensorDescriptor& dBnScaleBiasDesc, uintptr_t bnScale,
                                uintptr_t dBnScaleResult, uintptr_t dBnBiasResult,
                                double epsilon, uintptr_t savedMean, uintptr_t savedInvVariance) {
  const Scaling ad(alphaDataDiff, dxDesc.dataType()), bd(betaDataDiff, dxDesc.dataType());
  const Scaling ap(alphaParamDiff, dBnScaleBiasDesc.dataType());
  const Scaling bp(betaParamDiff, dBnScaleBiasDesc.dataType());
  check(withoutGil([&] {
          return cudnnBatchNormalizationBackward(
              handle.get(), static_cast<cudnnBatchNormMode_t>(mode), ad.ptr(), bd.ptr(), ap.ptr(),
              bp.ptr(), xDesc.get(), devicePtr(x), dyDesc.get(), devicePtr(dy), dxDesc.get(),
              devicePtr(dx), dBnScaleBiasDesc.get(), devicePtr(bnScale),
              devicePtr(dBnScaleResult), devicePtr(dBnBiasResult), epsilon, devicePtr(savedMean),
              devicePtr(savedInvVariance));
        }),
        "cudnnBatchNormalizationBackward");
}

void batchNormalizationBackwardEx(
    const Handle& handle, int mode, int bnOps, double alphaDataDiff, double betaDataDiff,
    double alphaParamDiff, double betaParamDiff, const TensorDescriptor& xDesc, uintptr_t xData,
    const TensorDescriptor* yDesc, uintptr_t yData, const TensorDescriptor& dyDesc,
    uintptr_t dyData, const TensorDescriptor* dzDesc, uintptr_t dzData,
    const TensorDescriptor& dxDesc, uintptr_t dxData, const TensorDescriptor& dBnScaleBiasDesc,
    uintptr_t bnScaleData, uintptr_t bnBiasData, uintptr_t dBnScaleData, uintptr_t dBnBiasData,
    double epsilon, uintptr_t savedMean, uintptr_t savedInvVariance,
    const ActivationDescriptor* activationDesc, uintptr_t workSpace,
    std::size_t workSpaceSizeInBytes, uintptr_t reserveSpace,
    std::size_t reserveSpaceSizeInBytes) {
  const Scaling ad(alphaDataDiff, dxDesc.dataType()), bd(betaDataDiff, dxDesc.dataType());
  const Scaling ap(alphaParamDiff, dBnScaleBiasDesc.dataType());
  const Scaling bp(betaParamDiff, dBnScaleBiasDesc.dataType());
  check(withoutGil([&] {
          return cudnnBatchNormalizationBackwardEx(
              handle.get(), static_cast<cudnnBatchNormMode_t>(mode),
              static_cast<cudnnBatchNormOps_t>(bnOps), ad.ptr(), bd.ptr(), ap.ptr(), bp.ptr(),
              xDesc.get(), devicePtr(xData), yDesc ? yDesc->get() : nullptr, devicePtr(yData),
              dyDesc.get(), devicePtr(dyData), dzDesc ? dzDesc->get() : nullptr,
              devicePtr(dzData), dxDesc.get(), devicePtr(dxData), dBnScaleBiasDesc.get(),
              devicePtr(bnScaleData), devicePtr(bnBiasData), devicePtr(dBnScaleData),
              devicePtr(dBnBiasData), epsilon, devicePtr(savedMean), devicePtr(savedInvVariance),
              activationDesc ? activationDesc->get() : nullptr, devicePtr(workSpace),
              workSpaceSizeInBytes, devicePtr(reserveSpace), reserveSpaceSizeInBytes);
        }),
        "cudnnBatchNormalizationBackwardEx");
}

}  // namespace

void bindBatchNorm(py::module_& m) {
  using py::arg;
  // Descriptors cuDNN documents as optional (z, y and the activation of the Ex calls when
  // bnOps does not use them) are Python None, passed on as NULL.
  m.def("deriveBNTensorDescriptor", &deriveBNTensorDescriptor, arg("derivedBnDesc"),
        arg("xDesc"), arg("mode"));
  m.def("getBatchNormalizationForwardTrainingExWorkspaceSize",
        &getBatchNormalizationForwardTrainingExWorkspaceSize, arg("handle"), arg("mode"),
        arg("bnOps"), arg("xDesc"), arg("zDesc").none(true), arg("yDesc"),
        arg("bnScaleBiasMeanVarDesc"), arg("activationDesc").none(true));
  m.def("getBatchNormalizationBackwardExWorkspaceSize",
        &getBatchNormalizationBackwardExWorkspaceSize, arg("handle"), arg("mode"), arg("bnOps"),
        arg("xDesc"), arg("yDesc").none(true), arg("dyDesc"), arg("dzDesc").none(true),
        arg("dxDesc"), arg("dBnScaleBiasDesc"), arg("activationDesc").none(true));
  m.def("getBatchNormalizationTrainingExReserveSpaceSize",
        &getBatchNormalizationTrainingExReserveSpaceSize, arg("handle"), arg("mode"),
        arg("bnOps"), arg("activationDesc").none(true), arg("xDesc"));
  m.def("batchNormalizationForwardInference", &batchNormalizationForwardInference, arg("handle"),
        arg("mode"), arg("alpha"), arg("beta"), arg("xDesc"), arg("x"), arg("yDesc"), arg("y"),
        arg("bnScaleBiasMeanVarDesc"), arg("bnScale"), arg("bnBias"), arg("estimatedMean"),
        arg("estimatedVariance"), arg("epsilon"));
  m.def("batchNormalizationForwardTraining", &batchNormalizationForwardTraining, arg("handle"),
        arg("mode"), arg("alpha"), arg("beta"), arg("xDesc"), arg("x"), arg("yDesc"), arg("y"),
        arg("bnScaleBiasMeanVarDesc"), arg("bnScale"), arg("bnBias"),
        arg("exponentialAverageFactor"), arg("resultRunningMean"), arg("resultRunningVariance"),
        arg("epsilon"), arg("resultSaveMean"), arg("resultSaveInvVariance"));
  m.def("batchNormalizationForwardTrainingEx", &batchNormalizationForwardTrainingEx,
        arg("handle"), arg("mode"), arg("bnOps"), arg("alpha"), arg("beta"), arg("xDesc"),
        arg("xData"), arg("zDesc").none(true), arg("zData"), arg("yDesc"), arg("yData"),
        arg("bnScaleBiasMeanVarDesc"), arg("bnScale"), arg("bnBias"),
        arg("exponentialAverageFactor"), arg("resultRunningMean"), arg("resultRunningVariance"),
        arg("epsilon"), arg("resultSaveMean"), arg("resultSaveInvVariance"),
        arg("activationDesc").none(true), arg("workspace"), arg("workSpaceSizeInBytes"),
        arg("reserveSpace"), arg("reserveSpaceSizeInBytes"));
  m.def("batchNormalizationBackward", &batchNormalizationBackward, arg("handle"), arg("mode"),
        arg("alphaDataDiff"), arg("betaDataDiff"), arg("alphaParamDiff"), arg("betaParamDiff"),
        arg("xDesc"), arg("x"), arg("dyDesc"), arg("dy"), arg("dxDesc"), arg("dx"),
        arg("dBnScaleBiasDesc"), arg("bnScale"), arg("dBnScaleResult"), arg("dBnBiasResult"),
        arg("epsilon"), arg("savedMean"), arg("savedInvVariance"));
  m.def("batchNormalizationBackwardEx", &batchNormalizationBackwardEx, arg("handle"),
        arg("mode"), arg("bnOps"), arg("alphaDataDiff"), arg("betaDataDiff"),
        arg("alphaParamDiff"), arg("betaParamDiff"), arg("xDesc"), arg("xData"),
        arg("yDesc").none(true), arg("yData"), arg("dyDesc"), arg("dyData"),
        arg("dzDesc").none(true), arg("dzData"), arg("dxDesc"), arg("dxData"),
        arg("dBnScaleBiasDesc"), arg("bnScaleData"), arg("bnBiasData"), arg("dBnScaleData"),
        arg("dBnBiasData"), arg("epsilon"), arg("savedMean"), arg("savedInvVariance"),
        arg("activationDesc").none(true), arg("workSpace"), arg("workSpaceSizeInBytes"),
        arg("reserveSpace"), arg("reserveSpaceSizeInBytes"));
}

}  // namespace convfuse
