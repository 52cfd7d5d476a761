"""convfuse.torch.BatchNorm*d on a GPU: PyTorch's stream, zero-copy memory, the cuDNN engine
actually running, running statistics updated in place, and the fused-forward /
plain-backward pairing (Note [what the backward reuses] in convfuse/torch/_bn_ops.py).

References are float64 results of the same layer on the CPU (convfuse's NumPy engine);
the caching allocator is poisoned with NaN first, so a read before a write shows.
Written without a GPU: none of these has run yet.
"""

from __future__ import annotations

import copy
import warnings

import pytest

from convfuse.plan.batchnorm import get_batchnorm_plan
from convfuse.plan.conv import FusedFallbackWarning

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda():
        yield


def _spy(monkeypatch, module, name, record):
    real = getattr(module, name)

    def wrapped(*args, **kwargs):
        from convfuse.ops.cudnn import handle
        from convfuse.ops.cudnn.device import context_of

        ctx = context_of(args[0])  # the stream the engine runs on, either path
        # its own entry: an engine function that calls itself again through the module
        # (on_cupy) appends the inner call's entry after this one
        entry = {"name": name, "stream": ctx.stream_ptr, "args": args}
        record.append(entry)
        out = real(*args, **kwargs)
        entry["out"] = out
        # the stream the engine left this thread's handle on, read after the call (asking
        # get_handle(ctx) first would bind it to ctx's stream itself)
        entry["handle_stream"] = handle._local.bound[ctx.device][0].getStream()
        return out

    monkeypatch.setattr(module, name, wrapped)


def _step_reference(layer, xs, residual=None):
    """float64 outputs, input gradients, parameter gradients and buffers of `layer` on the
    CPU over the batches `xs` (one training step each, then the layer as left)."""
    ref = copy.deepcopy(layer).cpu().double()
    outs = []
    for x in xs:
        xr = x.detach().cpu().double().requires_grad_()
        rr = None if residual is None else residual.detach().cpu().double()
        y = ref(xr, rr)
        y.square().sum().backward()
        outs.append((y.detach(), xr.grad))
    return outs, ref


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["m0.1", "cma"])
def test_runs_cudnn_on_a_non_default_stream(monkeypatch, channels_last, momentum):
    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.torch as ct

    calls: list = []
    for name in ("batchnorm_forward_training", "batchnorm_backward"):
        _spy(monkeypatch, cudnn_bn, name, calls)
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    layer = ct.BatchNorm2d(16, momentum=momentum, activation="silu").cuda()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
    xs = [torch.randn(8, 16, 12, 12, device="cuda").to(memory_format=fmt) * 3 + 1
          for _ in range(2)]
    want, ref = _step_reference(layer, xs)
    rm_ptr = layer.running_mean.data_ptr()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # xs and the layer are ready
    for x, (y_ref, dx_ref) in zip(xs, want):
        with torch.cuda.stream(stream):
            poison(8 * 16 * 12 * 12 * 4 * 4)  # the caching allocator pools per stream
            torch.cuda._sleep(10_000_000)  # a long producer: a race would read stale x
            xx = (x * 1.0).requires_grad_()
            y = layer(xx)
            y.square().sum().backward()
        stream.synchronize()
        torch.testing.assert_close(y.double().cpu(), y_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(xx.grad.double().cpu(), dx_ref, rtol=1e-3, atol=1e-3)
        assert y.is_contiguous(memory_format=fmt)
    assert [c["name"] for c in calls] == ["batchnorm_forward_training", "batchnorm_backward"] * 2
    for c in calls:  # convfuse's handle and CuPy ran on PyTorch's side stream
        assert c["stream"] == stream.cuda_stream == c["handle_stream"]
    assert layer.running_mean.data_ptr() == rm_ptr  # updated in place
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(layer, name).double().cpu(),
                                   getattr(ref, name).double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double().cpu(), ref.weight.grad,
                               rtol=1e-3, atol=1e-3)


def test_channels_last_is_zero_copy_on_the_gpu(monkeypatch):
    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.torch as ct

    calls: list = []
    _spy(monkeypatch, cudnn_bn, "batchnorm_forward_inference", calls)
    layer = ct.BatchNorm2d(8).cuda().eval()
    x = torch.randn(2, 8, 5, 5, device="cuda").to(memory_format=torch.channels_last)
    y = layer(x)
    xa, g = calls[0]["args"][0], calls[0]["args"][5]
    assert xa.data.ptr == x.data_ptr() and g.layout == "NHWC"
    assert calls[0]["out"][0].data.ptr == y.data_ptr()  # PyTorch owns convfuse's output


def test_fused_forward_then_exact_plain_backward_half_nhwc(monkeypatch):
    """float16 NHWC relu with C % 4 == 0 is cuDNN's documented fused BN case: the forward
    may run BN_ADD_ACTIVATION; the residual's gradient is not asked for, so the backward's
    plan is not the forward's and the bridge hands it no reserve space (Note [the fused
    backward on the eager path]): the plain path (engine_state None), which must still be
    exact."""
    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.torch as ct

    calls: list = []
    for name in ("batchnorm_forward_training", "batchnorm_backward"):
        _spy(monkeypatch, cudnn_bn, name, calls)
    torch.manual_seed(0)
    layer = ct.BatchNorm2d(16, activation="relu", dtype=torch.float32).cuda()
    x = torch.randn(4, 16, 8, 8, device="cuda").half().to(memory_format=torch.channels_last)
    r = torch.randn_like(x)
    want, ref = _step_reference(layer, [x], r)
    xx = x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FusedFallbackWarning)  # asserted through the plan
        y = layer(xx, r)
    y.float().square().sum().backward()
    fused = calls[0]["out"][4].fused  # the engine's EngineState of the forward
    xa, g = calls[0]["args"][0], calls[0]["args"][5]
    plan = get_batchnorm_plan(g, xa.dtype, "relu", True)
    assert fused != plan.fell_back  # fused, or cuDNN refused / memory ran short (recorded)
    assert calls[1]["args"][4].engine_state is None  # the plain backward
    torch.testing.assert_close(y.double().cpu(), want[0][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xx.grad.double().cpu(), want[0][1], rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(layer.running_var.double().cpu(), ref.running_var,
                               rtol=1e-3, atol=1e-3)


def test_bfloat16_crosses_dlpack_natively_and_matches():
    import convfuse.torch as ct

    torch.manual_seed(0)
    layer = ct.BatchNorm3d(4, activation="relu", dtype=torch.bfloat16).cuda()
    x = torch.randn(2, 4, 3, 4, 5, device="cuda", dtype=torch.bfloat16)
    want, ref = _step_reference(layer, [x])
    xx = x.clone().requires_grad_()
    y = layer(xx)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and layer.running_mean.dtype == torch.bfloat16
    torch.testing.assert_close(y.double().cpu(), want[0][0], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(layer.running_mean.double().cpu(), ref.running_mean,
                               rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["m0.1", "cma"])
def test_training_step_has_no_host_sync_and_captures_in_a_cuda_graph(momentum):
    """Issue 18, 7.3: num_batches_tracked stays on the device (Note [the cumulative average
    on the device]): torch's sync debug mode raises on any device-to-host sync during
    eager training steps, and a torch.cuda.graph capture of forward + backward replays to
    the same running statistics as eager steps (float64 CPU reference)."""
    import convfuse.torch as ct

    torch.manual_seed(0)
    bn = ct.BatchNorm2d(8, momentum=momentum, activation="relu").cuda()
    ref = copy.deepcopy(bn).cpu().double()
    xs = [torch.randn(4, 8, 6, 6, device="cuda") for _ in range(4)]
    # eager warm-up steps on a side stream (torch.cuda.graph's rule), no host sync allowed
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x in xs[:2]:
                bn(x.requires_grad_()).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    static_x = torch.empty_like(xs[0]).requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = bn(static_x)
        static_y.sum().backward()
    # the capture itself ran no real step; replay the remaining batches through it
    for x in xs[2:]:
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    for x in xs:
        y_ref = ref(x.detach().cpu().double())
    # the captured forward's kernels (the count's add_ included) run on each replay
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 4
    torch.testing.assert_close(static_y.detach().double().cpu(), y_ref.detach(),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bn.running_mean.double().cpu(), ref.running_mean,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(bn.running_var.double().cpu(), ref.running_var,
                               rtol=1e-4, atol=1e-5)
