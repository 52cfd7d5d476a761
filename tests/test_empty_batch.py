"""An empty batch (N = 0) through convfuse's own layers and ops, as torch.nn takes it: an
empty output and input gradient, zero parameter gradients (accumulated into .grad, so a
gradient already there stays), running statistics left as they are and the batch counted,
and no engine call. torch.nn in float64 is the oracle for every shape and state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convfuse as cf
from convfuse import ops
from convfuse.geometry import ConvGeometry
from convfuse.ops import _checks
from tests._fake_cuda import cupy_layers


@pytest.fixture
def no_engine(monkeypatch):
    """An engine reached is a failure: an empty batch is the ops' own answer."""
    def forbidden(xp, kind):
        raise AssertionError(f"engine {kind} reached for an empty batch")

    monkeypatch.setattr(_checks, "engine", forbidden)


def _torch_pair(module: torch.nn.Module, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """torch.nn's output and input gradient for an empty input of `shape`."""
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    y = module(x)
    y.backward(torch.zeros_like(y))
    return y, x.grad


CONVS = [
    ("Conv1d", dict(in_channels=4, out_channels=6, kernel_size=3, padding=1), (0, 4, 7)),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1),
     (0, 4, 7, 7)),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=3, padding=2,
                    padding_mode="reflect"), (0, 4, 5, 5)),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=2, padding="same"), (0, 4, 5, 5)),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, groups=2,
                    padding_mode="circular"), (0, 4, 5, 5)),
    ("Conv3d", dict(in_channels=2, out_channels=4, kernel_size=3, dilation=2, padding=2),
     (0, 2, 5, 5, 5)),
    ("Conv2d", dict(in_channels=4, out_channels=6, kernel_size=1, bias=False), (0, 4, 5, 5)),
]


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel:UserWarning")
@pytest.mark.parametrize("activation", ["identity", "relu", "silu"])
@pytest.mark.parametrize(("cls", "kw", "shape"), CONVS)
def test_conv_layers_take_an_empty_batch(no_engine, cls, kw, shape, activation):
    ref = getattr(torch.nn, cls)(**kw, dtype=torch.float64)
    want_y, want_dx = _torch_pair(ref, shape)
    layer = getattr(cf.nn, cls)(**kw, activation=activation, dtype="float64", seed=0)
    layer.weight.grad = np.ones(layer.weight.shape)  # accumulated into, as torch.nn does
    y = layer(np.zeros(shape))
    assert y.shape == tuple(want_y.shape) and y.dtype == np.float64
    dx = layer.backward(np.zeros(y.shape))
    assert dx.shape == tuple(want_dx.shape)
    np.testing.assert_array_equal(layer.weight.grad, np.ones(layer.weight.shape))
    if layer.bias is not None:
        np.testing.assert_array_equal(layer.bias.grad, np.zeros(layer.bias.shape))


def test_an_empty_batch_in_nhwc_and_with_a_residual(no_engine):
    layer = cf.nn.Conv2d(3, 5, 3, padding=1, activation="gelu", layout="NHWC", seed=0)
    x, res = np.zeros((0, 6, 6, 3), np.float32), np.zeros((0, 6, 6, 5), np.float32)
    y = layer(x, residual=res)
    assert y.shape == (0, 6, 6, 5)
    dx, dres = layer.backward(np.zeros(y.shape, np.float32))
    assert dx.shape == x.shape and dres.shape == res.shape


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize(("cls", "shape"), [("BatchNorm1d", (0, 3)), ("BatchNorm1d", (0, 3, 5)),
                                            ("BatchNorm2d", (0, 3, 4, 4)),
                                            ("BatchNorm3d", (0, 3, 2, 2, 2))])
def test_batch_norm_takes_an_empty_batch(no_engine, cls, shape, momentum):
    ref = getattr(torch.nn, cls)(3, momentum=momentum, dtype=torch.float64)
    layer = getattr(cf.nn, cls)(3, momentum=momentum, dtype="float64")
    stats = np.array([0.5, -1.0, 2.0])
    with torch.no_grad():
        ref.running_mean.copy_(torch.tensor(stats))
        ref.running_var.copy_(torch.tensor(stats ** 2))
    layer.running_mean[...], layer.running_var[...] = stats, stats ** 2
    for _ in range(2):  # the count and the statistics after two steps
        want_y, want_dx = _torch_pair(ref, shape)
        y = layer(np.zeros(shape))
        dx = layer.backward(np.zeros(y.shape))
        assert y.shape == tuple(want_y.shape) and dx.shape == tuple(want_dx.shape)
    np.testing.assert_array_equal(layer.running_mean, ref.running_mean.numpy())
    np.testing.assert_array_equal(layer.running_var, ref.running_var.numpy())
    assert int(layer.num_batches_tracked) == int(ref.num_batches_tracked) == 2
    np.testing.assert_array_equal(layer.weight.grad, ref.weight.grad.numpy())  # zeros
    np.testing.assert_array_equal(layer.bias.grad, ref.bias.grad.numpy())


def test_batch_norm_empty_batch_in_eval_and_without_parameters(no_engine):
    layer = cf.nn.BatchNorm2d(3, affine=False, activation="relu", dtype="float64")
    x = np.zeros((0, 3, 4, 4))
    y, dres = layer(x, residual=x), None
    dx, dres = layer.backward(np.zeros(y.shape))
    assert y.shape == dx.shape == dres.shape == x.shape
    layer.eval()
    y = layer(x)
    assert y.shape == x.shape and layer.backward(np.zeros(y.shape)).shape == x.shape


@pytest.mark.parametrize(("make", "ref", "shape"), [
    (lambda: cf.nn.MaxPool2d(2), lambda: torch.nn.MaxPool2d(2), (0, 3, 4, 4)),
    (lambda: cf.nn.AvgPool2d(3, 2, 1), lambda: torch.nn.AvgPool2d(3, 2, 1), (0, 3, 5, 5)),
    (lambda: cf.nn.AdaptiveAvgPool2d(2), lambda: torch.nn.AdaptiveAvgPool2d(2), (0, 3, 5, 5)),
    (lambda: cf.nn.Linear(3, 2, dtype="float64", seed=0),
     lambda: torch.nn.Linear(3, 2, dtype=torch.float64), (0, 3)),
    (lambda: cf.nn.Flatten(), lambda: torch.nn.Flatten(), (0, 3, 2, 2)),
    (lambda: cf.nn.Flatten(0), lambda: torch.nn.Flatten(0), (0, 3, 2, 2)),
    (lambda: cf.nn.ReLU(), lambda: torch.nn.ReLU(), (0, 3)),
    (lambda: cf.nn.Activation("gelu"), lambda: torch.nn.GELU(), (0, 3, 2, 2)),
])
def test_other_layers_take_an_empty_batch(no_engine, make, ref, shape):
    want_y, want_dx = _torch_pair(ref(), shape)
    layer = make()
    y = layer(np.zeros(shape))
    assert y.shape == tuple(want_y.shape)
    assert layer.backward(np.zeros(y.shape)).shape == tuple(want_dx.shape)


def test_a_resnet_trains_on_an_empty_batch(no_engine):
    model = cf.models.resnet18(num_classes=10, dtype="float64")
    before = {k: np.array(v) for k, v in model.state_dict().items()}
    y = model(np.zeros((0, 3, 32, 32)))
    assert y.shape == (0, 10)
    model.backward(np.zeros(y.shape))
    for name, p in model.named_parameters():
        assert not np.any(p.grad), name
    after = model.state_dict()
    for k, v in before.items():  # statistics unchanged; every count one up
        want = v + 1 if k.endswith("num_batches_tracked") else v
        np.testing.assert_array_equal(np.asarray(after[k]), want, err_msg=k)


def test_gradient_ops_scale_or_zero_their_output(no_engine):
    g = ConvGeometry.create((0, 4, 5, 5), (6, 4, 3, 3), padding=1)
    x, dz = np.zeros(g.input_shape), np.zeros(g.output_shape)
    out = np.full(g.weight_shape, np.nan)
    assert not np.any(ops.conv_backward_filter(x, dz, g, out=out))  # beta 0 never reads out
    out = np.full(g.weight_shape, 2.0)
    np.testing.assert_array_equal(ops.conv_backward_filter(x, dz, g, out=out, beta=0.5), 1.0)
    db = np.full(6, 4.0)
    np.testing.assert_array_equal(ops.conv_backward_bias(dz, g, out=db, beta=0.25), 1.0)
    dz2, db2 = ops.activation_backward_bias(dz, dz, "relu", g)
    assert dz2.shape == g.output_shape and not np.any(db2) and db2.shape == (6,)
    assert ops.conv_backward_data(dz, np.zeros(g.weight_shape), g).shape == g.input_shape
    y, z = ops.conv_bias_act(x, np.zeros(g.weight_shape), None, g, activation="gelu")
    assert y.shape == z.shape == g.output_shape


@pytest.mark.parametrize("shape", [(1, 0, 5, 5), (1, 4, 0, 5), (-1, 4, 5, 5)])
def test_empty_channels_or_spatial_dims_are_still_refused(shape):
    with pytest.raises(ValueError, match="non-positive dimension"):
        ConvGeometry.create(shape, (6, 4, 3, 3), padding=1)
    if min(shape) == 0:
        with pytest.raises(ValueError, match="BatchNorm2d: every dimension but the batch must "
                                             "be positive"):
            cf.nn.BatchNorm2d(4)(np.zeros(shape, np.float32))


def test_a_one_value_batch_is_still_refused_in_training():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        cf.nn.BatchNorm1d(3)(np.zeros((1, 3), np.float32))


def test_device_layers_make_no_device_call(monkeypatch):
    """On CuPy arrays (the fake GPU of tests/_fake_cuda.py) an empty batch makes no cuDNN
    call and launches no kernel, through the layers' known-signature path too."""
    gpu = cupy_layers(monkeypatch)
    layers = [
        (cf.nn.Conv2d(2, 4, 3, padding=1, activation="silu", device="cuda", seed=0),
         (0, 2, 5, 5)),
        (cf.nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect", device="cuda", seed=0),
         (0, 2, 5, 5)),
        (cf.nn.ConvTranspose2d(2, 4, 3, device="cuda", seed=0), (0, 2, 5, 5)),
        (cf.nn.Linear(3, 2, device="cuda", seed=0), (0, 3)),
    ]
    for layer, shape in layers:
        x = gpu.array(shape, np.float32)
        for _ in range(2):  # the second call: a signature the layer knows
            gpu.calls.clear()
            y = layer(x)
            dx = layer.backward(gpu.array(y.shape, np.float32))
            assert dx.shape == shape and gpu.calls == [], type(layer).__name__


def test_the_torch_bridges_ops_answer_an_empty_batch_at_every_call():
    """convfuse.torch's custom ops called directly (as a compiled graph calls them): an
    empty batch at a signature's later calls too, which skip the ops' checks (Note
    [per-signature decisions]) and must not reach an engine (whose statistics of nothing
    were NaN running statistics)."""
    ops = torch.ops.convfuse
    x = torch.zeros(0, 3, 4, 4)
    w, b = torch.ones(3), torch.zeros(3)
    rm, rv = torch.full((3,), 0.5), torch.full((3,), 2.0)
    for _ in range(3):
        y, mean, invstd, _ = ops.batchnorm_training(x, w, b, rm, rv, None, None, 0.1, 1e-5,
                                                    "relu")
        assert y.shape == x.shape
        torch.testing.assert_close(rm, torch.full((3,), 0.5), rtol=0, atol=0)
        torch.testing.assert_close(rv, torch.full((3,), 2.0), rtol=0, atol=0)
        dx, dw, db, _ = ops.batchnorm_backward(torch.zeros_like(x), x, w, b, y, mean, invstd,
                                               True, 1e-5, "relu", True, False)
        assert dx.shape == x.shape and not dw.any() and not db.any()
        yi, *_ = ops.batchnorm_inference(x, w, b, rm, rv, None, 1e-5, "identity")
        assert yi.shape == x.shape
        yc, _ = ops.conv_bias_act(x, torch.ones(2, 3, 3, 3), None, None, [1, 1], [1, 1],
                                  [1, 1], 1, "relu")
        assert yc.shape == (0, 2, 4, 4)
