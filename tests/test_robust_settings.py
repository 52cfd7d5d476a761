"""Issue #11, classes 2 and 3: configuration attributes that take effect and are validated,
and layer hyperparameters that take effect when assigned (or refuse to be)."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

import convfuse as cf
from convfuse import config
from convfuse.geometry import ConvGeometry
from convfuse.plan.conv import PlanKey


@pytest.fixture(autouse=True)
def _restore_flags():
    before = config.get()
    yield
    config.set_flags(**{f: getattr(before, f) for f in before.__dataclass_fields__})


def test_documented_flags_read_and_assign_as_attributes_and_take_effect():
    geom = ConvGeometry.create((1, 2, 4, 4), (3, 2, 3, 3))
    assert config.allow_tf32 is True and config.benchmark is False
    assert config.bias_grad == "cudnn" and config.deterministic is False
    assert config.workspace_limit is None
    tf32_key = PlanKey.create(geom, "float32")
    config.allow_tf32 = False
    assert config.get().allow_tf32 is False and config.allow_tf32 is False
    assert PlanKey.create(geom, "float32").math_type != tf32_key.math_type
    config.benchmark = np.bool_(True)
    config.deterministic = True
    config.workspace_limit = np.int64(1 << 20)
    config.bias_grad = "fused"
    key = PlanKey.create(geom, "float32")
    assert (key.benchmark, key.deterministic, key.workspace_limit) == (True, True, 1 << 20)
    assert type(config.workspace_limit) is int and config.get().bias_grad == "fused"
    with config.flags(allow_tf32=True):
        assert config.allow_tf32 is True
    assert config.allow_tf32 is False


@pytest.mark.parametrize("name,value,exc", [
    ("allow_tf32", "yes", TypeError), ("allow_tf32", 1, TypeError),
    ("benchmark", None, TypeError), ("deterministic", 0.0, TypeError),
    ("workspace_limit", -1, ValueError), ("workspace_limit", 1.5, TypeError),
    ("bias_grad", "sum", ValueError), ("bias_grad", None, ValueError),
    ("max_array_bytes", "1GB", TypeError),
])
def test_flag_assignment_is_validated_and_leaves_the_flags_alone(name, value, exc):
    before = config.get()
    with pytest.raises(exc, match=f"config.{name}"):
        setattr(config, name, value)
    with pytest.raises(exc):
        config.set_flags(**{name: value})
    assert config.get() == before


def test_unknown_flag_assignment_is_an_error():
    with pytest.raises(AttributeError, match="no flag 'allow_tf23'"):
        config.allow_tf23 = False
    with pytest.raises(AttributeError, match="no attribute 'benchmarks'"):
        _ = config.benchmarks
    assert "allow_tf32" in dir(config)


# -- class 3: hyperparameters assigned after construction --------------------------------
def _twin(**kw):
    return cf.Conv2d(2, 3, 3, device="cpu", seed=0, **kw)


@pytest.mark.parametrize("name,value", [("padding", 1), ("padding", "same"), ("stride", 2),
                                        ("dilation", 2), ("activation", "relu"),
                                        ("padding", (2, 0))])
def test_conv_hyperparameters_assigned_after_a_forward_take_effect(name, value):
    x = np.random.default_rng(0).standard_normal((1, 2, 7, 7)).astype(np.float32)
    conv = _twin()
    conv(x)  # caches the geometry for this shape
    setattr(conv, name, value)
    fresh = _twin(**{name: value})
    y = conv(x)
    np.testing.assert_array_equal(y, fresh(x))
    dy = np.ones_like(y)
    np.testing.assert_array_equal(conv.backward(dy), fresh.backward(dy))


@pytest.mark.parametrize("name,value,exc", [
    ("padding", -1, ValueError), ("padding", "full", ValueError), ("stride", 0, ValueError),
    ("stride", "2", TypeError), ("dilation", [1, 2, 3], ValueError),
    ("activation", 3, TypeError), ("residual_scale", "x", TypeError),
])
def test_bad_hyperparameter_assignment_is_refused_and_changes_nothing(name, value, exc):
    conv = _twin(padding=1)
    before = getattr(conv, name)
    with pytest.raises(exc, match=rf"^Conv2d: {name}"):
        setattr(conv, name, value)
    assert getattr(conv, name) == before


def test_padding_same_refuses_a_later_stride():
    conv = _twin(padding="same")
    with pytest.raises(ValueError, match=r"^Conv2d: padding=.same. needs stride 1"):
        conv.stride = 2
    assert conv.stride == (1, 1)


@pytest.mark.parametrize("layer,name", [
    (lambda: _twin(), "kernel_size"), (lambda: _twin(), "in_channels"),
    (lambda: _twin(), "out_channels"), (lambda: _twin(), "groups"), (lambda: _twin(), "layout"),
    (lambda: _twin(), "dtype"), (lambda: cf.Linear(2, 3, device="cpu"), "in_features"),
    (lambda: cf.Linear(2, 3, device="cpu"), "out_features"),
])
def test_shape_fixing_hyperparameters_are_read_only(layer, name):
    lyr = layer()
    before = getattr(lyr, name)
    with pytest.raises(AttributeError, match=rf"{type(lyr).__name__}: {name} is fixed at "
                                             "construction"):
        setattr(lyr, name, 5)
    assert getattr(lyr, name) == before


def test_pool_hyperparameters_assigned_after_a_forward_take_effect():
    x = np.random.default_rng(1).standard_normal((1, 1, 6, 6)).astype(np.float32)
    pool = cf.MaxPool2d(2)
    pool(x)
    pool.kernel_size = 3
    pool.stride = 1
    pool.padding = 1
    np.testing.assert_array_equal(pool(x), cf.MaxPool2d(3, stride=1, padding=1)(x))
    with pytest.raises(ValueError, match=r"^MaxPool2d: padding must be at most half"):
        pool.padding = 2
    assert pool.padding == (1, 1)


def test_linear_activation_assignment_takes_effect():
    lin = cf.Linear(3, 2, device="cpu", seed=0)
    x = -np.ones((1, 3), np.float32)
    lin(x)
    lin.activation = "relu"
    assert (lin(x) >= 0).all()


# -- the example's progress bar ------------------------------------------------------------
def _progress():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    spec = importlib.util.spec_from_file_location("train_digits_for_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.progress


def test_progress_writes_one_line_per_epoch_when_not_a_terminal():
    progress = _progress()
    log = io.StringIO()
    for epoch in (1, 2):
        for done in range(1, 5):
            progress(epoch, 2, done, 4, stream=log)
    text = log.getvalue()
    assert "\r" not in text
    assert text.splitlines() == [f"epoch  {e}/2 [{'#' * 30}] 4/4" for e in (1, 2)]


def test_progress_redraws_in_place_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    progress = _progress()
    tty = Tty()
    for done in range(1, 4):
        progress(1, 1, done, 3, stream=tty)
    assert tty.getvalue().count("\r") == 3 and tty.getvalue().endswith("3/3\n")
    assert sys.stderr is not tty
