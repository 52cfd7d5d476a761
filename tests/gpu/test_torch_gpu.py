"""convfuse.torch on a GPU: PyTorch's stream, zero-copy memory, the cuDNN engine actually
running (convfuse.distributed's NCCL tests are test_distributed_gpu.py's).

References are float64 results of the same layer on the CPU (convfuse's NumPy engine);
outputs land in memory poisoned with NaN first, so a read before the write shows.
Written without a GPU: none of these has run yet.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda():
        yield


def _reference(layer, x, residual=None):
    """The layer's float64 result and input gradient on the CPU (NumPy engine)."""
    ref = copy.deepcopy(layer).cpu().double()
    xr = x.detach().cpu().double().requires_grad_()
    rr = None if residual is None else residual.detach().cpu().double()
    y = ref(xr, rr)
    y.square().sum().backward()
    return y.detach(), xr.grad, ref


def _thread_handle(device):
    """This thread's cuDNN handle for `device`, as the engine left it (handle.py keeps one
    per device and thread), without rebinding its stream."""
    from convfuse.ops.cudnn import handle

    return handle._local.bound[device][0]


def _spy(monkeypatch, module, name, record):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        from convfuse.ops.cudnn.device import context_of

        ctx = context_of(args[0])  # the stream the engine runs on, either path
        # its own entry: an engine function that calls itself again through the module
        # (on_cupy) appends the inner call's entry after this one
        entry = {"stream": ctx.stream_ptr, "args": args, "kwargs": kwargs}
        record.append(entry)
        out = real(*args, **kwargs)
        entry["out"] = out
        # the stream the engine left this thread's handle on: read after the call (asking
        # get_handle(ctx) before it would bind the handle to ctx's stream itself)
        entry["handle_stream"] = _thread_handle(ctx.device).getStream()
        return out

    monkeypatch.setattr(module, name, wrapped)


@pytest.mark.parametrize("channels_last", [False, True])
def test_runs_on_a_non_default_torch_stream(monkeypatch, channels_last):
    import convfuse.ops.cudnn.conv as cudnn_conv
    import convfuse.torch as ct

    calls: list = []
    _spy(monkeypatch, cudnn_conv, "conv_bias_act", calls)
    _spy(monkeypatch, cudnn_conv, "conv_backward_filter", calls)
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    layer = ct.Conv2d(16, 32, 3, padding=1, activation="gelu").cuda().to(memory_format=fmt)
    stream = torch.cuda.Stream()
    # The weights were written on the default stream (.cuda(), and the channels_last
    # conversion is a kernel): the side stream must wait for them, as the caller would.
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # A long producer on the side stream: a race with another stream would read a
        # half-written x.
        x = torch.randn(8, 16, 64, 64, device="cuda")
        for _ in range(20):
            x = torch.sin(x) * 1.5
        x = x.contiguous(memory_format=fmt).requires_grad_()
        poison(8 * 32 * 64 * 64 * 4 * 3)
        y = layer(x)
        y.square().sum().backward()
    stream.synchronize()
    assert calls and all(c["stream"] == stream.cuda_stream for c in calls)
    assert all(c["handle_stream"] == stream.cuda_stream for c in calls)
    y_ref, dx_ref, _ = _reference(layer, x)
    np.testing.assert_allclose(y.detach().cpu().double().numpy(), y_ref.numpy(), rtol=1e-4,
                               atol=1e-4)
    np.testing.assert_allclose(x.grad.cpu().double().numpy(), dx_ref.numpy(), rtol=1e-3,
                               atol=1e-3)


def test_zero_copy_and_pytorch_owns_the_memory(monkeypatch):
    import convfuse.ops.cudnn.conv as cudnn_conv
    import convfuse.torch as ct

    calls: list = []
    _spy(monkeypatch, cudnn_conv, "conv_bias_act", calls)
    layer = ct.Conv2d(8, 8, 3, padding=1, activation="relu").cuda()
    layer = layer.to(memory_format=torch.channels_last)
    x = torch.randn(4, 8, 32, 32, device="cuda").to(memory_format=torch.channels_last)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        y = layer(x)
    x_arr, w_arr = calls[-1]["args"][0], calls[-1]["args"][1]
    assert x_arr.data.ptr == x.data_ptr()              # input: same memory (NHWC view)
    assert w_arr.data.ptr == layer.weight.data_ptr()   # channels_last weight: no copy
    assert calls[-1]["out"][0].data.ptr == y.data_ptr()  # output: the engine's memory
    assert y.is_contiguous(memory_format=torch.channels_last)
    # ...which came from PyTorch's caching allocator (Note [CUDA streams and memory])
    assert torch.cuda.memory_allocated() - before >= y.numel() * y.element_size()
    np.testing.assert_allclose(y.cpu().double().numpy(), _reference(layer, x)[0].numpy(),
                               rtol=1e-4, atol=1e-4)


def test_backward_writes_into_tensors_pytorch_allocated(monkeypatch):
    import convfuse.ops.cudnn.conv as cudnn_conv
    import convfuse.torch as ct

    calls: list = []
    for name in ("conv_backward_data", "conv_backward_filter", "conv_backward_bias"):
        _spy(monkeypatch, cudnn_conv, name, calls)
    layer = ct.Conv2d(4, 8, 3, padding=1).cuda().double()
    x = torch.randn(2, 4, 16, 16, device="cuda", dtype=torch.float64, requires_grad=True)
    layer(x).square().sum().backward()
    assert len(calls) == 3
    # The ops hand the engine `out` positionally: (dz, w, geom, out, beta),
    # (x, dz, geom, out, beta), (dz, geom, out, beta). Each is a tensor PyTorch allocated.
    outs = [c["args"][3] if len(c["args"]) == 5 else c["args"][2] for c in calls]
    assert all(o is not None and o.data.ptr == r.data.ptr for o, r in
               zip(outs, (c["out"] for c in calls)))
    _, dx_ref, ref = _reference(layer, x)
    np.testing.assert_allclose(x.grad.cpu().numpy(), dx_ref.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(layer.bias.grad.cpu().numpy(), ref.bias.grad.numpy(),
                               rtol=1e-10, atol=1e-10)


def test_a_view_at_an_odd_offset_is_copied_not_refused():
    import convfuse.torch as ct

    layer = ct.Conv1d(3, 4, 3).cuda()
    flat = torch.randn(1 + 2 * 3 * 10, device="cuda")
    x = flat[1:].view(2, 3, 10)  # 4 bytes past an aligned block: convfuse's ops refuse it
    assert x.data_ptr() % 16 and x.is_contiguous()
    y = layer(x)
    np.testing.assert_allclose(y.detach().cpu().double().numpy(),
                               _reference(layer, x)[0].numpy(), rtol=1e-4, atol=1e-4)


def test_bfloat16_crosses_dlpack_on_cuda():
    import convfuse.torch as ct

    layer = ct.Conv2d(8, 8, 3, padding=1, activation="silu").cuda().to(torch.bfloat16)
    x = torch.randn(2, 8, 16, 16, device="cuda").to(torch.bfloat16)
    residual = torch.randn(2, 8, 16, 16, device="cuda").to(torch.bfloat16)
    y = layer(x, residual)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y_ref = _reference(layer, x, residual)[0]
    np.testing.assert_allclose(y.float().cpu().double().numpy(), y_ref.numpy(), rtol=3e-2,
                               atol=3e-2)


# --- issue 19: a drop-in for torch.nn on the GPU ------------------------------------------

@pytest.fixture
def _no_torch_tf32():
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_memory_formats_and_in_place_ops_match_torch_nn_on_cuda(monkeypatch, rank, dtype,
                                                                _no_torch_tf32):
    """torch.nn on CUDA (cuDNN's memory-format rule: channels-last for non-float64 4-d and
    5-d, never for float64) decides the output format; ours is an ordinary tensor in it,
    in-place ops record under autograd, and the cuDNN engine ran."""
    import convfuse.ops.cudnn.conv as cudnn_conv
    import convfuse.torch as ct

    calls: list = []
    _spy(monkeypatch, cudnn_conv, "conv_bias_act", calls)
    torch.manual_seed(0)
    cls = {1: (ct.Conv1d, torch.nn.Conv1d), 2: (ct.Conv2d, torch.nn.Conv2d),
           3: (ct.Conv3d, torch.nn.Conv3d)}[rank]
    ours = cls[0](4, 8, 3, padding=1, dtype=dtype, device="cuda")
    theirs = cls[1](4, 8, 3, padding=1, dtype=dtype, device="cuda")
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 4, *[6] * rank, dtype=dtype, device="cuda")
    x = x.movedim(1, -1).contiguous().movedim(-1, 1)  # channels-last strides at any rank
    poison(x.numel() * 8 * 8)
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    yo, yt = ours(xo).relu_(), theirs(xt).relu_()
    assert yo._base is None and yo.stride() == yt.stride()
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(yo, yt, rtol=tol, atol=tol)
    yo.square().sum().backward()
    yt.square().sum().backward()
    torch.testing.assert_close(xo.grad, xt.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=10 * tol,
                               atol=10 * tol)
    assert calls and calls[-1]["stream"] == torch.cuda.current_stream().cuda_stream


@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
def test_padding_modes_same_unbatched_and_empty_batches_on_cuda(mode, _no_torch_tf32):
    import convfuse.torch as ct

    torch.manual_seed(0)
    ours = ct.Conv2d(3, 6, 4, padding="same", padding_mode=mode, device="cuda")
    theirs = torch.nn.Conv2d(3, 6, 4, padding="same", padding_mode=mode, device="cuda")
    theirs.load_state_dict(ours.state_dict())
    for shape in ((2, 3, 7, 9), (3, 7, 9), (0, 3, 7, 9)):
        x = torch.randn(shape, device="cuda")
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = ours(xo), theirs(xt)
        assert yo.shape == yt.shape
        torch.testing.assert_close(yo, yt, rtol=1e-4, atol=1e-4)
        yo.sum().backward()
        yt.sum().backward()
        torch.testing.assert_close(xo.grad, xt.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-3,
                                   atol=1e-3)
        ours.zero_grad()
        theirs.zero_grad()


def test_converted_basic_block_channels_last_on_cuda(_no_torch_tf32):
    """torchvision's BasicBlock as written there (ReLU(inplace=True), `out += identity`),
    converted, in channels_last, train then eval: equal to the unconverted block."""
    import convfuse.torch as ct

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv2d(16, 16, 3, 1, 1, bias=False)
            self.bn1 = torch.nn.BatchNorm2d(16)
            self.relu = torch.nn.ReLU(inplace=True)
            self.conv2 = torch.nn.Conv2d(16, 16, 3, 1, 1, bias=False)
            self.bn2 = torch.nn.BatchNorm2d(16)

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += x
            return self.relu(out)

    torch.manual_seed(0)
    ref = Block().cuda().to(memory_format=torch.channels_last)
    model = ct.convert(copy.deepcopy(ref))
    assert isinstance(model.conv1, ct.Conv2d) and isinstance(model.bn2, ct.BatchNorm2d)
    for training in (True, True, False):
        ref.train(training)
        model.train(training)
        x = torch.randn(4, 16, 12, 12, device="cuda").to(memory_format=torch.channels_last)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr, ym = ref(xr), model(xm)
        assert ym.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(ym, yr, rtol=1e-4, atol=1e-4)
        yr.square().sum().backward()
        ym.square().sum().backward()
        torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-3, atol=1e-3)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3, msg=name)
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-4, atol=1e-5, msg=name)
