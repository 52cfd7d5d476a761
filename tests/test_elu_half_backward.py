"""ELU's gradient in float16 and bfloat16 against torch.nn.ELU's, element by element.

convfuse saves elu's pre-activation z and computes dy * exp(z) in float32 (Note [what
backward saves] in convfuse/activations.py), as torch.nn.ELU does from its input
(elu_backward with is_result=False). Derived from a saved half output as y + 1, exp(z)
cancels near y = -1: the gradient was exactly 0 below z ~ -8.3 in float16 (bfloat16 ~ -6.2)
and 13-16% off at z = -5 in bfloat16.

Each case makes the pre-activation exactly z in [-12, -0.5]: a 1x1 convolution with weight
1 and no bias, a residual of zeros, a batch norm in eval mode with mean 0 and var + eps = 1.
Its data gradient is then exactly dz, compared per element with torch's own gradient of
F.elu at z in the same dtype (torch computes it in float32 and rounds once, as convfuse).
"""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.dtypes import bfloat16

torch = pytest.importorskip("torch")
F = torch.nn.functional
ct = pytest.importorskip("convfuse.torch")

DTYPES = {"float16": (np.dtype(np.float16), torch.float16),
          "bfloat16": (bfloat16, torch.bfloat16)}
N = 256  # per sample: (2, 1, N) or (2, 1, 8, N // 8)
ULPS = 2


def _data(tdt):
    """z in [-12, -0.5] and dy in [0.5, 2], each exactly representable in `tdt`."""
    z = torch.linspace(-12.0, -0.5, 2 * N).to(tdt)
    dy = torch.linspace(2.0, 0.5, 2 * N).roll(N // 3).to(tdt)
    return z, dy


def _torch_dz(z, dy):
    """torch.nn.ELU's gradient at z (out of place: it saves and differentiates its input)."""
    zt = z.clone().requires_grad_(True)
    torch.nn.ELU()(zt).backward(dy)
    return zt.grad


def _check(got, z, dy, what):
    """got (a tensor, or an array in z's dtype) within ULPS ulps of torch's, subnormal ulps
    included (in float16 exp(z) dy is subnormal below z ~ -9.7)."""
    z, dy = z.reshape(-1), dy.reshape(-1)
    want = _torch_dz(z, dy).double().numpy()
    got = got.double().numpy() if isinstance(got, torch.Tensor) else got.astype(np.float64)
    got = got.reshape(-1)
    info = torch.finfo(z.dtype)
    ulp = np.maximum(info.eps * np.abs(want), info.eps * info.tiny)  # tiny * eps: subnormals'
    err = np.abs(got - want) / ulp
    worst = int(np.argmax(err))
    assert err[worst] <= ULPS, (f"{what}: at z = {float(z[worst])} got {got[worst]}, torch "
                                f"{want[worst]} ({err[worst]:.1f} ulps)")
    # torch's own answer is within an ulp of the truth, so the comparison means something
    exact = (torch.exp(z.double()) * dy.double()).numpy()
    assert np.all(np.abs(want - exact) <= ulp)


def _np(t, ndt):
    return t.float().numpy().astype(ndt)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_native_conv1d(dtype):
    ndt, tdt = DTYPES[dtype]
    z, dy = _data(tdt)
    layer = cf.Conv1d(1, 1, 1, bias=False, activation="elu", dtype=dtype)
    layer.weight.data[...] = 1
    x = _np(z, ndt).reshape(2, 1, N)
    y = layer(x)
    np.testing.assert_array_equal(y.astype(np.float64).ravel(),
                                  F.elu(z).double().numpy())  # the forward was already
    _check(layer.backward(_np(dy, ndt).reshape(2, 1, N)), z, dy, f"nn.Conv1d {dtype}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_native_batchnorm2d(dtype):
    ndt, tdt = DTYPES[dtype]
    z, dy = _data(tdt)
    layer = cf.BatchNorm2d(1, eps=0.25, activation="elu", dtype=dtype)
    layer.running_var[...] = 0.75  # var + eps = 1: the batch norm passes z unchanged
    layer.eval()
    layer(_np(z, ndt).reshape(2, 1, 8, N // 8))
    _check(layer.backward(_np(dy, ndt).reshape(2, 1, 8, N // 8)), z, dy,
           f"nn.BatchNorm2d {dtype}")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_functional(dtype):
    ndt, tdt = DTYPES[dtype]
    z, dy = _data(tdt)
    x = _np(z, ndt).reshape(2, 1, N)
    w = np.ones((1, 1, 1), ndt)
    _, ctx = cf.functional.conv_bias_act_forward(x, w, activation="elu",
                                                 residual=np.zeros_like(x))
    grads = cf.functional.conv_bias_act_backward(_np(dy, ndt).reshape(2, 1, N), ctx)
    _check(grads.dx, z, dy, f"functional dx {dtype}")
    _check(grads.dresidual, z, dy, f"functional dresidual {dtype}")


def _torch_layer(kind, tdt):
    if kind == "BatchNorm2d":
        layer = ct.BatchNorm2d(1, eps=0.25, activation="elu").to(tdt).eval()
        with torch.no_grad():
            layer.running_var.fill_(0.75)  # var + eps = 1
        return layer
    cls = {"Conv2d": ct.Conv2d, "ConvTranspose2d": ct.ConvTranspose2d}[kind]
    layer = cls(1, 1, 1, bias=False, activation="elu").to(tdt)
    with torch.no_grad():
        layer.weight.fill_(1)
    return layer


@pytest.mark.parametrize("recorded", [False, True], ids=["fused", "create_graph"])
@pytest.mark.parametrize("kind", ["Conv2d", "BatchNorm2d", "ConvTranspose2d"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_bridge(dtype, kind, recorded):
    """The fused backward op, and the recorded one (create_graph=True: activation_grad, Note
    [two backward paths] in convfuse/torch/_double.py)."""
    _, tdt = DTYPES[dtype]
    z, dy = _data(tdt)
    layer = _torch_layer(kind, tdt)
    x = z.reshape(2, 1, 8, N // 8).clone().requires_grad_(True)
    y = layer(x)
    torch.testing.assert_close(y, F.elu(x.detach()), rtol=0, atol=0)
    (dx,) = torch.autograd.grad(y, x, dy.reshape(y.shape), create_graph=recorded)
    _check(dx.detach(), z, dy, f"convfuse.torch.{kind} {dtype}")


@pytest.mark.parametrize("kind", ["Conv2d", "BatchNorm2d", "ConvTranspose2d"])
def test_an_inplace_op_on_the_output_leaves_the_gradient_alone(kind):
    """elu saves z, not y (docs/PYTORCH.md, convert()): an in-place op on a folded ELU's
    output is then no error and changes no gradient, as after torch.nn.ELU. Three calls:
    the first ones may take the eager path, later ones a call plan (Note [call plans] in
    convfuse/torch/_call_plan.py)."""
    layer = _torch_layer(kind, torch.float32)
    x = torch.linspace(-6.0, 2.0, 2 * N).reshape(2, 1, 8, N // 8)
    want = torch.where(x <= 0, torch.exp(x), 1.0)
    for _ in range(3):
        xg = x.clone().requires_grad_(True)
        y = layer(xg)
        y.mul_(2)  # d(2 y)/dx = 2 elu'(z)
        y.sum().backward()
        torch.testing.assert_close(xg.grad, 2 * want)
