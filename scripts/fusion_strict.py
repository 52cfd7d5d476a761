"""pytest plugin for scripts/gpu_acceptance.sh: a FusedFallbackWarning that a test did not
expect fails that test when cuDNN documents the fused call for the plan's configuration;
elsewhere a refusal is legitimate and only recorded. Documented:
- convolution + bias + activation (`conv_fusion_documented`): ReLU or IDENTITY, float32 or
  float16, 2-D NCHW or NHWC, groups 1, dilation 1, and for float16 NHWC channel counts
  that are multiples of 8 (not bfloat16, float64, groups, dilation, 1-D/3-D);
- batch normalization + (add +) ReLU (cudnnBatchNormalizationForwardTrainingEx/BackwardEx,
  Note [BatchNorm in cuDNN]): channels-last float16 with at least one spatial dim, C a
  multiple of 4, ReLU.

Use: PYTHONPATH=scripts python -m pytest -p fusion_strict tests/gpu
Warnings a test expects (pytest.warns, its own catch_warnings) never reach this plugin.
"""

from __future__ import annotations

import re
import warnings

import pytest

_PLAN = re.compile(r"x\[(?P<x>[^\]]*)\] w\[(?P<w>[^\]]*)\] (?P<layout>\w+) .*?"
                   r"dilation=\[(?P<dilation>[^\]]*)\] groups=(?P<groups>\d+) "
                   r"dtype=(?P<dtype>\w+) activation=(?P<act>\w+)")
# cuDNN documents cudnnConvolutionBiasActivationForward (cuDNN 9 "cudnn_cnn Library",
# https://docs.nvidia.com/deeplearning/cudnn/backend/v9.6.0/api/cudnn-cnn-library.html
# #cudnnconvolutionbiasactivationforward) for the RELU activation, IDENTITY only with
# CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM, in its table of data-type
# configurations (float: FLOAT_CONFIG; half: PSEUDO_HALF_CONFIG, computing in float), and
# defers the rest to cudnnConvolutionForward's per-algorithm support. Kept strict here is
# only what no row or condition of those pages restricts: 2-D, groups 1, dilation 1, and
# float16 channels-last only with C and K multiples of 8 (half NHWC kernels are Tensor
# Core kernels; a forum report of NOT_SUPPORTED otherwise:
# https://forums.developer.nvidia.com/t/algorithm-recommended-by-cudnnfindconvolutionforwardalgorithm-fails-to-run-when-output-channels-are-not-a-multiple-of-8/57827).
# Elsewhere a refusal and the unfused fallback are legitimate.
DOCUMENTED = {"layouts": ("NCHW", "NHWC"), "dtypes": ("float32", "float16"),
              "activations": ("relu", "identity")}


def conv_fusion_documented(layout: str, groups: int, dilation: tuple[int, ...],
                           channels: int, out_channels: int, dtype: str, act: str) -> bool:
    """Whether cuDNN documents the fused call for this convolution (see above); act is the
    activation cuDNN applies (IDENTITY for activations convfuse applies after it)."""
    if (layout not in DOCUMENTED["layouts"] or groups != 1 or dtype not in DOCUMENTED["dtypes"]
            or act not in DOCUMENTED["activations"] or any(d != 1 for d in dilation)):
        return False
    return not (dtype == "float16" and layout == "NHWC"
                and (channels % 8 or out_channels % 8))
# BatchNormPlan.describe(): "batchnorm x=[N, H, W, C] layout=NHWC dtype=... activation=..."
_BN_PLAN = re.compile(r"batchnorm x=\[(?P<shape>[^\]]*)\] layout=(?P<layout>\w+) "
                      r"dtype=(?P<dtype>\w+) activation=(?P<act>\w+)")


def documented(message: str) -> bool:
    """Whether the plan a FusedFallbackWarning names is one cuDNN documents as fusable."""
    bn = _BN_PLAN.search(message)
    if bn is not None:
        shape = [int(v) for v in bn["shape"].split(",")]
        return (bn["layout"] == "NHWC" and 3 <= len(shape) <= 4 and shape[-1] % 4 == 0
                and bn["dtype"] == "float16" and bn["act"] == "relu")
    m = _PLAN.search(message)
    if m is None:
        return False
    x = [int(v) for v in m["x"].split(",")]
    w = [int(v) for v in m["w"].split(",")]
    dilation = tuple(int(v) for v in m["dilation"].split(","))
    channels = x[-1] if m["layout"] == "NHWC" else x[1]
    return conv_fusion_documented(m["layout"], int(m["groups"]), dilation, channels, w[0],
                                  m["dtype"], m["act"])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    from convfuse.plan import FusedFallbackWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = yield
    strict = []
    for w in seen:
        if issubclass(w.category, FusedFallbackWarning) and documented(str(w.message)):
            strict.append(str(w.message))
        else:  # hand everything else back to pytest's own warning capture
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if strict:
        raise AssertionError("fusion lost where cuDNN documents it (FusedFallbackWarning):\n"
                             + "\n".join(strict))
    return result
