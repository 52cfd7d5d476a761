"""The eager path's CUDA branch (Note [call plans] in convfuse/torch/_call_plan.py, Note [the
torch pointer path] in _arrays.py), layer to binding, on the fake GPU of
tests/test_ops_cudnn_wiring.py: plain tensors report themselves as CUDA tensors of device
0, torch.empty for CUDA makes CPU tensors (recorded), and the binding records its calls.
A layer call then takes the path it takes on a GPU (one autograd node, no custom op, no
DLPack), so this checks without a device that cuDNN gets the tensors' own addresses and
that the gradients autograd hands out are the very tensors cuDNN was told to write.
tests/gpu/test_torch_pointer_path_gpu.py checks the numbers on a device."""

from __future__ import annotations

from typing import NamedTuple

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import convfuse.torch as cft  # noqa: E402
from convfuse.ops import elementwise  # noqa: E402
from convfuse.ops.cudnn import batchnorm as bn_engine  # noqa: E402
from convfuse.ops.cudnn import fused  # noqa: E402
from convfuse.ops.cudnn.device import DeviceArray  # noqa: E402
from convfuse.plan.batchnorm import clear_batchnorm_plan_cache  # noqa: E402
from convfuse.torch import _arrays, _bn_ops, _ops  # noqa: E402
from convfuse.torch import batchnorm as torch_batchnorm  # noqa: E402
from convfuse.torch import conv as torch_conv  # noqa: E402
from tests.test_batchnorm_cudnn_wiring import BN_CALLS, SIZES  # noqa: E402
from tests.test_ops_cudnn_wiring import FakeGpu  # noqa: E402

WS = 512  # every ranked algorithm's workspace, so each convolution call allocates one


class Launched(NamedTuple):
    """A DeviceArray a kernel launch got, by address only."""

    ptr: int


class Cuda:
    """The fake GPU, and the address of every tensor torch.empty made for device cuda:0
    (addresses only, here and in the recorded launches: a kept reference would make
    autograd copy a gradient it would otherwise take over)."""

    def __init__(self, gpu: FakeGpu, made: list) -> None:
        self.gpu, self.made = gpu, made

    def names(self) -> list[str]:
        return [name for name, _ in self.gpu.calls]

    def call(self, name: str) -> tuple:
        [args] = [a for n, a in self.gpu.calls if n == name]
        return args


def _forget_signatures() -> None:
    """The bridge's per-signature decisions are keyed by the tensors' device, which is the
    CPU's here: none may cross between this file's fake CUDA calls and other tests."""
    for cache in (torch_conv.CALLS, torch_batchnorm.CALLS, _ops._PREPARED, _bn_ops._PREPARED):
        cache.clear()


@pytest.fixture
def cuda(monkeypatch):
    _forget_signatures()
    gpu = FakeGpu(monkeypatch)
    lib = gpu.lib
    gpu.perfs = [lib.AlgoPerf(a, 0, 1.0, WS, lib.CUDNN_DETERMINISTIC, lib.CUDNN_DEFAULT_MATH)
                 for a in (6, 2)]
    gpu.real_handles(monkeypatch)
    gpu.forbid_cupy_arrays(monkeypatch)
    monkeypatch.setattr(fused, "_zero_bias", {})
    clear_batchnorm_plan_cache()
    monkeypatch.setattr(bn_engine, "_affine_defaults", {})
    for name in BN_CALLS:
        monkeypatch.setattr(lib, name, lambda *a, _n=name: gpu.record(_n, a))
    for name, size in SIZES.items():
        monkeypatch.setattr(lib, name, lambda *a, _s=size: _s)
    for name in FakeGpu.LAUNCHERS:  # recorded without the arrays, which keep tensors alive
        monkeypatch.setattr(elementwise, name, lambda *a, _n=name: gpu.calls.append(
            (_n, tuple(Launched(v.ptr) if isinstance(v, DeviceArray) else v for v in a))))
    made = []
    real_empty = torch.empty

    def empty(*shape, dtype=None, device=None, **kw):
        t = real_empty(*shape, dtype=dtype, **kw)
        if device is not None and torch.device(device).type == "cuda":
            made.append(t.data_ptr())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(_arrays, "_current_raw_stream", lambda index: 0xA000 + index)
    monkeypatch.setattr(_arrays, "_current_device", lambda: 0)
    monkeypatch.setattr(_arrays, "CUDA_PATH", "pointer")
    monkeypatch.setattr(_arrays, "_torch_contexts", {})
    # Every plain tensor says it is a CUDA tensor: what the bridge branches on.
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False), raising=False)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0, raising=False)
    yield Cuda(gpu, made)
    clear_batchnorm_plan_cache()
    _forget_signatures()


def _made(cuda: Cuda, t: torch.Tensor) -> bool:
    return t.data_ptr() in cuda.made


@pytest.mark.parametrize("input_grad", [True, False])
def test_conv_forward_and_backward_reach_cudnn_with_the_tensors_addresses(cuda, input_grad):
    conv = cft.Conv2d(4, 6, 3, padding=1, activation="relu")
    x = torch.randn(2, 4, 5, 5, requires_grad=input_grad)
    y = conv(x)
    assert type(y.grad_fn).__name__.startswith("ConvBiasAct")  # the eager node, not the op's
    a = cuda.call("convolutionBiasActivationForward")
    assert (a[3], a[5], a[14], a[17]) == (x.data_ptr(), conv.weight.data_ptr(),
                                         conv.bias.data_ptr(), y.data_ptr())
    assert a[10] == 0.0 and a[12] == y.data_ptr()  # no residual: z = y, alpha2 = 0
    assert a[9] == WS and _made(cuda, y) and tuple(y.shape) == (2, 6, 5, 5)
    cuda.gpu.calls.clear()
    g = torch.randn(2, 6, 5, 5)
    y.backward(g)
    names = cuda.names()
    assert names == ["activation_backward", "convolutionBackwardBias",
                     "convolutionBackwardFilter"] + (["convolutionBackwardData"] * input_grad)
    dy, saved, act, dz = cuda.call("activation_backward")
    assert (dy.ptr, saved.ptr, act) == (g.data_ptr(), y.data_ptr(), "relu")
    bias_args = cuda.call("convolutionBackwardBias")
    filter_args = cuda.call("convolutionBackwardFilter")
    assert bias_args[3] == dz.ptr and bias_args[6] == conv.bias.grad.data_ptr()
    assert (filter_args[3], filter_args[5]) == (x.data_ptr(), dz.ptr)
    assert filter_args[12] == conv.weight.grad.data_ptr()
    if input_grad:
        data_args = cuda.call("convolutionBackwardData")
        assert (data_args[3], data_args[5]) == (conv.weight.data_ptr(), dz.ptr)
        assert data_args[12] == x.grad.data_ptr()
    else:
        assert x.grad is None


def test_conv_identity_residual_passes_the_residual_and_returns_dy_as_its_gradient(cuda):
    conv = cft.Conv2d(3, 3, 1, bias=False)
    x = torch.randn(1, 3, 4, 4)
    res = torch.randn(1, 3, 4, 4, requires_grad=True)
    y = conv(x, res)
    a = cuda.call("convolutionBiasActivationForward")
    assert (a[10], a[12]) == (1.0, res.data_ptr())  # alpha2 = 1, z = the residual
    g = torch.randn(1, 3, 4, 4)
    cuda.gpu.calls.clear()
    y.backward(g)
    assert torch.equal(res.grad, g)  # identity: the residual's gradient is dy
    assert "activation_backward" not in cuda.names()
    assert "convolutionBackwardBias" not in cuda.names()  # no bias: no bias gradient


def test_no_grad_conv_runs_the_body_alone(cuda):
    conv = cft.Conv2d(2, 2, 3, activation="relu")
    x = torch.randn(1, 2, 5, 5)
    with torch.no_grad():
        y = conv(x)
    assert y.grad_fn is None and cuda.names() == ["convolutionBiasActivationForward"]
    assert cuda.call("convolutionBiasActivationForward")[17] == y.data_ptr()


def test_batchnorm_training_and_backward_reach_cudnn_with_the_tensors_addresses(cuda):
    bn = cft.BatchNorm2d(3, activation="relu")
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    y = bn(x)
    assert cuda.names() == ["batchNormalizationForwardTraining", "activation_forward"]
    a = cuda.call("batchNormalizationForwardTraining")
    assert (a[5], a[7]) == (x.data_ptr(), y.data_ptr())
    assert (a[12], a[13]) == (bn.running_mean.data_ptr(), bn.running_var.data_ptr())
    assert int(bn.num_batches_tracked) == 1
    cuda.gpu.calls.clear()
    y.backward(torch.randn(2, 3, 4, 4))
    assert cuda.names() == ["activation_backward", "batchNormalizationBackward"]
    b = cuda.call("batchNormalizationBackward")
    assert (b[7], b[11]) == (x.data_ptr(), x.grad.data_ptr()) and _made(cuda, x.grad)
    assert (b[14], b[15]) == (bn.weight.grad.data_ptr(), bn.bias.grad.data_ptr())


def test_conv_transpose_forward_and_backward_reach_cudnn_with_the_tensors_addresses(cuda):
    """A transposed convolution is its forward convolution G run backwards (plan/
    conv_transpose.py): backward-data for y, forward for dx, backward-filter with the roles
    of x and dy swapped; bias and activation in convfuse's kernels."""
    layer = cft.ConvTranspose2d(3, 2, 3, stride=2, activation="relu")
    x = torch.randn(1, 3, 4, 4, requires_grad=True)
    y = layer(x)
    assert cuda.names() == ["convolutionBackwardData", "bias_act_forward"]
    a = cuda.call("convolutionBackwardData")
    assert (a[3], a[5], a[12]) == (layer.weight.data_ptr(), x.data_ptr(), y.data_ptr())
    assert _made(cuda, y) and tuple(y.shape) == (1, 2, 9, 9)
    cuda.gpu.calls.clear()
    g = torch.randn(1, 2, 9, 9)
    y.backward(g)
    assert cuda.names() == ["activation_backward_bias", "convolutionBackwardFilter",
                            "convolutionForward"]
    dy, saved, act, _, dz, db, _ = cuda.call("activation_backward_bias")
    assert (dy.ptr, saved.ptr, act, db.ptr) == (g.data_ptr(), y.data_ptr(), "relu",
                                                layer.bias.grad.data_ptr())
    f = cuda.call("convolutionBackwardFilter")
    assert (f[3], f[5], f[12]) == (dz.ptr, x.data_ptr(), layer.weight.grad.data_ptr())
    d = cuda.call("convolutionForward")
    assert (d[3], d[5], d[12]) == (dz.ptr, layer.weight.data_ptr(), x.grad.data_ptr())
