"""The eager path's CUDA branch (Note [call plans] in convfuse/torch/_call_plan.py, Note [the
torch pointer path] in _arrays.py), layer to binding, on tests/_fake_cuda.py's fake device:
a layer call takes the path it takes on a GPU (one autograd node, no custom op, no
DLPack), so this checks without a device that cuDNN gets the tensors' own addresses and
that the gradients autograd hands out are the very tensors cuDNN was told to write.
tests/gpu/test_torch_pointer_path_gpu.py checks the numbers on a device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")

import convfuse.torch as cft  # noqa: E402
from convfuse.plan.batchnorm import clear_batchnorm_plan_cache  # noqa: E402
from tests._fake_cuda import WS, Cuda, forget_signatures, install  # noqa: E402


@pytest.fixture
def cuda(monkeypatch):
    yield install(monkeypatch)
    clear_batchnorm_plan_cache()
    forget_signatures()


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


def test_a_bias_at_an_odd_address_is_copied_once_not_refused(cuda):
    """A bias that is a view into a larger buffer at an offset the GPU ops refuse (a
    flattened parameter buffer) crosses as an aligned copy, as x and the weight would."""
    from convfuse.ops._checks import ALIGNMENT

    conv = cft.Conv2d(2, 3, 1, activation="relu")
    flat = torch.randn(8)
    with torch.no_grad():
        conv.bias = torch.nn.Parameter(flat[1:4])
    assert conv.bias.data_ptr() % ALIGNMENT != 0
    before = conv.bias.detach().clone()
    y = conv(torch.randn(1, 2, 3, 3))
    a = cuda.call("convolutionBiasActivationForward")
    assert a[14] % ALIGNMENT == 0 and a[14] != conv.bias.data_ptr()
    assert torch.equal(conv.bias.detach(), before)
    y.backward(torch.randn(1, 3, 3, 3))
    assert conv.bias.grad.shape == (3,)


def test_batchnorm_inference_without_autograd_runs_on_pointers_alone(cuda):
    """Note [inference without statistics]: an evaluation-mode call nothing differentiates
    is one cuDNN call on the tensors' addresses, with no CuPy scope (the fake forbids CuPy
    arrays) and no statistics computed."""
    bn = cft.BatchNorm2d(3).eval()
    x = torch.randn(2, 3, 4, 4)
    for _ in range(2):  # checked, then the validated entry
        cuda.gpu.calls.clear()
        with torch.no_grad():  # (its parameters require grad)
            y = bn(x)
        assert cuda.names() == ["batchNormalizationForwardInference"]
        a = cuda.call("batchNormalizationForwardInference")
        assert (a[5], a[7]) == (x.data_ptr(), y.data_ptr()) and _made(cuda, y)
        assert (a[11], a[12]) == (bn.running_mean.data_ptr(), bn.running_var.data_ptr())


@pytest.mark.parametrize("act", ["relu", "identity"])
def test_an_empty_batch_of_a_transposed_convolution_is_torchs_own(cuda, act):
    """N = 0 makes no cuDNN call and no CuPy array (install() forbids them): torch's own
    transposed convolution gives the empty output and zero parameter gradients, as Conv's
    empty batch does (the engine's empty-batch op would make CuPy arrays, which the
    pointer path's backward could not take)."""
    layer = cft.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1,
                                activation=act)
    x = torch.randn(0, 4, 5, 5, requires_grad=True)
    y = layer(x)
    assert tuple(y.shape) == (0, 6, 10, 10)
    y.sum().backward()
    assert cuda.gpu.calls == []
    assert tuple(x.grad.shape) == (0, 4, 5, 5)
    assert not layer.weight.grad.any() and not layer.bias.grad.any()
