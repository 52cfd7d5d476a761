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
from hypothesis import given  # noqa: E402
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
