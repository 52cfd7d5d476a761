"""convfuse.torch layers inside CUDA graphs: torch.cuda.graph, make_graphed_callables and
torch.compile(mode="reduce-overhead") capture a conv + BatchNorm + residual block's forward
and backward, and replays with new inputs copied into the static ones give what eager
convfuse and torch.nn give. No call syncs: a capture fails on any synchronising call or
host read, and torch's sync debug mode turns one outside a capture into an error.

References: the same block run eagerly (convfuse, cuDNN) and a torch.nn twin with the same
parameters, in float64 (tight) and float32 (allow_tf32 off); the allocator is poisoned
with NaN before each capture, so a read of memory the graph never wrote shows.
Written without a GPU: none of these has run yet.
"""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402

TOL = {torch.float64: {"rtol": 1e-9, "atol": 1e-9},
       torch.float32: {"rtol": 2e-4, "atol": 2e-4}}
DTYPES = [torch.float64, torch.float32]


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda():
        yield


class Block(torch.nn.Module):
    """conv -> BN+relu -> conv -> BN + residual + relu: a ResNet basic block."""

    def __init__(self, c: int, dtype: torch.dtype) -> None:
        super().__init__()
        kw = {"device": "cuda", "dtype": dtype}
        self.conv1 = ct.Conv2d(c, c, 3, padding=1, bias=False, **kw)
        self.bn1 = ct.BatchNorm2d(c, activation="relu", **kw)
        self.conv2 = ct.Conv2d(c, c, 3, padding=1, bias=False, **kw)
        self.bn2 = ct.BatchNorm2d(c, activation="relu", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(self.bn1(self.conv1(x))), residual=x)


class TorchBlock(torch.nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        c, dtype = block.conv1.in_channels, block.conv1.weight.dtype
        kw = {"device": "cuda", "dtype": dtype}
        self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False, **kw)
        self.bn1 = torch.nn.BatchNorm2d(c, **kw)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False, **kw)
        self.bn2 = torch.nn.BatchNorm2d(c, **kw)
        self.load_state_dict(block.state_dict())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def _inputs(dtype, count, channels_last=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(4, 8, 6, 6, device="cuda", dtype=dtype, generator=g)
          for _ in range(count)]
    if channels_last:
        xs = [x.contiguous(memory_format=torch.channels_last) for x in xs]
    return xs


def _step(model, x):
    """One forward + backward; returns the output and input gradient (detached)."""
    x = x.detach().requires_grad_()
    y = model(x)
    y.square().sum().backward()
    return y.detach(), x.grad


def _compare(a, b, dtype):
    torch.testing.assert_close(a, b, **TOL[dtype])


def _compare_models(model, ref, dtype):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        _compare(p.grad, q.grad, dtype)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        if b.is_floating_point():
            _compare(b, c, dtype)
        else:
            assert torch.equal(b, c), name


def _warm_up(model, x, steps=3):
    """torch's rule for capture: warm up on a side stream (plans, algorithm choice, zero
    bias and every per-signature decision are made here, never inside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            _step(model, x)
    torch.cuda.current_stream().wait_stream(s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_graph_replays_a_block_forward_and_backward(dtype, channels_last):
    torch.manual_seed(0)
    model = Block(8, dtype)
    xs = _inputs(dtype, 4, channels_last)
    static_x = xs[0].clone().requires_grad_()
    _warm_up(model, static_x)
    assert type(model(static_x).grad_fn).__name__ == "BatchNormFunctionBackward"  # eager path
    eager = copy.deepcopy(model)  # same parameters and running statistics as the capture
    nn_ref = TorchBlock(model)

    model.zero_grad(set_to_none=True)
    static_x.grad = None
    poison()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = model(static_x)
        static_y.square().sum().backward()

    for x in xs[1:]:
        static_x.detach().copy_(x)
        graph.replay()
        eager.zero_grad(set_to_none=True)
        nn_ref.zero_grad(set_to_none=True)
        y_e, dx_e = _step(eager, x)
        y_t, dx_t = _step(nn_ref, x)
        torch.cuda.synchronize()
        assert not static_y.isnan().any()
        _compare(static_y, y_e, dtype)
        _compare(static_x.grad, dx_e, dtype)
        _compare(static_y, y_t, dtype)
        _compare(static_x.grad, dx_t, dtype)
        _compare_models(model, eager, dtype)
        _compare_models(model, nn_ref, dtype)
    # the replays counted their batches on the device, as eager did
    assert int(model.bn1.num_batches_tracked) == int(eager.bn1.num_batches_tracked)


@pytest.mark.parametrize("dtype", DTYPES)
def test_make_graphed_callables(dtype):
    torch.manual_seed(1)
    model = Block(8, dtype)
    xs = _inputs(dtype, 4)
    eager = copy.deepcopy(model)  # before graphing replaces model.forward
    poison()
    graphed = torch.cuda.make_graphed_callables(
        model, (xs[0].clone().requires_grad_(),), num_warmup_iters=3)
    eager.load_state_dict(model.state_dict())  # the warm-up's running statistics
    for x in xs[1:]:
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        y_g, dx_g = _step(graphed, x)
        y_e, dx_e = _step(eager, x)
        torch.cuda.synchronize()
        _compare(y_g, y_e, dtype)
        _compare(dx_g, dx_e, dtype)
        _compare_models(model, eager, dtype)


@pytest.mark.timeout(240)  # an Inductor compile on a cold cache: tens of seconds
def test_compile_reduce_overhead():
    dtype = torch.float32
    torch.manual_seed(2)
    model = Block(8, dtype)
    eager = copy.deepcopy(model)
    nn_ref = TorchBlock(model)
    compiled = torch.compile(model, mode="reduce-overhead")
    # graph trees that skip run eagerly, silently: an error instead, so this tests graphs
    graphs = torch._inductor.config.patch({"triton.cudagraph_or_error": True})
    try:
        with graphs:
            for x in _inputs(dtype, 5):
                # gradients set to None each step: a .grad accumulated into across
                # CUDA-graph replays is an output the next replay overwrites
                # (pytorch/pytorch#169545)
                for m in (model, eager, nn_ref):
                    m.zero_grad(set_to_none=True)
                torch.compiler.cudagraph_mark_step_begin()
                y_c, dx_c = _step(compiled, x)
                y_e, dx_e = _step(eager, x)
                y_t, dx_t = _step(nn_ref, x)
                _compare(y_c, y_e, dtype)
                _compare(dx_c, dx_e, dtype)
                _compare(y_c, y_t, dtype)
                _compare(dx_c, dx_t, dtype)
                _compare_models(model, eager, dtype)
    finally:
        torch._dynamo.reset()


ENGINES = {"conv": ("conv", "conv_bias_act"),
           "transpose": ("conv_transpose", "conv_transpose_bias_act"),
           "bn": ("batchnorm", "batchnorm_forward_training")}


@pytest.mark.parametrize("layer", ["conv", "transpose", "bn"])
def test_an_eager_call_never_syncs(layer, monkeypatch):
    """After its first call (plans, algorithm choice), a layer's forward and backward make
    no synchronising call: torch's sync debug mode raises on any of torch's, and a capture
    in global mode fails at any from another library. The cuDNN engine runs
    (through the direct engine call from the signature's second call on) on the eager
    path, with no custom op dispatched."""
    import importlib

    module = importlib.import_module(f"convfuse.ops.cudnn.{ENGINES[layer][0]}")
    calls = []
    real = getattr(module, ENGINES[layer][1])
    monkeypatch.setattr(module, ENGINES[layer][1],
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    dtype = torch.float32
    make = {
        "conv": lambda: ct.Conv2d(8, 8, 3, padding=1, activation="silu"),
        "transpose": lambda: ct.ConvTranspose2d(8, 8, 3, stride=2, padding=1,
                                                output_padding=1, activation="relu"),
        "bn": lambda: ct.BatchNorm2d(8, momentum=None, activation="relu"),
    }[layer]
    model = make().to(device="cuda", dtype=dtype)
    x = _inputs(dtype, 1)[0]
    _step(model, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, x)
        with torch.no_grad():
            y = model(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(calls) == 3
    assert not y.isnan().any()
    # torch's sync debug mode sees torch's own syncs only; a capture in global mode fails at
    # any synchronising call, CuPy's and cuDNN's included (after one step on the capture's
    # side stream, whose context and handle binding are then made)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(model, x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, stream=side, capture_error_mode="global"):
            _step(model, x)
    finally:  # a failed capture_end leaves the capture stream current: the next tests' too
        torch.cuda.set_stream(caller)
    graph.replay()
    torch.cuda.synchronize()
    x = x.detach().requires_grad_()
    assert type(model(x).grad_fn).__name__ in ("ConvBiasActBackward",
                                                "ConvTransposeBiasActBackward",
                                                "BatchNormFunctionBackward")
