"""The functional API's contracts as its docstring states them: TypeError for a wrong
Python type, ValueError for a wrong value, both naming the argument as the signature does
(weight, bias, not the ops' w, b); the forward alone hands back a writable output."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse import functional as F
from convfuse import functional_transpose as FT

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 5, 5))
W = RNG.standard_normal((4, 3, 3, 3))
WT = RNG.standard_normal((3, 4, 3, 3))


@pytest.mark.parametrize(("kw", "match"), [
    ({"stride": None}, r"stride must be an int, a tuple of ints, got NoneType None"),
    ({"stride": 1.0}, r"stride must be an int, a tuple of ints, got float 1.0"),
    ({"padding": None}, r"padding must be an int, a tuple of ints or a str, got NoneType"),
    ({"dilation": "1"}, r"dilation must be an int, a tuple of ints, got str '1'"),
    ({"groups": "1"}, r"groups must be an int, got str '1'"),
    ({"groups": True}, r"groups must be an int, got bool True"),
    ({"layout": 3}, r"layout must be a str, got int 3"),
    ({"padding_mode": None}, r"padding_mode must be a str, got NoneType None"),
])
def test_wrong_types_are_type_errors_naming_the_argument(kw, match):
    with pytest.raises(TypeError, match=rf"^conv_bias_act: {match}"):
        F.conv_bias_act(X, W, **kw)


@pytest.mark.parametrize(("kw", "match"), [
    ({"output_padding": None}, r"output_padding must be an int, a tuple of ints, got None"),
    ({"groups": 1.0}, r"groups must be an int, got float 1.0"),
    ({"output_size": 7}, r"output_size must be None or a sequence of ints, got int 7"),
    ({"output_size": np.array(7)}, r"output_size must be None or a sequence of ints, got "
                                   r"ndarray array\(7\)"),
    ({"output_size": (10.0, 10.0)}, r"output_size must be None or a sequence of ints, got "
                                    r"tuple \(10.0, 10.0\)"),
])
def test_transposed_wrong_types_are_type_errors(kw, match):
    with pytest.raises(TypeError, match=rf"^conv_transpose_bias_act: {match}"):
        FT.conv_transpose_bias_act(X, WT, **kw)


def test_wrong_values_stay_value_errors():
    with pytest.raises(ValueError, match=r"^conv_bias_act: stride"):
        F.conv_bias_act(X, W, stride=0)
    with pytest.raises(ValueError, match=r"^conv_bias_act: unknown layout 'NCDW'"):
        F.conv_bias_act(X, W, layout="NCDW")


def test_errors_name_weight_and_bias_as_the_signature():
    with pytest.raises(ValueError, match=r"^conv_bias_act: weight has dtype float32 but x has "
                                         r"dtype float64"):
        F.conv_bias_act(X, W.astype(np.float32))
    with pytest.raises(ValueError, match=r"^conv_bias_act: bias has shape \(3,\) but \(4,\) is "
                                         r"expected"):
        F.conv_bias_act(X, W, np.ones(3))
    with pytest.raises(ValueError, match=r"^conv_transpose_bias_act: bias has shape"):
        FT.conv_transpose_bias_act(X[:, :3], WT, np.ones(3))


@pytest.mark.parametrize("kw", [{"layout": "b"}, {"activation": "b"}, {"padding_mode": "w"}])
def test_a_users_own_value_is_quoted_as_given(kw):
    """Only the ops' names for the arguments become the signature's, not a value that
    happens to read 'w' or 'b'."""
    with pytest.raises(ValueError) as err:
        F.conv_bias_act(X, W, **kw)
    assert f"'{next(iter(kw.values()))}'" in str(err.value)
    assert "weight" not in str(err.value) and "'bias'" not in str(err.value)


def test_need_dx_must_be_a_bool():
    y, ctx = F.conv_bias_act_forward(X, W)
    with pytest.raises(TypeError, match=r"^conv_bias_act_backward: need_dx must be a bool, got "
                                        r"str 'no'"):
        F.conv_bias_act_backward(np.ones_like(y), ctx, need_dx="no")
    yt, ctxt = FT.conv_transpose_bias_act_forward(X[:, :3], WT)
    with pytest.raises(TypeError, match=r"need_dx must be a bool, got NoneType"):
        FT.conv_transpose_bias_act_backward(np.ones_like(yt), ctxt, need_dx=None)
    assert F.conv_bias_act_backward(np.ones_like(y), ctx, need_dx=np.bool_(False)).dx is None


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "gelu", None])
def test_the_forward_alone_returns_a_writable_output(activation):
    """torch.nn.functional's outputs are writable; the forward alone keeps no context, so
    nothing needs its y protected (the forward with a context still protects it)."""
    y = F.conv_bias_act(X, W, activation=activation)
    y += 1.0
    yt = FT.conv_transpose_bias_act(X[:, :3], WT, activation=activation)
    yt += 1.0
    y2, _ = F.conv_bias_act_forward(X, W, activation="relu")
    with pytest.raises(ValueError, match="read-only"):
        y2 += 1.0
