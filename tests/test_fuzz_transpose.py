"""Fuzzing the transposed convolution over random geometries (ranks 1-3, stride, padding,
output_padding, dilation, groups, both layouts), with hypothesis:

(a) the output shape is torch.nn.functional.conv_transpose*d's, or both refuse the case;
    and the transposed plan's descriptors (the forward convolution G's) make cuDNN's own
    cudnnGetConvolutionNdForwardOutputDim map the output back to the input shape (checked
    when the plan is built, which needs no GPU);
(b) the reference engine's forward and every gradient equal PyTorch's in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
from hypothesis import event, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from convfuse.functional_transpose import (  # noqa: E402
    conv_transpose_bias_act_backward,
    conv_transpose_bias_act_forward,
)
from convfuse.transpose_geometry import ConvTransposeGeometry  # noqa: E402

F = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
     3: torch.nn.functional.conv_transpose3d}
LAYOUTS = {1: ("NCW", "NWC"), 2: ("NCHW", "NHWC"), 3: ("NCDHW", "NDHWC")}


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2, 3]))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    per = []
    for _ in range(rank):  # size, kernel, stride, padding, dilation, output_padding
        s, d = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        per.append((draw(st.integers(1, 4)), draw(st.integers(1, 3)), s,
                    draw(st.integers(0, 2)), d, draw(st.integers(0, max(s, d)))))
    size, kernel, stride, padding, dilation, opad = (tuple(p[i] for p in per) for i in range(6))
    channels_last = draw(st.booleans())
    return rank, cin, cout, groups, size, kernel, stride, padding, dilation, opad, channels_last


def _torch_shape(case):
    rank, cin, cout, groups, size, kernel, stride, padding, dilation, opad, _ = case
    x = torch.zeros(1, cin, *size, dtype=torch.float64)
    w = torch.zeros(cin, cout // groups, *kernel, dtype=torch.float64)
    try:
        return tuple(F[rank](x, w, None, stride, padding, opad, groups, dilation).shape)
    except RuntimeError:
        return None


def _geom(case, batch=1):
    rank, cin, cout, groups, size, kernel, stride, padding, dilation, opad, cl = case
    x = (batch, cin, *size) if not cl else (batch, *size, cin)
    w = (cin, cout // groups, *kernel) if not cl else (cin, *kernel, cout // groups)
    return ConvTransposeGeometry.create(x, w, stride, padding, opad, dilation, groups,
                                        LAYOUTS[rank][cl])


@settings(max_examples=200)
@given(cases())
def test_output_shape_is_torchs_and_cudnn_maps_it_back(case):
    from convfuse.plan.conv import ConvPlan
    from convfuse.plan.conv_transpose import transpose_plan_key

    want = _torch_shape(case)
    note(f"torch: {want}")
    try:
        geom = _geom(case)
    except ValueError:
        event("refused")
        assert want is None or any(n < 1 for n in want[2:])
        return
    event("windowed" if geom.windowed else "valid")
    assert want is not None and geom.output_shape_cf == want
    ConvPlan(transpose_plan_key(geom, "float64"))  # raises if cuDNN disagrees


@settings(max_examples=120)
@given(cases(), st.sampled_from(["identity", "relu", "tanh"]))
def test_reference_engine_equals_torch_in_float64(case, act):
    try:
        geom = _geom(case, batch=2)
    except ValueError:
        event("refused")
        return
    event("windowed" if geom.windowed else "valid")
    rng = np.random.default_rng(0)
    x_cf = rng.standard_normal(geom.input_shape_cf)
    w_cf = rng.standard_normal(geom.weight_shape_cf)
    b = rng.standard_normal(geom.out_channels)
    rank, cl = geom.rank, geom.channels_last
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x_cf, w_cf, b))
    yt = F[rank](xt, wt, bt, geom.stride, geom.padding, geom.output_padding, geom.groups,
                 geom.dilation)
    yt = {"identity": lambda t: t, "relu": torch.relu, "tanh": torch.tanh}[act](yt)
    dy = rng.standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(dy))
    conv = (lambda a: np.ascontiguousarray(np.moveaxis(a, 1, -1))) if cl else (lambda a: a)
    back = (lambda a: np.moveaxis(a, -1, 1)) if cl else (lambda a: a)
    y, ctx = conv_transpose_bias_act_forward(conv(x_cf), conv(w_cf), b, activation=act,
                                             geom=geom)
    g = conv_transpose_bias_act_backward(conv(dy), ctx)
    for got, want in ((back(y), yt), (back(g.dx), xt.grad), (back(g.dweight), wt.grad),
                      (g.dbias, bt.grad)):
        np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-10, atol=1e-10)
