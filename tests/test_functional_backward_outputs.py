"""The functional backward's residual gradient in reduced precision, and the output buffers
it refuses before writing anything (dweight over the caller's dy; a device dweight the
ops would refuse), against torch and against the arrays as they were."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from convfuse import backend
from convfuse import functional as F
from convfuse import functional_transpose as FT
from convfuse.errors import DeviceMismatchError
from convfuse.geometry import ConvGeometry
from convfuse.ops import _checks

torch = pytest.importorskip("torch")

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the forward's y
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype, tdtype, scale, dy_value", [
    (BF16, torch.bfloat16, 0.3, None),        # 0.3 rounded to bfloat16 is 0.30078125
    (np.dtype(np.float16), torch.float16, 1e5, 1e-3),  # 1e5 is inf in float16
])
def test_the_residual_gradient_scales_in_float32_and_rounds_once(rng, transposed, dtype,
                                                                  tdtype, scale, dy_value):
    x = rng.standard_normal((2, 3, 4, 4)).astype(dtype)
    w = rng.standard_normal((3, 3, 1, 1)).astype(dtype)
    residual = rng.standard_normal((2, 3, 4, 4)).astype(dtype)
    forward = FT.conv_transpose_bias_act_forward if transposed else F.conv_bias_act_forward
    backward = FT.conv_transpose_bias_act_backward if transposed else \
        F.conv_bias_act_backward
    _, ctx = forward(x, w, residual=residual, residual_scale=scale)
    dy = (rng.standard_normal((2, 3, 4, 4)) if dy_value is None
          else np.full((2, 3, 4, 4), dy_value)).astype(dtype)
    got = backward(dy, ctx).dresidual
    # torch's autograd of scale * residual: the product in float32, rounded once
    r = torch.tensor(residual.astype(np.float32)).to(tdtype).requires_grad_()
    (r * scale).backward(torch.tensor(dy.astype(np.float32)).to(tdtype))
    want = r.grad.float().numpy()
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got.astype(np.float32), want)


def test_a_dweight_over_the_callers_non_contiguous_dy_is_refused(rng):
    x = rng.standard_normal((1, 2, 3, 3))
    w = rng.standard_normal((2, 2, 1, 1))
    _, ctx = F.conv_bias_act_forward(x, w)
    buf = rng.standard_normal((1, 2, 3, 6))
    dy = buf[..., ::2]  # non-contiguous: the backward reads a contiguous copy of it
    before = buf.copy()
    dweight = buf.reshape(-1)[:4].reshape(2, 2, 1, 1)  # the caller's dy's memory
    with pytest.raises(ValueError, match=r"^conv_bias_act_backward: dweight shares memory "
                                         r"with dy"):
        F.conv_bias_act_backward(dy, ctx, dweight=dweight)
    np.testing.assert_array_equal(buf, before)


class _DeviceArray:
    """Device memory as the cuDNN engine sees it: an address and a device id (the project's
    register_device_array_type hook); its values live in `host`."""

    def __init__(self, shape, ptr, device=0, dtype=np.float32):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(shape))
        self.nbytes = self.size * self.dtype.itemsize
        self.flags = types.SimpleNamespace(c_contiguous=True, writeable=True)
        self.data = types.SimpleNamespace(ptr=ptr)
        self.device = types.SimpleNamespace(id=device)
        self.host = np.zeros(shape, self.dtype)


@pytest.mark.parametrize("batch", [2, 0])  # N = 0: no direct path, the ops zero-fill dbias
@pytest.mark.parametrize("misplaced, error", [
    ({"ptr": 0x4000004}, ValueError),                     # not 16-byte aligned
    ({"ptr": 0x4000000, "device": 1}, DeviceMismatchError),  # another GPU
])
def test_a_device_dweight_the_ops_would_refuse_is_refused_before_dbias_is_written(
        monkeypatch, misplaced, error, batch):
    monkeypatch.setattr(backend, "DEVICE_ARRAY_TYPES", backend.DEVICE_ARRAY_TYPES)
    monkeypatch.setattr(backend, "_device_types", None)
    backend.register_device_array_type(_DeviceArray)
    monkeypatch.setattr(_checks, "current_device", lambda: 0)
    writes = []

    def engine_call(*args, **kwargs):  # no engine may run: the refusal comes first
        writes.append(args)
        raise AssertionError("an engine call before the refusal")

    monkeypatch.setattr(F, "_bias_act_backward", engine_call)
    geom = ConvGeometry.create((batch, 3, 5, 5), (4, 3, 3, 3))
    x = _DeviceArray(geom.input_shape, 0x1000000)
    w = _DeviceArray(geom.weight_shape, 0x2000000)
    ctx = F.ConvContext(geom, "identity", x, w, None, True, False, 1.0)
    dy = _DeviceArray(geom.output_shape, 0x3000000)
    dbias = _DeviceArray((4,), 0x5000000)
    dbias.host[...] = 10.0
    dweight = _DeviceArray(geom.weight_shape, **misplaced)
    with pytest.raises(error, match=r"^conv_bias_act_backward: dweight "):
        F.conv_bias_act_backward(dy, ctx, dweight=dweight, dbias=dbias, accumulate=True)
    assert writes == [] and np.all(dbias.host == 10.0)
