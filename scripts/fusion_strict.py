"""pytest plugin for scripts/gpu_acceptance.sh: a FusedFallbackWarning that a test did not
expect fails that test when cuDNN documents the fused call for the plan's configuration;
elsewhere a refusal is legitimate and only recorded. Documented:
- convolution + bias + activation: ReLU or IDENTITY, float32 or float16, 2-D NCHW or NHWC,
  groups 1 (not bfloat16, float64, groups, 1-D/3-D);
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

_PLAN = re.compile(r"x\[[^\]]*\] w\[[^\]]*\] (?P<layout>\w+) .*?groups=(?P<groups>\d+) "
                   r"dtype=(?P<dtype>\w+) activation=(?P<act>\w+)")
DOCUMENTED = {"layouts": ("NCHW", "NHWC"), "dtypes": ("float32", "float16"),
              "activations": ("relu", "identity")}
# BatchNormPlan.describe(): "batchnorm x=[N, H, W, C] layout=NHWC dtype=... activation=..."
_BN_PLAN = re.compile(r"batchnorm x=\[(?P<shape>[^\]]*)\] layout=(?P<layout>\w+) "
                      r"dtype=(?P<dtype>\w+) activation=(?P<act>\w+)")


def documented(message: str) -> bool:
    """Whether the plan a FusedFallbackWarning names is one cuDNN documents as fusable."""
    bn = _BN_PLAN.search(message)
    if bn is not None:
        shape = [int(v) for v in bn["shape"].split(",")]
        return (bn["layout"] == "NHWC" and len(shape) >= 3 and shape[-1] % 4 == 0
                and bn["dtype"] == "float16" and bn["act"] == "relu")
    m = _PLAN.search(message)
    if m is None:
        return False
    return (m["layout"] in DOCUMENTED["layouts"] and m["groups"] == "1"
            and m["dtype"] in DOCUMENTED["dtypes"] and m["act"] in DOCUMENTED["activations"])


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
