"""convfuse.torch.ConvTranspose on a GPU: the cuDNN engine runs on PyTorch's tensors and
stream, results equal the float64 CPU result of the same layer (NumPy engine) and
torch.nn's, in both memory formats, under autocast, double backward and torch.compile.
Written without a GPU: none of these has run yet."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda():
        yield


def _layers(act="relu", rank=2):
    torch.manual_seed(0)
    nn_cls = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d,
              3: torch.nn.ConvTranspose3d}[rank]
    ct_cls = {1: ct.ConvTranspose1d, 2: ct.ConvTranspose2d, 3: ct.ConvTranspose3d}[rank]
    ref = nn_cls(8, 6, 4, 2, 1, 0, 2)
    ours = ct_cls(8, 6, 4, 2, 1, 0, 2, activation=act)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_a_windowed_transposed_convs_output_takes_in_place_ops():
    """output_padding >= stride (allowed below the dilation) makes G's output larger than
    the layer's (Note [transposed convolution as a swapped convolution]): the output is
    cut from it with CuPy and adopted from PyTorch's cache, and must come back no autograd
    view, so that y += r and y.relu_() work as on torch.nn's."""
    torch.manual_seed(0)
    ref = torch.nn.ConvTranspose2d(3, 4, 3, stride=1, dilation=2, output_padding=1).cuda()
    ours = ct.ConvTranspose2d(3, 4, 3, stride=1, dilation=2, output_padding=1).cuda()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 5, 5, device="cuda", requires_grad=True)
    y, want = ours(x), ref(x)
    assert not y._is_view() and y.shape == want.shape
    y += 1.0
    y.relu_()
    want = (want + 1.0).relu()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    g = x.grad.clone()
    x.grad = None
    want.sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", ["identity", "relu", "gelu"])
def test_matches_float64_cpu_and_torch_nn(rank, channels_last, act):
    ref, ours = _layers(act, rank)
    x = torch.randn(2, 8, *[6, 5, 4][:rank])
    res = torch.randn(2, 6, *[12, 10, 8][:rank])
    cpu64 = copy.deepcopy(ours).double()
    x64 = x.double().requires_grad_()
    y64 = cpu64(x64, residual=res.double())
    dy = torch.randn(y64.shape)
    y64.backward(dy.double())
    ours = ours.cuda()
    xg = x.cuda()
    if channels_last and rank > 1:
        xg = xg.to(memory_format=torch.channels_last if rank == 2 else torch.channels_last_3d)
    xg.requires_grad_()
    y = ours(xg, residual=res.cuda())
    y.backward(dy.cuda())
    torch.testing.assert_close(y.double().cpu(), y64, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(xg.grad.double().cpu(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.weight.grad.double().cpu(), cpu64.weight.grad,
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.bias.grad.double().cpu(), cpu64.bias.grad,
                               rtol=1e-4, atol=1e-4)
    nn_act = {"identity": lambda t: t, "relu": torch.relu,
              "gelu": torch.nn.functional.gelu}[act]
    y_nn = nn_act(ref.cuda()(xg) + res.cuda())
    torch.testing.assert_close(y, y_nn, rtol=1e-4, atol=1e-4)
    if channels_last and rank > 1:
        assert not y.is_contiguous() and not y._is_view()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_as_torch_nn(dtype):
    ref, ours = _layers(None)
    ref, ours = ref.cuda(), ours.cuda()
    x = torch.randn(2, 8, 6, 6, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y_ref, y = ref(x), ours(x)
    assert y.dtype == y_ref.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)


def test_double_backward_on_the_gpu():
    _, ours = _layers("tanh")
    ours = ours.double().cuda()
    x = torch.randn(1, 8, 3, 3, dtype=torch.float64, device="cuda", requires_grad=True)
    # cuDNN's BackwardData and BackwardFilter algorithms may accumulate with atomics: two
    # runs need not agree to the last bit (as in test_torch_autocast_gpu.py)
    assert torch.autograd.gradgradcheck(lambda x, w: ours(x), (x, ours.weight),
                                        nondet_tol=1e-12)


@pytest.mark.timeout(240)  # an Inductor compile on a cold cache: tens of seconds
def test_compile_fullgraph_on_the_gpu():
    _, ours = _layers("relu")
    model = torch.nn.Sequential(ours, ct.ConvTranspose2d(6, 2, 2, 2, activation="silu")).cuda()
    x = torch.randn(2, 8, 6, 6, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, model(x))
