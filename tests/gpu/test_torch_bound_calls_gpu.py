"""Bound calls on a GPU (Note [bound calls] in convfuse/ops/cudnn/bound.py): from a
signature's second call on, a convfuse.torch convolution's cuDNN calls come from the
calls the engine bound, and every step must still give torch.nn's float64 numbers, eagerly,
on a side stream and under torch.cuda.graph. The engine's plan lookups are counted (which
does not unbind anything), so the tests also assert that the bound calls are what ran.
PyTorch's cache is poisoned with NaN before each step. Written without a GPU: none of
these has run yet.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests._engine_calls import count_plan_lookups, forget_signatures  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda, poison, replay_on_new_input  # noqa: E402

ENTRIES = ("conv_bias_act", "conv_backward_bias", "conv_backward_filter", "conv_backward_data")


@pytest.fixture(autouse=True)
def _cuda_torch():
    forget_signatures()  # the counts below start at each signature's first call
    with exact_cuda():
        yield


@pytest.fixture
def entries(monkeypatch):
    """How often the engine ran each op (a bound call skips it): tests/_engine_calls.py."""
    import convfuse.ops.cudnn.conv as cudnn_conv

    return count_plan_lookups(monkeypatch, cudnn_conv, "get_plan", ENTRIES)


def _close(got, want, tol):
    np.testing.assert_allclose(got.detach().cpu().double().numpy(), want.detach().numpy(),
                               rtol=tol, atol=tol)


def _one_step(layer, ref, x_shape, fmt, relu, residual_shape=None):
    """One training step of `layer` (on CUDA, float32) and of its float64 twin `ref` on
    the CPU from the same random input (and residual), on NaN-poisoned memory: y and
    every gradient compared."""
    x_ref = torch.randn(*x_shape, dtype=torch.float64, requires_grad=True)
    x = x_ref.detach().to("cuda", torch.float32).contiguous(memory_format=fmt)
    x.requires_grad_()
    layer.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    r_ref = None if residual_shape is None else torch.randn(*residual_shape,
                                                             dtype=torch.float64)
    poison(4 << 20)
    if r_ref is None:
        y, y_ref = layer(x), ref(x_ref)
    else:
        y = layer(x, residual=r_ref.to("cuda", torch.float32).contiguous(memory_format=fmt))
        y_ref = ref(x_ref) + r_ref
    y.square().sum().backward()
    y_ref = torch.relu(y_ref) if relu else y_ref
    y_ref.square().sum().backward()
    torch.cuda.synchronize()
    _close(y, y_ref, 2e-4)
    _close(x.grad, x_ref.grad, 2e-3)
    _close(layer.weight.grad, ref.weight.grad, 2e-3)
    if layer.bias is not None:
        _close(layer.bias.grad, ref.bias.grad, 2e-3)


@pytest.mark.parametrize("kwargs", [{"activation": "relu"}, {}, {"bias": False},
                                    {"bias": False, "activation": "relu"}],
                         ids=["relu", "identity", "nothing-to-fuse", "relu-no-bias"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_bound_steps_match_torch_nn(entries, kwargs, channels_last):
    import convfuse.torch as ct

    torch.manual_seed(3)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = torch.nn.Conv2d(8, 16, 3, padding=1, bias=kwargs.get("bias", True)).double()
    layer = ct.Conv2d(8, 16, 3, padding=1, **kwargs)
    layer.load_state_dict(ref.state_dict())
    layer = layer.to("cuda").to(memory_format=fmt)
    relu = kwargs.get("activation") == "relu"
    for step in range(4):
        _one_step(layer, ref, (4, 8, 12, 12), fmt, relu)
        if step == 1:
            ran = dict(entries)
    # steps 2 and 3 ran bound calls only: every one was bound after step 1 (the zero bias
    # of a bias-free fused call, filled at step 0, is complete by then: steps synchronize),
    # but relu's bias gradient, which the engine's activation kernel computes with its own
    # call of conv_backward_bias at every step
    unbound = ("conv_backward_bias",) if relu and layer.bias is not None else ()
    assert {k: v for k, v in entries.items() if k not in unbound} == \
        {k: v for k, v in ran.items() if k not in unbound}
    for k in unbound:
        assert entries[k] == 2 * ran[k] == 4


def test_bound_calls_follow_the_stream_and_replay_under_a_cuda_graph(entries):
    """A bound call belongs to one stream: on a side stream the engine runs first (and
    binds there); captured by torch.cuda.graph on that stream, the bound calls' workspace
    and outputs come from the graph's pool and the replay gives the eager numbers."""
    import convfuse.torch as ct

    torch.manual_seed(4)
    layer = ct.Conv2d(8, 16, 3, padding=1, activation="relu").cuda()
    static_x = torch.randn(4, 8, 16, 16, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the engine, then bound calls on this stream
            layer.zero_grad(set_to_none=True)
            layer(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    bound_from = dict(entries)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph, stream=side):  # the stream the calls are bound to
        static_y = layer(static_x)
        static_y.square().sum().backward()
    assert entries["conv_bias_act"] == bound_from["conv_bias_act"]  # captured bound
    new_x, got_y, got_dx = replay_on_new_input(graph, static_x, static_y)
    ref = layer.cpu().double()
    x = new_x.detach().cpu().double().requires_grad_()
    y = torch.relu(torch.nn.functional.conv2d(x, ref.weight, ref.bias, padding=1))
    y.square().sum().backward()
    np.testing.assert_allclose(got_y.cpu().double().numpy(), y.detach().numpy(), rtol=2e-4,
                               atol=2e-4)
    np.testing.assert_allclose(got_dx.cpu().double().numpy(), x.grad.numpy(), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.parametrize("bias, relu, residual", [
    (True, False, False), (False, False, False), (True, True, False), (False, True, False),
    (True, True, True)], ids=["bias", "no-bias", "relu", "relu-no-bias", "relu-residual"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_bound_transposed_steps_match_torch_nn(monkeypatch, bias, relu, residual,
                                               channels_last):
    """A ConvTranspose2d (stride 2, output_padding 1: not windowed) trained for four steps:
    torch.nn's float64 numbers at every step, and from step 2 on no call of the engine
    (its plan lookups are counted)."""
    import convfuse.ops.cudnn.conv_transpose as cudnn_transpose
    import convfuse.torch as ct

    counts = count_plan_lookups(monkeypatch, cudnn_transpose, "get_transpose_plan",
                                ("forward", "backward_data", "backward_filter"))
    torch.manual_seed(5)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = torch.nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1, output_padding=1,
                                   bias=bias).double()
    layer = ct.ConvTranspose2d(8, 16, 3, stride=2, padding=1, output_padding=1, bias=bias)
    layer.load_state_dict(ref.state_dict())
    if relu:
        layer.activation = "relu"
    layer = layer.to("cuda").to(memory_format=fmt)
    for step in range(4):
        _one_step(layer, ref, (4, 8, 9, 9), fmt, relu, (4, 16, 18, 18) if residual else None)
        if step == 1:
            ran = dict(counts)
    assert counts == ran == {"forward": 1, "backward_data": 1, "backward_filter": 1}


@pytest.mark.parametrize("relu, residual", [(False, False), (True, False), (True, True)],
                         ids=["identity", "relu", "relu-residual"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_bound_batchnorm_steps_match_torch_nn(monkeypatch, relu, residual, channels_last):
    """A BatchNorm2d trained for four steps (Note [bound batch-norm calls]): torch.nn's
    float64 numbers at every step and in the running statistics after them, and from step
    2 on no call of the engine's entries (their plan lookups are counted)."""
    import convfuse.ops.cudnn.batchnorm as cudnn_batchnorm
    import convfuse.torch as ct

    counts = count_plan_lookups(monkeypatch, cudnn_batchnorm, "get_batchnorm_plan",
                                ("batchnorm_forward_training", "training_backward"))
    torch.manual_seed(6)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    ref = torch.nn.BatchNorm2d(16).double()
    layer = ct.BatchNorm2d(16, activation="relu" if relu else None)
    layer.load_state_dict(ref.state_dict())
    layer = layer.to("cuda")
    for step in range(4):
        _one_step(layer, ref, (4, 16, 9, 9), fmt, relu, (4, 16, 9, 9) if residual else None)
        if step == 1:
            ran = dict(counts)
    assert counts == ran == {"batchnorm_forward_training": 1, "training_backward": 1}
    _close(layer.running_mean, ref.running_mean, 1e-4)
    _close(layer.running_var, ref.running_var, 1e-4)
    assert int(layer.num_batches_tracked) == 4


@pytest.mark.parametrize("residual", [True, False], ids=["add-relu", "relu"])
def test_bound_fused_half_batchnorm_matches_torch_nn(monkeypatch, residual):
    """fp16 channels-last relu (with a residual whose gradient is asked for, or none), C %
    4 == 0: the forward's fused bnOps (documented for it) and BackwardEx with its reserve
    space (Note [the fused backward on the eager path]) or, where this cuDNN refuses
    them, the plain path; either way the bound steps give torch.nn's float64 numbers to
    half precision, the residual's gradient included."""
    import convfuse.ops.cudnn.batchnorm as cudnn_batchnorm
    import convfuse.torch as ct

    counts = count_plan_lookups(monkeypatch, cudnn_batchnorm, "get_batchnorm_plan",
                                ("batchnorm_forward_training", "training_backward"))
    torch.manual_seed(7)
    ref = torch.nn.BatchNorm2d(16).double()
    layer = ct.BatchNorm2d(16, activation="relu")
    layer.load_state_dict(ref.state_dict())
    layer = layer.to("cuda")
    cl = torch.channels_last
    for _ in range(4):
        x = torch.randn(4, 16, 9, 9, device="cuda").half().contiguous(memory_format=cl)
        r = torch.randn(4, 16, 9, 9, device="cuda").half().contiguous(memory_format=cl)
        x_ref = x.detach().cpu().double().requires_grad_()  # the half inputs' own values
        r_ref = r.detach().cpu().double().requires_grad_()
        x.requires_grad_()
        r.requires_grad_()
        layer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        poison(4 << 20)
        y = layer(x, residual=r) if residual else layer(x)
        y.float().square().sum().backward()
        y_ref = torch.relu(ref(x_ref) + r_ref) if residual else torch.relu(ref(x_ref))
        y_ref.square().sum().backward()
        torch.cuda.synchronize()
        _close(y, y_ref, 2e-2)
        _close(x.grad, x_ref.grad, 5e-2)
        if residual:
            _close(r.grad, r_ref.grad, 5e-2)
        _close(layer.weight.grad, ref.weight.grad, 1e-1)
        _close(layer.bias.grad, ref.bias.grad, 1e-1)
    assert counts == {"batchnorm_forward_training": 1, "training_backward": 1}
    _close(layer.running_mean, ref.running_mean, 1e-3)
    _close(layer.running_var, ref.running_var, 1e-3)
