"""convfuse.ConvTranspose1d/2d/3d: torch.nn's arguments in torch.nn's order, state dicts
interchangeable with torch.nn.ConvTranspose*d's (both layouts), output_size=, residual=,
typed errors naming the layer and the argument, and the geometry's validation."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse
from convfuse.transpose_geometry import ConvTransposeGeometry, output_padding_for

torch = pytest.importorskip("torch")

CLASSES = {1: convfuse.ConvTranspose1d, 2: convfuse.ConvTranspose2d, 3: convfuse.ConvTranspose3d}
TORCH = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d, 3: torch.nn.ConvTranspose3d}
LAYOUTS = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}


def _cl(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("channels_last", [False, True])
def test_layer_matches_torch_nn_with_the_same_state_dict(rank, channels_last, rng):
    # positional, in torch.nn's order: in, out, kernel, stride, padding, output_padding,
    # groups, bias, dilation, padding_mode, device, dtype
    args = (4, 6, 3, 2, 1, 1, 2, True, 1, "zeros")
    ours = CLASSES[rank](*args, "cpu", "float64", activation="relu",
                         layout=LAYOUTS[rank][channels_last], seed=3)
    ref = TORCH[rank](*args, None, torch.float64)
    sd = ours.state_dict()
    assert list(sd) == ["weight", "bias"]
    assert sd["weight"].shape == tuple(ref.weight.shape) == (4, 3, *([3] * rank))
    ref.load_state_dict({k: torch.tensor(v) for k, v in sd.items()})
    x = rng.standard_normal((2, 4, *([4, 3, 5][:rank])))
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.relu(ref(xt))
    dy = rng.standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(dy))
    conv = _cl if channels_last else (lambda a: a)
    back = (lambda a: np.moveaxis(a, -1, 1)) if channels_last else (lambda a: a)
    y = ours(conv(x))
    np.testing.assert_allclose(back(y), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    dx = ours.backward(conv(dy))
    np.testing.assert_allclose(back(dx), xt.grad.numpy(), rtol=1e-11, atol=1e-11)
    grads = {"weight": ours._param_to_state("weight", ours.weight.grad), "bias": ours.bias.grad}
    np.testing.assert_allclose(grads["weight"], ref.weight.grad.numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(grads["bias"], ref.bias.grad.numpy(), rtol=1e-11, atol=1e-11)
    # torch.nn's weights load into ours
    ref2 = TORCH[rank](*args, None, torch.float64)
    ours.load_state_dict({k: v.detach().numpy() for k, v in ref2.state_dict().items()})
    want = torch.relu(ref2(torch.tensor(x))).detach().numpy()
    np.testing.assert_allclose(back(ours(conv(x))), want, rtol=1e-12, atol=1e-12)


def test_default_initialisation_has_torch_bounds():
    m = convfuse.ConvTranspose2d(8, 4, 3, groups=2, seed=0)
    bound = 1 / np.sqrt(2 * 9)  # fan_in = weight.size(1) * prod(kernel) = out/groups * 9
    w, b = m.weight.data, m.bias.data
    assert w.shape == (8, 2, 3, 3) and w.dtype == np.float32
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound
    assert np.abs(b).max() <= bound


def test_output_size_and_residual(rng):
    m = convfuse.ConvTranspose2d(3, 2, 3, stride=2, padding=1, dtype="float64", seed=1)
    ref = torch.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, dtype=torch.float64)
    ref.load_state_dict({k: torch.tensor(v) for k, v in m.state_dict().items()})
    x = rng.standard_normal((1, 3, 4, 5))
    for size in [(7, 9), (8, 10), [1, 2, 8, 9]]:
        want = ref(torch.tensor(x), output_size=list(size)).detach().numpy()
        res = rng.standard_normal(want.shape)
        m.residual_scale = 0.5
        y = m(x, residual=res, output_size=size)
        np.testing.assert_allclose(y, want + 0.5 * res, rtol=1e-12, atol=1e-12)
        _, dres = m.backward(np.ones_like(y))
        np.testing.assert_allclose(dres, 0.5 * np.ones_like(y))
    with pytest.raises(ValueError, match=r"ConvTranspose2d: requested an output size of "
                                         r"\(9, 9\), but valid sizes range from \(7, 9\) to"):
        m(x, output_size=(9, 9))
    with pytest.raises(ValueError, match="ConvTranspose2d: output_size must have 2 or 4"):
        m(x, output_size=(8,))


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_full_output_size_is_read_in_the_layers_layout(rank, rng):
    """A channels-last layer given a skip connection's shape (N, *spatial, C), the U-Net
    idiom `up(x, output_size=skip.shape)`, takes its spatial sizes from the middle: the
    same output as torch.nn given the NCHW shape. The functional form reads it so too."""
    from convfuse.functional_transpose import conv_transpose_bias_act

    m = CLASSES[rank](3, 2, 3, stride=2, padding=1, dtype="float64", seed=1,
                      layout=LAYOUTS[rank][1])
    ref = TORCH[rank](3, 2, 3, stride=2, padding=1, dtype=torch.float64)
    ref.load_state_dict({k: torch.tensor(v) for k, v in m.state_dict().items()})
    x = rng.standard_normal((2, 3, *[4, 5, 3][:rank]))
    spatial = (8, 9, 6)[:rank]  # each the larger of the two sizes stride 2 allows
    skip_shape = (2, *spatial, 2)
    want = ref(torch.tensor(x), output_size=[2, 2, *spatial]).detach().numpy()
    y = m(_cl(x), output_size=skip_shape)
    assert y.shape == skip_shape
    np.testing.assert_allclose(np.moveaxis(y, -1, 1), want, rtol=1e-12, atol=1e-12)
    w = m.weight.data
    yf = conv_transpose_bias_act(_cl(x), w, stride=2, padding=1, layout=LAYOUTS[rank][1],
                                 output_size=skip_shape)
    np.testing.assert_allclose(np.moveaxis(yf, -1, 1),
                               want - ref.bias.detach().numpy().reshape(1, 2, *[1] * rank),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs,kind,pattern", [
    (dict(padding_mode="reflect"), ValueError, 'Only "zeros" padding mode is supported'),
    (dict(padding_mode="bogus"), ValueError, 'Only "zeros" padding mode is supported'),
    (dict(groups=4), ValueError, "in_channels must be divisible by groups"),
    (dict(output_padding=2, stride=2), ValueError, "output_padding must be smaller than either"),
    (dict(padding="same"), ValueError, "no 'same' padding"),
    (dict(stride=0), ValueError, "stride must be >= 1"),
    (dict(kernel_size=(2, 2, 2)), ValueError, "kernel_size must be an int or 2 ints"),
    (dict(activation=3), TypeError, "activation must be a str"),
])
def test_constructor_errors_name_the_layer_and_argument(kwargs, kind, pattern):
    args = dict(in_channels=6, out_channels=4, kernel_size=3)
    args.update(kwargs)
    with pytest.raises(kind, match=pattern) as err:
        convfuse.ConvTranspose2d(**args)
    assert str(err.value).startswith("ConvTranspose2d")
    if "padding_mode" in kwargs:  # torch.nn raises the same error
        with pytest.raises(ValueError, match=pattern):
            torch.nn.ConvTranspose2d(**args)


def test_activation_is_keyword_only():
    with pytest.raises(TypeError):
        convfuse.ConvTranspose2d(2, 2, 3, 1, 0, 0, 1, True, 1, "zeros", "cpu", "float32", "relu")


def test_call_errors_and_no_partial_state(rng):
    m = convfuse.ConvTranspose2d(3, 2, 2, stride=2, seed=0)
    with pytest.raises(ValueError, match="ConvTranspose2d: input channels must match"):
        m(rng.standard_normal((1, 4, 3, 3)).astype(np.float32))
    with pytest.raises(ValueError, match="ConvTranspose2d: expects a 4-d input"):
        m(rng.standard_normal((3, 3, 3)).astype(np.float32))
    with pytest.raises(ValueError, match="ConvTranspose2d: has dtype float32"):
        m(rng.standard_normal((1, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"ConvTranspose2d: .*residual"):
        m(rng.standard_normal((1, 3, 3, 3)).astype(np.float32),
          residual=np.zeros((1, 2, 5, 5), np.float32))
    with pytest.raises(convfuse.BackwardBeforeForwardError):
        m.backward(np.zeros((1, 2, 6, 6), np.float32))


def test_hyperparameters_assignable_and_validated(rng):
    m = convfuse.ConvTranspose1d(2, 2, 3, dtype="float64", seed=0)
    x = rng.standard_normal((1, 2, 5))
    assert m(x).shape == (1, 2, 7)
    m.stride = 2
    assert m(x).shape == (1, 2, 11)
    m.output_padding = 1
    assert m(x).shape == (1, 2, 12)
    with pytest.raises(ValueError, match="ConvTranspose1d: output_padding must be smaller"):
        m.stride = 1
    assert m.stride == (2,)
    with pytest.raises(AttributeError):
        m.in_channels = 3


def test_non_contiguous_input_is_not_modified(rng):
    m = convfuse.ConvTranspose2d(3, 2, 2, stride=2, dtype="float64", seed=0)
    x = rng.standard_normal((1, 3, 4, 6))[..., ::2]
    keep = x.copy()
    np.testing.assert_allclose(m(x), m(np.ascontiguousarray(x)))
    np.testing.assert_array_equal(x, keep)


def test_geometry_output_padding_for_matches_torch_rule():
    m = torch.nn.ConvTranspose1d(3, 2, 2, stride=3, padding=1, dilation=2)
    x = torch.zeros(1, 3, 4)
    for size in ([10], [1, 2, 11], [12]):
        want = m._output_padding(x, size, [3], [1], [2], 1, [2])
        assert output_padding_for((4,), size, (3,), (1,), (2,), (2,)) == tuple(want)
    assert output_padding_for((4, 5), (8, 10), (2, 2), (1, 1), (3, 3), (1, 1)) == (1, 1)
    with pytest.raises(TypeError, match="output_size must be a sequence"):
        output_padding_for((4,), 9, (3,), (1,), (2,), (1,))


@pytest.mark.parametrize("args,pattern", [
    (((1, 3, 4, 4), (4, 2, 3, 3)), "input channels must match the weight: 3 vs. 4"),
    (((1, 4, 4, 4), (4, 2, 3, 3), 1, 0, 0, 1, 3), "in_channels \\(4\\) must be divisible"),
    (((1, 4, 1, 1), (4, 2, 1, 1), 1, 1), "the output would be empty"),
    (((1, 4, 4, 4), (4, 2, 3, 3), 2, 0, 1, 1, 1, "NCHW", (20, 20)), "valid sizes range"),
    (((1, 4, 4), (4, 2, 3, 3)), "input must have 4 dims"),
    (((1, 4, 4, 4), (4, 2, 3, 3), 1, "same"), "no 'same'"),
])
def test_geometry_validation(args, pattern):
    with pytest.raises(ValueError, match=pattern):
        ConvTransposeGeometry.create(*args)


def test_geometry_is_the_swapped_forward_convolution():
    g = ConvTransposeGeometry.create((2, 8, 5, 5), (8, 2, 4, 4), 2, 1, 0, 1, 2)
    assert g.output_shape == (2, 4, 10, 10)
    assert g.conv.input_shape == g.output_shape and g.conv.output_shape == g.input_shape
    assert g.conv.weight_shape == g.weight_shape and g.conv.groups == 2
    assert g.epilogue.output_shape == g.output_shape and g.epilogue.out_channels == 4


def test_empty_batch_as_torch_nn():
    """N = 0: empty output and dx, gradients untouched (zero), no engine call."""
    m = convfuse.ConvTranspose2d(4, 6, 3, 2, 1, 1, 2, activation="relu", dtype="float64",
                                 seed=0)
    y = m(np.zeros((0, 4, 5, 5)))
    assert y.shape == (0, 6, 10, 10)
    dx = m.backward(np.zeros(y.shape))
    assert dx.shape == (0, 4, 5, 5)
    assert not np.any(m.weight.grad) and not np.any(m.bias.grad)
    g = ConvTransposeGeometry.create((0, 4, 5, 5), (4, 3, 3, 3), 2)
    out = np.full((4, 3, 3, 3), np.nan)
    assert not np.any(convfuse.ops.conv_transpose_backward_filter(
        np.zeros((0, 4, 5, 5)), np.zeros(g.output_shape), g, out=out))  # beta 0: no NaN read
    with pytest.raises(ValueError, match="non-positive dimension"):
        ConvTransposeGeometry.create((1, 4, 0, 5), (4, 3, 3, 3))


def test_sequential_hands_the_residual_to_a_final_conv_transpose(rng):
    up = convfuse.ConvTranspose2d(4, 2, 2, 2, activation="relu", dtype="float64", seed=0)
    seq = convfuse.Sequential(convfuse.Conv2d(3, 4, 3, padding=1, dtype="float64", seed=1), up)
    x, skip = rng.standard_normal((1, 3, 4, 4)), rng.standard_normal((1, 2, 8, 8))
    y = seq(x, residual=skip)
    ref = torch.nn.ConvTranspose2d(4, 2, 2, 2, dtype=torch.float64)
    ref.load_state_dict({k: torch.tensor(v) for k, v in up.state_dict().items()})
    h = seq[0](x)
    want = torch.relu(ref(torch.tensor(h)) + torch.tensor(skip)).detach().numpy()
    np.testing.assert_allclose(y, want,
                               rtol=1e-12, atol=1e-12)
    dx, dskip = seq.backward(np.ones_like(y))
    np.testing.assert_allclose(dskip, (y > 0).astype(float))
    assert dx.shape == x.shape


def test_output_size_as_a_list_on_a_fresh_layer():
    """torch.nn's common spelling, output_size=[H, W]: the same output as the tuple, from the
    first call on (a list cannot key the call cache)."""
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    first = convfuse.ConvTranspose2d(2, 3, 3, stride=2, dtype="float64", device="cpu", seed=0)
    again = convfuse.ConvTranspose2d(2, 3, 3, stride=2, dtype="float64", device="cpu", seed=0)
    y = first(x, output_size=[10, 10])
    assert y.shape == (1, 3, 10, 10)
    np.testing.assert_array_equal(y, again(x, output_size=(10, 10)))
    np.testing.assert_array_equal(first(x, output_size=[10, 10]), y)  # cached layer too
    with pytest.raises(TypeError, match="output_size must be a sequence of ints"):
        first(x, output_size="10")
