"""Layers on the GPU against the same layers on the CPU reference engine (float64 oracle)."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import activations

pytestmark = pytest.mark.gpu

TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
ACTS = ["identity", "relu", "sigmoid", "tanh", "elu", "relu6", "leaky_relu", "silu", "gelu"]


def pair(cls, *args, dtype, **kwargs):
    """The same layer (same seed) on cuda in `dtype` and on cpu in float64."""
    gpu = cls(*args, dtype=dtype, device="cuda", seed=11, **kwargs)
    ref = cls(*args, dtype="float64", device="cpu", seed=11, **kwargs)
    ref.weight.data[...] = gpu.weight.data.get().astype(np.float64)
    if gpu.bias is not None:
        ref.bias.data[...] = gpu.bias.data.get().astype(np.float64)
    return gpu, ref


def with_device_saved(ctx, saved_dev):
    """The reference context `ctx` with the device's own saved tensor (in float64), so the
    reference backward reads exactly what the device's backward reads.

    In float16 and bfloat16 (and, rarely, float32: within ~3e-7 of 0) a pre-activation
    within rounding of a kink (ReLU's 0, ReLU6's 6) can land on the other side on the
    device, most of all when cuDNN refuses the fused call and the unfused fallback rounds
    conv(x) before adding the bias (Note [unfused fallback]). The forward check bounds that
    difference by the rounding, but the backward's mask then differs by a whole dy
    element, which the sums over the batch carry into dx and dweight. So for activations
    whose backward reads the output, the reference backward reads the device's output,
    and measures the backward alone."""
    import dataclasses

    return dataclasses.replace(ctx, saved=saved_dev.get().astype(np.float64))


def backward_reference(ref, x64, z64, y_dev, r64, act, layout):
    """(dx or (dx, dresidual), dweight, dbias) in float64 from the device's own output
    (`with_device_saved`)."""
    from convfuse.functional import conv_bias_act_backward, conv_bias_act_forward

    _, ctx = conv_bias_act_forward(x64, ref.weight.data, ref.bias.data, padding=1, groups=2,
                                   activation=act, residual=z64, layout=layout)
    g = conv_bias_act_backward(r64, with_device_saved(ctx, y_dev))
    return ((g.dx, g.dresidual) if z64 is not None else g.dx), g.dweight, g.dbias


def close(gpu_arr, ref_arr, dtype):
    got = gpu_arr.get().astype(np.float64)
    assert np.isfinite(got).all()
    scale = max(1.0, float(np.abs(ref_arr).max()))
    np.testing.assert_allclose(got, ref_arr, rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("residual", [False, True])
def test_conv2d_gpu_matches_reference(dtype, act, layout, residual):
    import cupy as cp

    with cf.config.flags(allow_tf32=False):
        gpu, ref = pair(cf.Conv2d, 8, 16, 3, dtype=dtype, padding=1, groups=2, activation=act,
                        layout=layout)
        rng = np.random.default_rng(0)
        shape = (4, 8, 10, 9) if layout == "NCHW" else (4, 10, 9, 8)
        x = rng.standard_normal(shape).astype(gpu.dtype)
        out_shape = ref(x.astype(np.float64)).shape
        z = rng.standard_normal(out_shape).astype(gpu.dtype) if residual else None
        y_ref = ref(x.astype(np.float64), residual=None if z is None else z.astype(np.float64))
        y = gpu(cp.asarray(x), residual=None if z is None else cp.asarray(z))
        close(y, y_ref, dtype)
        r = rng.standard_normal(out_shape).astype(gpu.dtype)
        g = gpu.backward(cp.asarray(r))
        if dtype != "float64" and activations.saves(act) == "output":
            g_ref, dw_ref, db_ref = backward_reference(
                ref, x.astype(np.float64), None if z is None else z.astype(np.float64), y,
                r.astype(np.float64), act, layout)
        else:
            g_ref = ref.backward(r.astype(np.float64))
            dw_ref, db_ref = ref.weight.grad, ref.bias.grad
        if residual:
            close(g[0], g_ref[0], dtype)
            close(g[1], g_ref[1], dtype)
        else:
            close(g, g_ref, dtype)
        close(gpu.weight.grad, dw_ref, dtype)
        close(gpu.bias.grad, db_ref, dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_linear_pool_sequential_gpu(dtype):
    import cupy as cp

    with cf.config.flags(allow_tf32=False):
        def build(device, dt):
            return cf.Sequential(
                cf.Conv2d(3, 8, 3, padding=1, activation="relu", dtype=dt, device=device, seed=1),
                cf.MaxPool2d(2), cf.AvgPool2d(2, stride=1), cf.Flatten(),
                cf.Linear(8 * 3 * 3, 5, activation="tanh", dtype=dt, device=device, seed=2),
            )

        gpu, ref = build("cuda", dtype), build("cpu", "float64")
        for pg, pr in zip(gpu.parameters(), ref.parameters()):
            pr.data[...] = pg.data.get()
        rng = np.random.default_rng(1)
        x = rng.standard_normal((6, 3, 8, 8))
        close(gpu(cp.asarray(x.astype(dtype))), ref(x), dtype)
        r = rng.standard_normal((6, 5))
        close(gpu.backward(cp.asarray(r.astype(dtype))), ref.backward(r), dtype)
        for pg, pr in zip(gpu.parameters(), ref.parameters()):
            close(pg.grad, pr.grad, dtype)


@pytest.mark.parametrize("act", ["identity", "relu"])
def test_fused_forward_is_one_cudnn_call(act, monkeypatch):
    import cupy as cp

    from convfuse._binding import cudnn
    from convfuse.ops import elementwise

    lib = cudnn()
    calls = []
    for name in ("convolutionBiasActivationForward", "convolutionForward", "addTensor",
                 "activationForward"):
        original = getattr(lib, name)
        # recorded once the call returns: a ranked algorithm cuDNN refuses (the engine
        # then tries the next) is no call of the path
        monkeypatch.setattr(
            lib, name, lambda *a, _n=name, _f=original: (_f(*a), calls.append(_n))[0]
        )
    monkeypatch.setattr(elementwise, "activation_forward",
                        lambda *a, **k: pytest.fail("no activation kernel may run for " + act))
    layer = cf.Conv2d(4, 8, 3, activation=act, device="cuda", bias=(act == "relu"))
    layer(cp.ones((2, 4, 6, 6), dtype=cp.float32))
    # a bias-free identity conv has nothing to fuse (Note [nothing to fuse]): one plain call
    assert calls == ["convolutionBiasActivationForward" if act == "relu"
                     else "convolutionForward"]


@pytest.mark.parametrize("act", ["gelu", "identity"])
def test_bias_gradient_takes_the_intended_path(act, monkeypatch):
    """cudnnConvolutionBackwardBias or the fused kernel, per config; never cupy.sum."""
    import cupy as cp

    from convfuse._binding import cudnn
    from convfuse.ops import elementwise

    lib = cudnn()
    calls = []
    original_bias = lib.convolutionBackwardBias
    monkeypatch.setattr(lib, "convolutionBackwardBias",
                        lambda *a: (calls.append("cudnn"), original_bias(*a))[1])
    original_fused = elementwise.activation_backward_bias
    monkeypatch.setattr(elementwise, "activation_backward_bias",
                        lambda *a, **k: (calls.append("fused"), original_fused(*a, **k))[1])
    monkeypatch.setattr(cp, "sum", lambda *a, **k: pytest.fail("cupy.sum used in backward"))
    x = cp.asarray(np.random.default_rng(2).standard_normal((2, 4, 6, 6)).astype(np.float32))
    grads = []
    for path in ("cudnn", "fused"):
        layer = cf.Conv2d(4, 8, 3, activation=act, device="cuda", seed=5)
        with cf.config.flags(bias_grad=path):
            y = layer(x)
            layer.backward(cp.ones_like(y))
        grads.append(layer.bias.grad.get())
    assert calls == ["cudnn", "fused"]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5)


def test_device_mismatch_is_refused():
    import cupy as cp

    from convfuse.errors import DeviceMismatchError

    gpu_layer = cf.Conv2d(2, 2, 1, device="cuda")
    with pytest.raises(DeviceMismatchError, match="is on 'cuda' but its input is on 'cpu'"):
        gpu_layer(np.ones((1, 2, 3, 3), dtype=np.float32))
    cpu_layer = cf.Conv2d(2, 2, 1, device="cpu")
    with pytest.raises(DeviceMismatchError):
        cpu_layer(cp.ones((1, 2, 3, 3), dtype=cp.float32))
    cpu_layer.to("cuda")
    assert cpu_layer(cp.ones((1, 2, 3, 3), dtype=cp.float32)).shape == (1, 2, 3, 3)
