"""Fuzzing the pad ops (convfuse.ops.pad_forward/pad_backward) with hypothesis: random
ranks, layouts, sizes, modes and (begin, end) pads up to each mode's limit, against
torch.nn.functional.pad in float64 (forward exact, backward to rounding) and the adjoint
identity <pad(x), dy> = <x, pad_backward(dy)>; pads past the limit are refused exactly
where torch refuses them."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import convfuse.ops as ops  # noqa: E402
from convfuse.pad_geometry import PadGeometry  # noqa: E402

TORCH_MODE = {"zeros": "constant", "reflect": "reflect", "replicate": "replicate",
              "circular": "circular"}


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 3))
    spatial = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    mode = draw(st.sampled_from(list(TORCH_MODE)))
    pads = [(draw(st.integers(0, 6)), draw(st.integers(0, 6))) for _ in range(rank)]
    channels_last = draw(st.booleans())
    return spatial, mode, pads, channels_last


def torch_pad(x_cf, pads, mode):
    flat = [v for pair in reversed(pads) for v in pair]  # torch: last dim first
    xt = torch.tensor(x_cf, requires_grad=True)
    return xt, torch.nn.functional.pad(xt, flat, mode=TORCH_MODE[mode])


@given(cases(), st.integers(0, 2**32 - 1))
def test_pad_ops_match_torch_or_refuse_where_torch_refuses(case, seed):
    spatial, mode, pads, channels_last = case
    rng = np.random.default_rng(seed)
    x_cf = rng.standard_normal((2, 3, *spatial))
    x = np.ascontiguousarray(np.moveaxis(x_cf, 1, -1)) if channels_last else x_cf
    layout = "NHWC" if channels_last else "NCHW"
    try:
        xt, yt = torch_pad(x_cf, pads, mode)
    except (RuntimeError, ValueError, NotImplementedError):
        event("refused")
        with pytest.raises(ValueError, match=f"padding_mode='{mode}' needs padding"):
            PadGeometry.create(x.shape, pads, mode, layout)
        return
    g = PadGeometry.create(x.shape, pads, mode, layout)
    y = ops.pad_forward(x, g)
    y_cf = np.moveaxis(y, -1, 1) if channels_last else y
    np.testing.assert_array_equal(y_cf, yt.detach().numpy())
    dy_cf = rng.standard_normal(y_cf.shape)
    yt.backward(torch.tensor(dy_cf))
    dy = np.ascontiguousarray(np.moveaxis(dy_cf, 1, -1)) if channels_last else dy_cf
    dx = ops.pad_backward(dy, g)
    dx_cf = np.moveaxis(dx, -1, 1) if channels_last else dx
    np.testing.assert_allclose(dx_cf, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, dx), rel=1e-10, abs=1e-10)


@st.composite
def conv_cases(draw):
    rank = draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    dilation = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    same = draw(st.booleans())
    stride = [1] * rank if same else draw(st.lists(st.integers(1, 2), min_size=rank,
                                                   max_size=rank))
    padding = "same" if same else draw(st.lists(st.integers(0, 3), min_size=rank,
                                                max_size=rank))
    spatial = [draw(st.integers(d * (k - 1) + 1, d * (k - 1) + 4))
               for k, d in zip(kernel, dilation)]
    mode = draw(st.sampled_from(list(TORCH_MODE)))
    return rank, kernel, dilation, stride, padding, spatial, mode, draw(st.booleans())


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")  # torch's, on speed
@hypothesis.settings(max_examples=60)
@given(conv_cases(), st.integers(0, 2**32 - 1))
def test_conv_layers_match_torch_nn_over_random_geometries(case, seed):
    """Forward, dx, dw and db of convfuse's Conv*d with any padding_mode against torch.nn's
    in float64, or the same refusal (a padding the input is too small for)."""
    import convfuse as cf

    rank, kernel, dilation, stride, padding, spatial, mode, channels_last = case
    rng = np.random.default_rng(seed)
    kw = dict(stride=tuple(stride), padding=padding if padding == "same" else tuple(padding),
              dilation=tuple(dilation))
    t = getattr(torch.nn, f"Conv{rank}d")(2, 3, tuple(kernel), padding_mode=mode,
                                          dtype=torch.float64, **kw)
    x_cf = rng.standard_normal((2, 2, *spatial))
    xt = torch.tensor(x_cf, requires_grad=True)
    layer = getattr(cf, f"Conv{rank}d")(2, 3, tuple(kernel), **kw, padding_mode=mode,
                                        layout="NHWC" if channels_last else "NCHW",
                                        dtype="float64", device="cpu")
    layer.load_state_dict({k: v.detach().numpy() for k, v in t.state_dict().items()})
    x = np.ascontiguousarray(np.moveaxis(x_cf, 1, -1)) if channels_last else x_cf
    try:
        yt = t(xt)
    except RuntimeError:  # torch refuses: the padding is too wide, or the output empty
        event("refused")
        with pytest.raises(ValueError, match=f"^Conv{rank}d: "):
            layer(x)
        return
    y = layer(x)
    y_cf = np.moveaxis(y, -1, 1) if channels_last else y
    np.testing.assert_allclose(y_cf, yt.detach().numpy(), rtol=1e-11, atol=1e-11)
    dy_cf = rng.standard_normal(y_cf.shape)
    dx = layer.backward(np.ascontiguousarray(np.moveaxis(dy_cf, 1, -1)) if channels_last
                        else dy_cf)
    yt.backward(torch.tensor(dy_cf))
    np.testing.assert_allclose(np.moveaxis(dx, -1, 1) if channels_last else dx,
                               xt.grad.numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(layer._param_to_state("weight", layer.weight.grad),
                               t.weight.grad.numpy(), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(layer.bias.grad, t.bias.grad.numpy(), rtol=1e-11, atol=1e-11)
