"""convfuse.torch's two CUDA call paths on a GPU (Note [the torch pointer path] in
convfuse/torch/_arrays.py): the default pointer path (DeviceArrays on PyTorch's raw
stream, torch.empty outputs, workspace from PyTorch's cache) and the "cupy" path kept to
compare (CuPy arrays through DLPack). Both must give torch.nn's float64 numbers, and the
pointer path must be the one taken by default: DeviceArrays reach the engine on
PyTorch's stream, and no DLPack exchange happens outside its documented fallbacks.

References are torch.nn's float64 results on the CPU; PyTorch's cache is poisoned with
NaN before each step, so an output read before it is written shows. Written without a
GPU: none of these has run yet.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests.gpu._torch_gpu import exact_cuda, poison, replay_on_new_input  # noqa: E402

PATHS = ["pointer", "cupy"]


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda():
        yield


@pytest.fixture
def path_spy(monkeypatch):
    """Select a path (`use(name)`) and record what the cuDNN engine receives and every
    DLPack exchange."""
    import cupy

    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.ops.cudnn.conv as cudnn_conv
    from convfuse.ops.cudnn.device import context_of
    from convfuse.torch import _arrays

    seen = {"engine": [], "dlpack": 0}
    depth = [0]  # a fallback calls the engine function again on CuPy views: not recorded
    for module, names in ((cudnn_conv, ("conv_bias_act", "conv_backward_data",
                                        "conv_backward_filter", "conv_backward_bias")),
                          (cudnn_bn, ("batchnorm_forward_training", "batchnorm_backward",
                                      "batchnorm_forward_inference"))):
        for name in names:
            real = getattr(module, name)

            def wrapped(*args, _real=real, _name=name, **kwargs):
                if not depth[0]:
                    ctx = context_of(args[0])
                    seen["engine"].append((_name, type(args[0]).__name__, ctx.stream_ptr))
                depth[0] += 1
                try:
                    return _real(*args, **kwargs)
                finally:
                    depth[0] -= 1

            monkeypatch.setattr(module, name, wrapped)
    for module, name in ((cupy, "from_dlpack"), (torch, "from_dlpack")):
        real = getattr(module, name)

        def counted(*args, _real=real, **kwargs):
            seen["dlpack"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    def use(name):
        monkeypatch.setattr(_arrays, "CUDA_PATH", name)

    seen["use"] = use
    return seen


def _assert_path(seen, path, stream_ptr, fallback=False):
    """The engine got `path`'s arrays on `stream_ptr`; the pointer path exchanged nothing
    through DLPack unless a documented CuPy fallback may have run (`fallback`)."""
    want = "DeviceArray" if path == "pointer" else "ndarray"
    assert seen["engine"], "the cuDNN engine never ran"
    assert all(kind == want for _, kind, _ in seen["engine"]), seen["engine"]
    assert all(s == stream_ptr for *_, s in seen["engine"]), seen["engine"]
    if path == "cupy":
        assert seen["dlpack"] > 0
    elif not fallback:
        assert seen["dlpack"] == 0


def _close(got, want, dtype):
    tol = 1e-10 if dtype == torch.float64 else 2e-4
    np.testing.assert_allclose(got.detach().cpu().double().numpy(), want.detach().numpy(),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_conv_relu_matches_torch_nn(path_spy, path, dtype, channels_last):
    """A float64 channels-last convolution, should the bridge run it channels-last, takes
    the pointer path's CuPy fallback (Note [float64 runs channels-first]): the engine
    still gets DeviceArrays, and hands CuPy views of them to CuPy itself."""
    import convfuse.torch as ct

    path_spy["use"](path)
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = torch.nn.Conv2d(8, 16, 3, padding=1).double()
    layer = ct.Conv2d(8, 16, 3, padding=1, activation="relu")
    layer.load_state_dict(ref.state_dict())
    layer = layer.to("cuda", dtype).to(memory_format=fmt)
    x_ref = torch.randn(4, 8, 20, 20, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().to("cuda", dtype).contiguous(memory_format=fmt).requires_grad_()
    poison(4 * 16 * 20 * 20 * 8 * 4)
    y = layer(x)
    y.square().sum().backward()
    torch.cuda.synchronize()
    y_ref = torch.relu(ref(x_ref))
    y_ref.square().sum().backward()
    _close(y, y_ref, dtype)
    _close(x.grad, x_ref.grad, dtype)
    _close(layer.weight.grad, ref.weight.grad, dtype)
    _close(layer.bias.grad, ref.bias.grad, dtype)
    _assert_path(path_spy, path, torch.cuda.current_stream().cuda_stream,
                 fallback=dtype == torch.float64 and channels_last)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batchnorm_train_and_eval_match_torch_nn(path_spy, path, dtype):
    import convfuse.torch as ct

    path_spy["use"](path)
    torch.manual_seed(1)
    ref = torch.nn.BatchNorm2d(8).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    layer = ct.BatchNorm2d(8)
    layer.load_state_dict(ref.state_dict())
    layer = layer.to("cuda", dtype)
    x_ref = torch.randn(4, 8, 6, 6, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().to("cuda", dtype).requires_grad_()
    poison(4 * 8 * 6 * 6 * 8 * 4)
    y = layer(x)
    y.square().sum().backward()
    y_ref = ref(x_ref)
    y_ref.square().sum().backward()
    torch.cuda.synchronize()
    _close(y, y_ref, dtype)
    _close(x.grad, x_ref.grad, dtype)
    _close(layer.weight.grad, ref.weight.grad, dtype)
    _close(layer.running_var, ref.running_var, dtype)
    _assert_path(path_spy, path, torch.cuda.current_stream().cuda_stream)
    layer.eval()
    ref.eval()
    path_spy["engine"].clear()
    exchanges = path_spy["dlpack"]
    poison(4 * 8 * 6 * 6 * 8 * 4)
    with torch.no_grad():
        _close(layer(x), ref(x_ref), dtype)
    assert [name for name, *_ in path_spy["engine"]] == ["batchnorm_forward_inference"]
    if path == "pointer":  # Note [inference without statistics]: no CuPy scope, no DLPack
        assert path_spy["dlpack"] == exchanges


def test_pointer_path_runs_on_a_side_stream_with_torch_memory(path_spy):
    """The engine's stream is PyTorch's current one, and outputs are PyTorch's tensors
    (torch.cuda.memory_allocated grows by them)."""
    import convfuse.torch as ct

    path_spy["use"]("pointer")
    layer = ct.Conv2d(8, 8, 3, padding=1, activation="relu").cuda()
    ref = copy.deepcopy(layer).cpu().double()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x = torch.randn(2, 8, 64, 64, device="cuda")
        for _ in range(20):  # a long producer: a race with another stream shows
            x = torch.sin(x) * 1.5
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = layer(x)
        grown = torch.cuda.memory_allocated() - before
    stream.synchronize()
    assert grown >= y.numel() * y.element_size()
    _assert_path(path_spy, "pointer", stream.cuda_stream)
    with torch.no_grad():
        y_ref = ref(x.cpu().double())
    np.testing.assert_allclose(y.cpu().double().numpy(), y_ref.numpy(), rtol=1e-4, atol=1e-4)


def test_pointer_path_under_torch_cuda_graph_capture(path_spy):
    """Workspace and outputs from PyTorch's allocator on the capture's stream (its graph
    pool), the handle bound to the capture stream, cached constants waited on externally:
    the captured forward + backward replays with eager numbers."""
    import convfuse.torch as ct

    path_spy["use"]("pointer")
    torch.manual_seed(2)
    layer = ct.Conv2d(8, 16, 3, padding=1, bias=False, activation="relu").cuda()
    static_x = torch.randn(4, 8, 16, 16, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans, algorithms, the cached zero bias
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            layer(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = layer(static_x)
        static_y.square().sum().backward()
    new_x, got_y, got_dx = replay_on_new_input(graph, static_x, static_y)
    x = new_x.detach().clone().requires_grad_()
    y = layer(x)
    y.square().sum().backward()
    torch.cuda.synchronize()
    np.testing.assert_allclose(got_y.cpu().numpy(), y.detach().cpu().numpy(), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(got_dx.cpu().numpy(), x.grad.cpu().numpy(), rtol=1e-5,
                               atol=1e-5)
    assert all(kind == "DeviceArray" for _, kind, _ in path_spy["engine"])
