"""Issue #11, classes 4-7: a backward that raises changes no gradient and keeps the forward's
context (one rule for every layer); outputs aliasing saved tensors are refused; saved
tensors changed between forward and backward are detected where that is possible."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import BackwardBeforeForwardError, ConvfuseError, SavedTensorModifiedError
from convfuse.functional import conv_bias_act_backward, conv_bias_act_forward

ERRORS = (TypeError, ValueError, ConvfuseError)


def _layers():
    """(name, factory, input shape, takes residual); every layer kind convfuse ships."""
    return [
        ("Conv1d", lambda: cf.Conv1d(2, 3, 3, padding=1, activation="relu", device="cpu",
                                     seed=0), (2, 2, 5)),
        ("Conv2d", lambda: cf.Conv2d(2, 4, 3, padding=1, activation="gelu", device="cpu",
                                     seed=1), (2, 2, 5, 5)),
        ("Conv2d", lambda: cf.Conv2d(2, 4, 3, layout="NHWC", activation="tanh", device="cpu",
                                     seed=2), (2, 5, 5, 2)),
        ("Conv3d", lambda: cf.Conv3d(2, 2, 2, device="cpu", seed=3), (1, 2, 3, 3, 3)),
        ("Linear", lambda: cf.Linear(6, 3, activation="sigmoid", device="cpu", seed=4), (4, 6)),
        ("MaxPool2d", lambda: cf.MaxPool2d(2), (2, 2, 4, 4)),
        ("AvgPool2d", lambda: cf.AvgPool2d(3, stride=1, padding=1), (2, 2, 4, 4)),
        ("Flatten", lambda: cf.Flatten(), (2, 2, 3)),
        ("Identity", lambda: cf.Identity(), (2, 3)),
        ("ReLU", lambda: cf.ReLU(), (2, 3)),
        ("Activation", lambda: cf.Activation("silu"), (2, 3)),
        ("Dropout", lambda: cf.Dropout(0.5, seed=0), (4, 5)),
        ("Sequential", lambda: cf.Sequential(
            cf.Conv2d(1, 2, 3, activation="relu", device="cpu", seed=5), cf.MaxPool2d(2),
            cf.Flatten(), cf.Linear(2, 3, device="cpu", seed=6)), (2, 1, 4, 4)),
    ]


LAYERS = _layers()
IDS = [f"{n}-{i}" for i, (n, _, _) in enumerate(LAYERS)]


def _grads(layer):
    return [None if p.grad is None else p.grad.copy() for p in layer.parameters()]


def _setup(factory, shape, seed=0):
    rng = np.random.default_rng(seed)
    layer = factory()
    x = rng.standard_normal(shape).astype(np.float32)
    for p in layer.parameters():  # nonzero starting gradients make double counting visible
        p.grad[...] = rng.standard_normal(p.grad.shape).astype(p.grad.dtype)
    y = layer(x)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    return layer, x, dy


def _reference(factory, shape, seed=0):
    """The gradients one clean backward gives (a fresh layer, same seeds)."""
    layer, _, dy = _setup(factory, shape, seed)
    dx = layer.backward(dy)
    return _grads(layer), dx


def _bad_dys(dy):
    wrong_shape = np.zeros((dy.shape[0] + 1, *dy.shape[1:]), np.float32)
    same_size = dy.reshape(-1)[::-1].reshape(dy.shape[::-1]).copy()
    out = [("str", "dy"), ("list", dy.tolist()), ("None", None), ("set", {1}),
           ("complex", 1j), ("shape", wrong_shape), ("dtype", dy.astype(np.float64))]
    if same_size.shape != dy.shape:
        out.append(("same-size-shape", same_size))
    return out


@pytest.mark.parametrize("name,factory,shape", LAYERS, ids=IDS)
def test_rejected_dy_changes_nothing_and_keeps_the_context(name, factory, shape):
    want, want_dx = _reference(factory, shape)
    layer, _, dy = _setup(factory, shape)
    before = _grads(layer)
    for what, bad in _bad_dys(dy):
        with pytest.raises(ERRORS) as info:
            layer.backward(bad)
        assert not isinstance(info.value, AttributeError), what
        assert str(info.value).startswith(name) or name == "Sequential", (what, info.value)
        for b, p in zip(before, layer.parameters()):
            np.testing.assert_array_equal(p.grad, b, err_msg=what)
    dx = layer.backward(dy)  # the forward's context survived every refusal
    for w, p in zip(want, layer.parameters()):
        np.testing.assert_array_equal(p.grad, w)
    np.testing.assert_array_equal(dx, want_dx)
    with pytest.raises(BackwardBeforeForwardError):
        layer.backward(dy)  # a successful backward consumes the context


def _grad_faults():
    """(what, break the grad of parameter i, repair it) for every way a grad can be wrong."""

    def readonly(p):
        p.grad.flags.writeable = False

    def fix_readonly(p, old):
        p.grad.flags.writeable = True

    saved = {}

    def replace(make):
        def brk(p):
            saved[id(p)] = p.grad
            p.grad = make(p)

        return brk

    def restore(p, old):
        p.grad = saved.pop(id(p))

    return [
        ("read-only", readonly, fix_readonly),
        ("None", replace(lambda p: None), restore),
        ("list", replace(lambda p: p.grad.tolist()), restore),
        ("shape", replace(lambda p: np.zeros((*p.grad.shape, 2), p.grad.dtype)), restore),
        ("dtype", replace(lambda p: p.grad.astype(np.float64)), restore),
        ("non-contiguous", replace(lambda p: np.zeros((*p.grad.shape, 2), p.grad.dtype)[..., 0]),
         restore),
        ("aliases data", replace(lambda p: p.data), restore),
    ]


PARAM_LAYERS = [(n, f, s) for n, f, s in LAYERS if f().parameters()]


@pytest.mark.parametrize("name,factory,shape", PARAM_LAYERS,
                         ids=[n + str(i) for i, (n, _, _) in enumerate(PARAM_LAYERS)])
@pytest.mark.parametrize("fault", _grad_faults(), ids=lambda f: f[0])
def test_bad_gradient_buffer_changes_nothing_then_retry_is_exact(name, factory, shape, fault):
    what, brk, fix = fault
    want, want_dx = _reference(factory, shape)
    params_count = len(factory().parameters())
    for i in range(params_count):  # the weight's, then the bias's, ... (later ones too)
        layer, _, dy = _setup(factory, shape)
        before = _grads(layer)
        target = layer.parameters()[i]
        brk(target)
        with pytest.raises(ERRORS) as info:
            layer.backward(dy)
        assert not isinstance(info.value, AttributeError)
        fix(target, None)
        for b, p in zip(before, layer.parameters()):
            np.testing.assert_array_equal(p.grad, b, err_msg=f"{what} on parameter {i}")
        dx = layer.backward(dy)
        for w, p in zip(want, layer.parameters()):
            np.testing.assert_array_equal(p.grad, w, err_msg=f"{what} on parameter {i}")
        np.testing.assert_array_equal(dx, want_dx)


def test_readonly_weight_grad_does_not_count_the_bias_twice():
    """The issue's example: the bias gradient was added before the weight's failed."""
    conv = cf.Conv2d(1, 2, 3, device="cpu", seed=0)
    x = np.ones((1, 1, 4, 4), np.float32)
    dy = np.ones((1, 2, 2, 2), np.float32)
    conv(x)
    conv.weight.grad.flags.writeable = False
    with pytest.raises(ValueError, match=r"^Conv2d: weight\.grad is read-only"):
        conv.backward(dy)
    conv.weight.grad.flags.writeable = True
    conv.backward(dy)
    np.testing.assert_array_equal(conv.bias.grad, [4.0, 4.0])


def test_sequential_checks_every_layer_before_any_runs():
    seq = cf.Sequential(cf.Conv2d(1, 2, 3, device="cpu", seed=0), cf.Flatten(),
                        cf.Linear(8, 3, device="cpu", seed=1))
    x = np.ones((2, 1, 4, 4), np.float32)
    dy = np.ones((2, 3), np.float32)
    seq(x)
    seq[0].bias.grad.flags.writeable = False  # the layer that runs last in backward
    with pytest.raises(ValueError, match=r"^Conv2d: bias\.grad is read-only"):
        seq.backward(dy)
    assert not seq[2].weight.grad.any() and not seq[2].bias.grad.any()  # nothing half-applied
    seq[0].bias.grad.flags.writeable = True
    seq.backward(dy)
    ref = copy.deepcopy(seq)
    ref.zero_grad()
    ref(x)
    ref.backward(dy)
    for p, q in zip(seq.parameters(), ref.parameters()):
        np.testing.assert_array_equal(p.grad, q.grad)


def test_sequential_refuses_a_layer_without_context_before_running_any():
    seq = cf.Sequential(cf.Linear(3, 3, device="cpu", seed=0), cf.Linear(3, 2, device="cpu"))
    seq(np.ones((1, 3), np.float32))
    seq[0]._ctx = None  # as if that layer's forward had never run
    with pytest.raises(BackwardBeforeForwardError):
        seq.backward(np.ones((1, 2), np.float32))
    assert not seq[1].weight.grad.any()


def test_flatten_refuses_a_same_size_dy_of_another_shape():
    f = cf.Flatten()
    f(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"^Flatten: dy has shape \(4, 6\)"):
        f.backward(np.zeros((4, 6), np.float32))
    assert f.backward(np.ones((2, 12), np.float32)).shape == (2, 3, 4)


# -- class 6: aliasing --------------------------------------------------------------------
def _functional_ctx():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 2, 8, 8))
    w = rng.standard_normal((3, 2, 3, 3))
    b = rng.standard_normal(3)
    y, ctx = conv_bias_act_forward(x, w, b, activation="relu")
    return ctx, rng.standard_normal(y.shape)


@pytest.mark.parametrize("arg,source", [("dweight", "ctx.weight"), ("dweight", "ctx.x"),
                                        ("dbias", "dy"), ("dweight", "ctx.saved"),
                                        ("dbias", "ctx.weight")])
def test_functional_backward_refuses_outputs_aliasing_saved_tensors(arg, source):
    ctx, dy = _functional_ctx()
    src = {"ctx.weight": ctx.weight, "ctx.x": ctx.x, "ctx.saved": ctx.saved, "dy": dy}[source]
    snapshot = (ctx.x.copy(), ctx.weight.copy(), dy.copy())
    flat = src.reshape(-1)
    size = ctx.weight.size if arg == "dweight" else 3
    if flat.size < size:
        pytest.skip("source too small to alias")
    alias = flat[:size].reshape(ctx.weight.shape if arg == "dweight" else (3,))
    kwargs = {"dweight": np.zeros(ctx.weight.shape), "dbias": np.zeros(3)}
    kwargs[arg] = alias
    with pytest.raises(ValueError, match=rf"conv_bias_act_backward: {arg} shares memory with "
                                         rf"{source.replace('.', '[.]')}"):
        conv_bias_act_backward(dy, ctx, **kwargs)
    for a, b in zip((ctx.x, ctx.weight, dy), snapshot):
        np.testing.assert_array_equal(a, b)


def test_functional_backward_refuses_dweight_equal_to_the_weight_and_keeps_dx_right():
    ctx, dy = _functional_ctx()
    with pytest.raises(ValueError, match=r"dweight shares memory with ctx\.weight"):
        conv_bias_act_backward(dy, ctx, dweight=ctx.weight, dbias=np.zeros(3))
    ref = conv_bias_act_backward(dy, ctx)
    again = conv_bias_act_backward(dy, ctx, dweight=np.zeros_like(ctx.weight), dbias=np.zeros(3))
    np.testing.assert_array_equal(ref.dx, again.dx)


def test_layer_whose_weight_grad_is_its_weight_is_refused():
    conv = cf.Conv2d(1, 2, 3, device="cpu", seed=0)
    w = conv.weight.data.copy()
    conv(np.ones((1, 1, 3, 3), np.float32))
    conv.weight.grad = conv.weight.data
    with pytest.raises(ValueError, match=r"^Conv2d: weight\.grad shares memory with weight"):
        conv.backward(np.ones((1, 2, 1, 1), np.float32))
    np.testing.assert_array_equal(conv.weight.data, w)


# -- class 7: saved tensors changed between forward and backward --------------------------
def _trained_pair(opt_cls, **kw):
    lin = cf.Linear(3, 2, activation="relu", device="cpu", seed=0)
    opt = opt_cls(lin.parameters(), lr=0.1, **kw)
    return lin, opt


@pytest.mark.parametrize("opt_cls,kw", [(cf.optim.SGD, {"momentum": 0.9}), (cf.optim.Adam, {}),
                                        (cf.optim.AdamW, {})])
def test_optimizer_step_between_forward_and_backward_is_detected(opt_cls, kw):
    lin, opt = _trained_pair(opt_cls, **kw)
    y = lin(np.ones((2, 3), np.float32))
    opt.step()
    with pytest.raises(SavedTensorModifiedError, match=r"^Linear\.backward: parameter .weight."):
        lin.backward(np.ones_like(y))
    assert not lin.weight.grad.any()
    lin(np.ones((2, 3), np.float32))
    lin.backward(np.ones_like(y))  # a new forward is fine


def test_load_state_dict_and_data_assignment_between_forward_and_backward_are_detected():
    conv = cf.Conv2d(1, 2, 3, device="cpu", seed=0)
    x, dy = np.ones((1, 1, 3, 3), np.float32), np.ones((1, 2, 1, 1), np.float32)
    conv(x)
    conv.load_state_dict(conv.state_dict())
    with pytest.raises(SavedTensorModifiedError):
        conv.backward(dy)
    conv(x)
    conv.bias.data = conv.bias.data * 2
    with pytest.raises(SavedTensorModifiedError, match="bias"):
        conv.backward(dy)
    conv(x)
    conv.weight = cf.Parameter(conv.weight.data.copy(), "weight")
    with pytest.raises(SavedTensorModifiedError):
        conv.backward(dy)


@pytest.mark.parametrize("make", [
    lambda: cf.Conv2d(1, 2, 1, activation="relu", device="cpu"),
    lambda: cf.MaxPool2d(1),
    lambda: cf.ReLU(),
])
def test_saved_outputs_are_read_only_on_the_cpu(make):
    layer = make()
    y = layer(np.ones((1, 1, 2, 2), np.float32) if not isinstance(layer, cf.ReLU)
              else np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        y += 1


def test_an_output_nothing_saved_stays_writable():
    y = cf.Conv2d(1, 2, 1, device="cpu")(np.ones((1, 1, 2, 2), np.float32))  # identity
    y += 1


def test_functional_saved_preactivation_is_read_only():
    x, w = np.ones((1, 1, 2, 2)), np.ones((1, 1, 1, 1))
    _, ctx = conv_bias_act_forward(x, w, activation="gelu")
    assert not ctx.saved.flags.writeable


def test_backward_through_one_layer_instance_at_two_positions_is_refused_unchanged():
    lin = cf.Linear(2, 2, device="cpu", seed=0)
    seq = cf.Sequential(lin, cf.ReLU(), lin)
    seq(np.ones((1, 2), np.float32))  # forward (inference) works
    with pytest.raises(ValueError, match=r"^Sequential: item 2 is the same Linear object as "
                                         r"item 0"):
        seq.backward(np.ones((1, 2), np.float32))
    assert not lin.weight.grad.any() and not lin.bias.grad.any()


def test_building_an_optimizer_between_forward_and_backward_is_no_write():
    """The optimizer takes the values over into its flat buffer (the same values): the
    backward of a forward run before it runs, its gradients land in the optimizer's
    buffer, and the step equals that of an optimizer built first."""
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32)

    def train(build_first):
        conv = cf.Conv2d(3, 4, 3, activation="relu", device="cpu", seed=0)
        opt = cf.optim.SGD(conv.parameters(), lr=0.1) if build_first else None
        y = conv(x)
        opt = opt or cf.optim.SGD(conv.parameters(), lr=0.1)
        conv.backward(np.ones_like(y))
        opt.step()
        return conv.weight.data.copy(), conv.bias.data.copy()

    for a, b in zip(train(False), train(True)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("build", [
    lambda a, c: cf.Sequential(cf.Sequential(a, c), cf.Sequential(c)),
    lambda a, c: cf.Sequential(a, cf.Sequential(cf.ReLU(), c), c),
    lambda a, c: cf.Residual(cf.Sequential(a, c), shortcut=c),
    lambda a, c: cf.Sequential(cf.Residual(cf.Sequential(a, c), activation=None),
                               cf.Residual(cf.Sequential(cf.ReLU(), c), activation=None)),
])
def test_a_layer_at_two_positions_in_nested_containers_is_refused_unchanged(build):
    """The check sees through nested Sequentials and residual blocks: refused before any
    gradient is written (it used to raise part-way, the first branch's gradients written)."""
    a = cf.Conv2d(3, 3, 3, padding=1, device="cpu", dtype="float64", seed=0)
    c = cf.Conv2d(3, 3, 3, padding=1, device="cpu", dtype="float64", seed=1)
    model = build(a, c)
    y = model(np.random.default_rng(0).standard_normal((1, 3, 4, 4)))
    with pytest.raises(ValueError, match=r"item [0-9.]+ is the same Conv2d object as item "
                                         r"[0-9.]+; .* used twice is refused"):
        model.backward(np.ones_like(y))
    for layer in (a, c):
        assert not layer.weight.grad.any() and not layer.bias.grad.any()


def test_a_layer_once_in_nested_containers_runs_backward():
    convs = [cf.Conv2d(2, 2, 1, device="cpu", dtype="float64", seed=i) for i in range(3)]
    model = cf.Sequential(cf.Sequential(convs[0]), cf.Residual(cf.Sequential(convs[1], convs[2])))
    y = model(np.ones((1, 2, 2, 2)))
    model.backward(np.ones_like(y))
    assert all(c.weight.grad.any() for c in convs)
