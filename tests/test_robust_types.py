"""Issue #11, classes 8-12: wrong Python types at every public entry point get typed errors
naming the layer (or function) and the argument; hyperparameters are validated at
construction; non-contiguous inputs work; impossible allocations fail fast."""

from __future__ import annotations

import time

import numpy as np
import pytest

import convfuse as cf
from convfuse import functional as F
from convfuse.errors import ArrayTooLargeError, ConvfuseError

TYPED = (TypeError, ValueError, ConvfuseError)
X4 = np.ones((1, 2, 4, 4), np.float32)


def _expect(call, name, arg):
    with pytest.raises(TYPED) as info:
        call()
    assert not isinstance(info.value, AttributeError)
    msg = str(info.value)
    assert msg.startswith(f"{name}:") or msg.startswith(f"{name}."), msg
    assert arg in msg, msg
    return info.value


CONSTRUCTORS = [
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, padding="full"), "padding"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, padding=-1), "padding"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, padding=[1]), "padding"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, padding=None), "padding"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, stride=2, padding="same"), "same"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, bias="no"), "bias"),
    ("Conv2d", lambda: cf.Conv2d(2, 4, 3, groups=2.0), "groups"),
    ("Conv2d", lambda: cf.Conv2d(2, 4, 3, groups=2.5), "groups"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, groups=2), "groups"),
    ("Conv2d", lambda: cf.Conv2d("2", 3, 3), "in_channels"),
    ("Conv2d", lambda: cf.Conv2d(2, None, 3), "out_channels"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, {3}), "kernel_size"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, (3, "a")), "kernel_size"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 0), "kernel_size"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, stride=0), "stride"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, stride=1j), "stride"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, dilation=None), "dilation"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, activation=5), "activation"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, activation=["relu"]), "activation"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, activation="swishy"), "activation"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, layout=3), "layout"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, layout="NCDHW"), "layout"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, dtype="int64"), "dtype"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, device=5), "device"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, device="tpu"), "device"),
    ("Conv2d", lambda: cf.Conv2d(2, 3, 3, seed="x"), "seed"),
    ("Conv1d", lambda: cf.Conv1d(2, 3, (3, 3)), "kernel_size"),
    ("Conv3d", lambda: cf.Conv3d(2, 3, 3, padding=(1, 1)), "padding"),
    ("Linear", lambda: cf.Linear(None, 3), "in_features"),
    ("Linear", lambda: cf.Linear(3, "4"), "out_features"),
    ("Linear", lambda: cf.Linear(3, 4, bias=None), "bias"),
    ("Linear", lambda: cf.Linear(3, 4, activation=1.5), "activation"),
    ("Linear", lambda: cf.Linear(3, 4, dtype="complex64"), "dtype"),
    ("MaxPool2d", lambda: cf.MaxPool2d("2"), "kernel_size"),
    ("MaxPool2d", lambda: cf.MaxPool2d(2, padding=-1), "padding"),
    ("MaxPool2d", lambda: cf.MaxPool2d(2, padding=2), "padding"),
    ("AvgPool2d", lambda: cf.AvgPool2d(2, stride=0), "stride"),
    ("AvgPool2d", lambda: cf.AvgPool2d(2, layout=None), "layout"),
    ("Dropout", lambda: cf.Dropout("0.5"), "p"),
    ("Dropout", lambda: cf.Dropout(1j), "p"),
    ("Dropout", lambda: cf.Dropout(0.5, seed=[1]), "seed"),
    ("Activation", lambda: cf.Activation({"relu"}), "activation"),
    ("SGD", lambda: cf.optim.SGD(None, lr=0.1), "params"),
    ("SGD", lambda: cf.optim.SGD(cf.Linear(2, 2, device="cpu").parameters(), lr="0.1"), "lr"),
    ("SGD", lambda: cf.optim.SGD(cf.Linear(2, 2, device="cpu").parameters(), lr=None), "lr"),
    ("SGD", lambda: cf.optim.SGD(cf.Linear(2, 2, device="cpu").parameters(), lr=0.1,
                                 momentum=[0.9]), "momentum"),
    ("SGD", lambda: cf.optim.SGD(cf.Linear(2, 2, device="cpu").parameters(), lr=0.1,
                                 nesterov="yes"), "nesterov"),
    ("Adam", lambda: cf.optim.Adam(cf.Linear(2, 2, device="cpu").parameters(), lr=1j), "lr"),
    ("Adam", lambda: cf.optim.Adam(cf.Linear(2, 2, device="cpu").parameters(),
                                   betas={0.9, 0.99}), "betas"),
    ("Adam", lambda: cf.optim.Adam(cf.Linear(2, 2, device="cpu").parameters(),
                                   betas=(0.9, "x")), "betas"),
    ("AdamW", lambda: cf.optim.AdamW(cf.Linear(2, 2, device="cpu").parameters(),
                                     weight_decay=None), "weight_decay"),
    ("AdamW", lambda: cf.optim.AdamW(cf.Linear(2, 2, device="cpu").parameters(), eps="1e-8"),
     "eps"),
]


@pytest.mark.parametrize("name,call,arg", CONSTRUCTORS,
                         ids=[f"{n}-{a}-{i}" for i, (n, _, a) in enumerate(CONSTRUCTORS)])
def test_bad_constructor_arguments_fail_at_construction_naming_layer_and_argument(
        name, call, arg):
    _expect(call, name, arg)


def test_dtype_errors_never_suggest_an_unsupported_dtype():
    conv = cf.Conv2d(2, 3, 3, device="cpu")
    err = _expect(lambda: conv(X4.astype(np.int64)), "Conv2d", "dtype")
    assert "dtype='int64'" not in str(err) and "dtype=int64" not in str(err)
    assert "astype('float32')" in str(err)
    err = _expect(lambda: conv(X4.astype(np.float64)), "Conv2d", "dtype")
    assert "dtype='float64'" in str(err)
    err = _expect(lambda: cf.Linear(2, 3, device="cpu")(np.ones((1, 2), np.int32)), "Linear",
                  "dtype")
    assert "int32'" not in str(err)


def test_numpy_integers_are_accepted_wherever_python_ints_are():
    i = np.int64
    conv = cf.Conv2d(i(2), i(4), (i(3), i(3)), stride=i(1), padding=i(1), dilation=i(1),
                     groups=i(2), seed=i(0), device="cpu")
    ref = cf.Conv2d(2, 4, 3, padding=1, groups=2, seed=0, device="cpu")
    np.testing.assert_array_equal(conv(X4), ref(X4))
    assert isinstance(conv.groups, int) and type(conv.kernel_size[0]) is int
    lin = cf.Linear(np.int32(3), np.int64(2), seed=np.int64(1), device="cpu")
    assert lin.in_features == 3 and type(lin.in_features) is int
    pool = cf.MaxPool2d(np.int64(2), stride=np.int16(2), padding=np.int8(0))
    assert pool(X4).shape == (1, 2, 2, 2)


CALLS = [
    ("Conv2d", lambda c: c(X4.tolist()), "input"),
    ("Conv2d", lambda c: c(None), "input"),
    ("Conv2d", lambda c: c("x"), "input"),
    ("Conv2d", lambda c: c(X4, residual=[1.0]), "residual"),
    ("Conv2d", lambda c: c(np.ones((1, 3, 4, 4), np.float32)), "channels"),
    ("Conv2d", lambda c: c(np.ones((2, 4, 4), np.float32)), "4-d"),
    ("Conv2d", lambda c: c(X4, residual=np.ones((1, 3, 9, 9), np.float32)), "residual"),
]


@pytest.mark.parametrize("name,call,arg", CALLS, ids=[f"{a}-{i}" for i, (_, _, a) in
                                                       enumerate(CALLS)])
def test_layer_calls_name_the_layer_not_the_op(name, call, arg):
    conv = cf.Conv2d(2, 3, 3, padding=1, device="cpu")
    err = _expect(lambda: call(conv), name, arg)
    assert "conv_bias_act" not in str(err)


@pytest.mark.parametrize("layer,bad", [
    (lambda: cf.Linear(2, 3, device="cpu"), [[1.0, 2.0]]),
    (lambda: cf.MaxPool2d(2), {1, 2}),
    (lambda: cf.AvgPool2d(2), 3.0),
    (lambda: cf.Flatten(), None),
    (lambda: cf.Identity(), "x"),
    (lambda: cf.ReLU(), 1j),
    (lambda: cf.Dropout(), [1.0]),
    (lambda: cf.Sequential(cf.Flatten()), (1, 2)),
])
def test_every_layer_call_types_its_input_error(layer, bad):
    lyr = layer()
    name = type(lyr).__name__ if not isinstance(lyr, cf.Sequential) else "Flatten"
    _expect(lambda: lyr(bad), name, "input")


FUNCTIONAL = [
    (lambda: F.conv_bias_act(X4.tolist(), np.ones((3, 2, 3, 3), np.float32)), "x"),
    (lambda: F.conv_bias_act(X4, None), "weight"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), bias="b"), "bias"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), residual_scale="a"),
     "residual_scale"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), residual_scale=1j),
     "residual_scale"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), activation=3),
     "activation"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), None,
                             stride="2"), "stride"),
    # int() would have run another convolution: groups 2.9 as 2, "1" as 1, True as 1
    (lambda: F.conv_bias_act(np.ones((1, 4, 3, 3)), np.ones((4, 2, 1, 1)), groups=2.9),
     "groups"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), groups="1"), "groups"),
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32), groups=True), "groups"),
]


@pytest.mark.parametrize("call,arg", FUNCTIONAL, ids=[a for _, a in FUNCTIONAL])
def test_functional_entry_points_type_their_arguments(call, arg):
    _expect(call, "conv_bias_act", arg)


def test_functional_backward_types_ctx_dy_and_buffers():
    y, ctx = F.conv_bias_act_forward(X4, np.ones((3, 2, 3, 3), np.float32))
    _expect(lambda: F.conv_bias_act_backward(np.ones_like(y), None), "conv_bias_act_backward",
            "ctx")
    _expect(lambda: F.conv_bias_act_backward("dy", ctx), "conv_bias_act_backward", "dy")
    _expect(lambda: F.conv_bias_act_backward(np.ones_like(y), ctx, dweight=[0.0]),
            "conv_bias_act_backward", "dweight")
    _expect(lambda: F.conv_bias_act_backward(np.ones_like(y), ctx, accumulate=True),
            "conv_bias_act_backward", "dweight")


def test_loss_names_itself_and_the_argument():
    loss = cf.CrossEntropyLoss()
    _expect(lambda: loss([[1.0, 2.0]], np.array([0])), "CrossEntropyLoss", "logits")
    _expect(lambda: loss(np.ones((1, 2), np.float32), None), "CrossEntropyLoss", "labels")
    _expect(lambda: loss(np.ones((1, 2), np.float32), np.array([5])), "CrossEntropyLoss",
            "labels")


def test_optimizer_lr_assignment_is_typed():
    opt = cf.optim.SGD(cf.Linear(2, 2, device="cpu").parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"^SGD: lr must be a real number"):
        opt.lr = "0.2"
    assert opt.lr == 0.1


# -- class 11: non-contiguous inputs ------------------------------------------------------
def test_non_contiguous_inputs_work_and_are_never_modified():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((1, 4, 4, 2)).astype(np.float32)
    x = base.transpose(0, 3, 1, 2)  # NCHW view of NHWC memory: not C-contiguous
    assert not x.flags.c_contiguous
    keep = base.copy()
    conv = cf.Conv2d(2, 3, 3, padding=1, activation="relu", device="cpu", seed=0)
    ref = cf.Conv2d(2, 3, 3, padding=1, activation="relu", device="cpu", seed=0)
    y = conv(x)
    np.testing.assert_array_equal(y, ref(np.ascontiguousarray(x)))
    dy_base = rng.standard_normal((1, 4, 4, 3)).astype(np.float32)
    dy = dy_base.transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(conv.backward(dy), ref.backward(np.ascontiguousarray(dy)))
    np.testing.assert_array_equal(conv.weight.grad, ref.weight.grad)
    np.testing.assert_array_equal(base, keep)
    assert not x.flags.c_contiguous

    lin = cf.Linear(2, 3, device="cpu", seed=0)
    xl = rng.standard_normal((3, 4)).astype(np.float32)[:, ::2]
    np.testing.assert_array_equal(lin(xl), lin(np.ascontiguousarray(xl)))
    for pool in (cf.MaxPool2d(2), cf.AvgPool2d(2)):
        np.testing.assert_array_equal(pool(x), pool(np.ascontiguousarray(x)))
    np.testing.assert_array_equal(cf.ReLU()(xl), np.maximum(xl, 0))
    w = rng.standard_normal((3, 3, 3, 2)).astype(np.float32).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(F.conv_bias_act(x, w), F.conv_bias_act(
        np.ascontiguousarray(x), np.ascontiguousarray(w)))


# -- class 12: memory bombs ---------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: cf.Conv2d(3, 10**9, 3, device="cpu"),
    lambda: cf.Conv3d(10**5, 10**5, 5, device="cpu"),
    lambda: cf.Linear(10**6, 10**6, device="cpu"),
])
def test_huge_parameters_fail_fast_stating_the_bytes(make):
    start = time.perf_counter()
    with pytest.raises(ArrayTooLargeError, match=r"needs [\d,]+ bytes") as info:
        make()
    assert time.perf_counter() - start < 1.0
    assert isinstance(info.value, MemoryError)


def test_huge_outputs_fail_before_allocating():
    with cf.config.flags(max_array_bytes=10_000):
        conv = cf.Conv2d(1, 8, 1, device="cpu")
        with pytest.raises(ArrayTooLargeError, match=r"^Conv2d: output of shape \(1, 8, 32, 32\)"
                                                     r" \(float32\) needs 32,768 bytes"):
            conv(np.ones((1, 1, 32, 32), np.float32))
        with pytest.raises(ArrayTooLargeError, match=r"^MaxPool2d: output"):
            cf.MaxPool2d(1)(np.ones((1, 1, 64, 64), np.float32))
        with pytest.raises(ArrayTooLargeError, match=r"^conv_bias_act: output"):
            F.conv_bias_act(np.ones((1, 1, 64, 64), np.float32), np.ones((1, 1, 1, 1),
                                                                         np.float32))
    assert conv(np.ones((1, 1, 32, 32), np.float32)).shape == (1, 8, 32, 32)


def test_optimizer_load_state_dict_types_its_entries():
    lin = cf.Linear(2, 2, device="cpu")
    opt = cf.optim.Adam(lin.parameters())
    sd = opt.state_dict()
    sd["state"][0]["step"] = "one"
    _expect(lambda: opt.load_state_dict(sd), "Adam", "step")
    sd = opt.state_dict()
    sd["state"][1]["exp_avg"] = np.array(["a", "b"])
    _expect(lambda: opt.load_state_dict(sd), "Adam", "exp_avg")
    _expect(lambda: opt.load_state_dict([1]), "Adam", "state_dict")


@pytest.mark.parametrize("call", [
    lambda: cf.ops.activation_forward(np.ones(2), ["relu"]),
    lambda: cf.ops.activation_backward(np.ones(2), np.ones(2), {"relu"}),
])
def test_activation_ops_type_the_activation(call):
    with pytest.raises(TypeError, match="activation must be a str or None"):
        call()


def test_the_cpu_engines_im2col_buffer_is_checked_too():
    conv = cf.Conv2d(4, 1, 5, padding=2, stride=2, device="cpu")  # im2col 100 KiB
    with cf.config.flags(max_array_bytes=20_000), \
            pytest.raises(ArrayTooLargeError, match=r"^Conv2d: the CPU engine's im2col buffer"
                                                    r" of shape \(100, 1, 16, 16\)"):
        conv(np.ones((1, 4, 32, 32), np.float32))


def test_the_cpu_engines_padded_input_is_checked_for_stride_1():
    # no im2col for stride 1: the padded flat input, 4 rows of 70 + 34*34 + 140 elements
    conv = cf.Conv2d(4, 1, 5, padding=2, device="cpu")
    with cf.config.flags(max_array_bytes=20_000), \
            pytest.raises(ArrayTooLargeError, match=r"^Conv2d: the CPU engine's padded input"
                                                    r" of shape \(4, 1366\)"):
        conv(np.ones((1, 4, 32, 32), np.float32))
    with cf.config.flags(max_array_bytes=22_000):
        assert conv(np.ones((1, 4, 32, 32), np.float32)).shape == (1, 1, 32, 32)


def test_module_api_arguments_are_typed():
    lin = cf.Linear(2, 2, device="cpu")
    _expect(lambda: lin.to("tpu"), "Linear", "device")
    _expect(lambda: lin.to(None if False else 3), "Linear", "device")
    _expect(lambda: setattr(lin, "needs_input_grad", "no"), "Linear", "needs_input_grad")
    _expect(lambda: lin.train("yes"), "Linear", "mode")
    assert lin.needs_input_grad is True and lin.training is True


@pytest.mark.parametrize("call, name, arg", [
    (lambda: F.conv_bias_act(X4, np.ones((3, 2, 3, 3), np.float32),
                             residual=np.ones((1, 3, 2, 2), np.float32),
                             residual_scale=10**400), "conv_bias_act", "residual_scale"),
    (lambda: cf.BatchNorm2d(2, eps=10**400, device="cpu"), "BatchNorm2d", "eps"),
    (lambda: cf.BatchNorm2d(2, momentum=-10**400, device="cpu"), "BatchNorm2d", "momentum"),
    (lambda: cf.Dropout(10**400), "Dropout", "p"),
    (lambda: cf.optim.SGD([cf.Parameter(np.zeros(2))], lr=10**400), "SGD", "learning rate"),
])
def test_ints_beyond_floats_range_are_refused_naming_the_argument(call, name, arg):
    """10**400 has no float: refused as out of range (ValueError naming the argument), not
    an OverflowError naming nothing, nor accepted as inf."""
    with pytest.raises(ValueError) as got:
        call()
    assert arg in str(got.value)
    assert str(got.value).startswith(f"{name}:")
