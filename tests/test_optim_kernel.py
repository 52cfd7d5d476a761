"""convfuse.optim's launcher against the kernel source: the arguments it builds match
optim.cu's signatures, and the source compiles with every entry point (with NVRTC)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import convfuse.kernels as kernels
from convfuse import dtypes
from convfuse.optim import SGD, Adam, AdamW
from tests._optim_helpers import make_params


# -- the launcher against the kernel source ---------------------------------------------------
def _kernel_signatures():
    src = kernels.source("optim")
    sigs = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)##SUFFIX\((.*?)\)', src,
                                   flags=re.S):
        sigs[name] = [re.sub(r"\s+", " ", a.replace("\\", "")).strip() for a in params.split(",")]
    return sigs


def _kind(c_decl):
    if "*" in c_decl:
        return "ptr"
    return {"long long": "i64", "double": "f64", "int": "i32"}[c_decl.rsplit(" ", 1)[0]]


def _arg_kind(a):
    if a is None or isinstance(a, (np.ndarray, np.uint64)):
        return "ptr"  # None: a device scalar, absent on the CPU; uint64: a NULL pointer
    return {np.int64: "i64", np.float64: "f64", np.int32: "i32"}[type(a)]


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1), lambda ps: SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: Adam(ps), lambda ps: AdamW(ps),
])
def test_launch_arguments_match_kernel_signature(rng, make):
    sigs = _kernel_signatures()
    assert set(sigs) == {"sgd_", "adam_"}
    params = make_params(rng, np.float32, [(3,)]) + make_params(rng, dtypes.float16, [(5,)])
    opt = make(params)
    decl = sigs[f"{opt._kernel}_"]
    for g in opt._groups:
        args = opt._kernel_args(g)
        assert [_arg_kind(a) for a in args] == [_kind(d) for d in decl]
        # Pointer element types: T for data/grad, the compute type for the state.
        assert args[0] is g.data and args[1] is g.grad
        for a, d in zip(args[2:], decl[2:]):
            if isinstance(a, np.ndarray):
                assert "ComputeOf<T>::type" in d and a.dtype == g.compute_dtype
        assert args[decl.index("long long n")] == g.numel


def test_kernel_source_compiles_with_every_entry_point():
    pytest.importorskip("cupy")  # NVRTC comes with CuPy, which convfuse does not require
    for arch in kernels.CHECKED_ARCHS:
        cubin = kernels.nvrtc_compile("optim", arch)
        for kind in ("sgd", "adam"):
            for suffix in ("f32", "f64", "f16", "bf16"):
                assert f"{kind}_{suffix}\0".encode() in cubin
