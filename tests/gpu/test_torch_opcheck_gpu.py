"""torch.library.opcheck of every convfuse custom op on CUDA tensors: the schema, the
autograd registration, the fake implementations' shapes and strides against what the CUDA
bodies return, and AOT dispatch (torch.compile's path). The CPU suite checks the same ops
on CPU tensors (tests/test_torch_conv.py, test_torch_batchnorm.py,
test_torch_double_backward.py); what only a GPU runs is what the CUDA bodies hand back: a
bound call's output tensor, views of the caching allocator's blocks (`adopt`), the fused
cuDNN batch norm's saved output, float64 channels-last convolutions run through CuPy, a
windowed transposed convolution. Each op runs twice before its check, so the second call
and opcheck's own take the bound path where there is one. Deterministic algorithms and
TF32 off, so that AOT dispatch's rerun reproduces the eager numbers. Written without a
GPU: none of these has run yet.
"""

from __future__ import annotations

import pytest

import convfuse as cf

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import convfuse.torch  # noqa: E402  (registers torch.ops.convfuse)
from tests._engine_calls import forget_signatures  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda  # noqa: E402

ops = torch.ops.convfuse


@pytest.fixture(autouse=True)
def _cuda_torch():
    forget_signatures()
    with exact_cuda(), cf.config.flags(deterministic=True):
        yield


def _rand(*shape, dtype=torch.float32, channels_last=False):
    t = torch.randn(*shape, dtype=dtype, device="cuda")
    if channels_last:
        t = t.movedim(1, -1).contiguous().movedim(-1, 1)
    return t


def _check(op, args):
    """op twice (its first call plans and binds), then opcheck."""
    op(*args)
    op(*args)
    torch.library.opcheck(op, args)


# (dtype, rank, channels_last, activation, with a residual)
CONV_CASES = [
    (torch.float32, 2, False, "relu", True),    # the fused call, bound from the 2nd call
    (torch.float16, 2, True, "identity", False),  # the forced IDENTITY algorithm, NHWC
    (torch.float64, 3, True, "silu", False),    # float64 channels-last: through CuPy
    (torch.float32, 1, False, "gelu", False),   # Conv1d, lifted to 2-D
]


@pytest.mark.parametrize(("dtype", "rank", "cl", "act", "res"), CONV_CASES)
def test_the_convolution_ops_on_cuda(dtype, rank, cl, act, res):
    x = _rand(2, 4, *[6] * rank, dtype=dtype, channels_last=cl)
    w = _rand(8, 4, *[3] * rank, dtype=dtype, channels_last=cl)
    b = _rand(8, dtype=dtype)
    hyper = ([1] * rank, [1] * rank, [1] * rank, 1)
    r = _rand(*x.shape[:1], 8, *x.shape[2:], dtype=dtype, channels_last=cl) if res else None
    _check(ops.conv_bias_act.default, (x, w, b, r, *hyper, act))
    y, z = ops.conv_bias_act(x, w, b, r, *hyper, act)
    saved = {"relu": y, "identity": None}.get(act, z)
    _check(ops.conv_bias_act_backward.default,
           (torch.randn_like(y), x, w, saved, *hyper, act, True, True, True, True))


@pytest.mark.parametrize(("stride", "output_padding", "cl"), [(2, 1, False), (3, 2, True)])
def test_the_transposed_convolution_ops_on_cuda(stride, output_padding, cl):
    """Transposed convolutions, among them outputs G's input does not cover (an
    output_padding the windowed copy fills)."""
    x = _rand(2, 4, 5, 5, channels_last=cl)
    w = _rand(4, 6, 3, 3, channels_last=cl)
    b = _rand(6)
    hyper = ([stride] * 2, [1, 1], [output_padding] * 2, [1, 1], 1)
    _check(ops.conv_transpose_bias_act.default, (x, w, b, None, *hyper, "relu"))
    y, _ = ops.conv_transpose_bias_act(x, w, b, None, *hyper, "relu")
    _check(ops.conv_transpose_bias_act_backward.default,
           (torch.randn_like(y), x, w, y, *hyper, "relu", True, True, True, True))


def test_the_gradient_primitives_on_cuda():
    x, w = _rand(2, 3, 5, 5, channels_last=True), _rand(4, 3, 3, 3)
    dz = _rand(2, 4, 3, 3, channels_last=True)
    hyper = ([1, 1], [0, 0], [1, 1], 1)
    _check(ops.conv_forward.default, (x, w, *hyper))
    _check(ops.conv_data_grad.default, (dz, w, [2, 3, 5, 5], *hyper))
    _check(ops.conv_filter_grad.default, (x, dz, [4, 3, 3, 3], *hyper))
    _check(ops.activation_grad.default, (dz, _rand(2, 4, 3, 3), "gelu"))


# (dtype, channels_last, activation, with a residual): the first is cuDNN's fused
# BN + add + ReLU (packed NHWC half, C % 4 == 0), whose output is also its saved tensor
BN_CASES = [(torch.float16, True, "relu", True), (torch.float32, False, "identity", False),
            (torch.bfloat16, True, "silu", False)]


@pytest.mark.parametrize(("dtype", "cl", "act", "res"), BN_CASES)
def test_the_batch_norm_ops_on_cuda(dtype, cl, act, res):
    x = _rand(4, 8, 5, 5, dtype=dtype, channels_last=cl)
    w, b = torch.rand(8, device="cuda", dtype=dtype) + 0.5, _rand(8, dtype=dtype)
    rm = torch.zeros(8, device="cuda", dtype=dtype)
    rv = torch.ones(8, device="cuda", dtype=dtype)
    r = torch.randn_like(x) if res else None
    nbt = torch.tensor(1, device="cuda")
    _check(ops.batchnorm_training.default, (x, w, b, rm, rv, r, nbt, None, 1e-5, act))
    _check(ops.batchnorm_inference.default, (x, w, b, rm, rv, r, 1e-5, act))
    y, mean, invstd, z = ops.batchnorm_training(x, w, b, None, None, r, None, 0.1, 1e-5, act)
    saved = {"relu": y, "identity": None}.get(act, z)
    _check(ops.batchnorm_backward.default,
           (torch.randn_like(x), x, w, b, saved, mean, invstd, True, 1e-5, act, True, res))
