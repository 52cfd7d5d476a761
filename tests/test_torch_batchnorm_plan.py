"""convfuse.torch's BatchNorm call plans (Note [batch-norm call plans] and Note [the host
path] in convfuse/torch/_bn_plan.py): one plan per call signature, its eager call bit for bit
the custom ops' (the path tracers see), a new plan when anything it decided from changes
(hyperparameters, a buffer's dtype or strides), no per-layer state in a shared plan, and the
parameters read through parametrizations and functional_call."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402
import convfuse.torch._eager as eager  # noqa: E402
from convfuse.torch import _bn_plan  # noqa: E402
from convfuse.torch import batchnorm as bn_module  # noqa: E402

F64 = torch.float64


def _custom_op_calls(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("convfuse::")]


def _same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride()
        assert torch.equal(u, v), (u, v)


def _run(path, make, x_shape=(3, 2, 4, 5), dtype=F64, cl=False, strided_x=False,
         residual=False, steps=2, grad=True):
    """Every number of `steps` forward+backward calls of a fresh layer along `path`
    ("eager" or "custom_op"), the buffers after each."""
    torch.manual_seed(0)
    layer = make()
    out = []
    with pytest.MonkeyPatch.context() as mp:
        if path == "custom_op":
            mp.setattr(eager, "takes_eager_path", lambda *a: False)
        for step in range(steps):
            torch.manual_seed(10 + step)
            x = torch.randn(*x_shape, dtype=torch.float32).to(dtype)
            if cl:
                x = x.contiguous(memory_format=torch.channels_last)
            if strided_x:  # not contiguous: the host path's x is a copy
                x = torch.cat([x, x], dim=-1)[..., ::2]
            x.requires_grad_(grad)
            r = torch.randn(x.shape).to(dtype).requires_grad_(grad) if residual else None
            y = layer(x, r) if residual else layer(x)
            out.append(y.detach().clone())
            if grad:
                inputs = [x, *[p for p in layer.parameters() if p.requires_grad],
                          *([r] if residual else [])]
                grads = torch.autograd.grad((y.double() ** 2).sum(), inputs)
                out += [g.detach().clone() for g in grads]
            out += [b.detach().clone() for b in layer.buffers()]
    return out


CASES = {
    "f64-relu-residual": (lambda: ct.BatchNorm2d(2, activation="relu", dtype=F64),
                          dict(residual=True)),
    "f32-gelu-channels-last": (lambda: ct.BatchNorm2d(2, activation="gelu"),
                               dict(dtype=torch.float32, cl=True)),
    "f16-half-params": (lambda: ct.BatchNorm2d(2, activation="relu", dtype=torch.float16),
                        dict(dtype=torch.float16)),
    "bf16-float32-params": (lambda: ct.BatchNorm2d(2, activation="silu"),
                            dict(dtype=torch.bfloat16, residual=True)),
    "strided-x": (lambda: ct.BatchNorm2d(2, activation="tanh", dtype=F64),
                  dict(strided_x=True)),
    "cumulative-1d": (lambda: ct.BatchNorm1d(2, momentum=None, dtype=F64),
                      dict(x_shape=(4, 2, 3))),
    "affine-false-3d": (lambda: ct.BatchNorm3d(2, affine=False, activation="relu",
                                               dtype=F64), dict(x_shape=(2, 2, 2, 3, 2))),
    "no-running-stats": (lambda: ct.BatchNorm2d(2, track_running_stats=False, dtype=F64),
                         dict()),
    "eval": (lambda: ct.BatchNorm2d(2, activation="silu", dtype=F64).eval(), dict()),
    "frozen-params": (lambda: ct.BatchNorm2d(2, dtype=F64).requires_grad_(False),
                      dict(grad=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_is_the_custom_ops_bit_for_bit(case):
    make, kw = CASES[case]
    _same(_run("eager", make, **kw), _run("custom_op", make, **kw))


def test_the_eager_call_runs_the_plans_node_and_no_custom_op():
    layer = ct.BatchNorm2d(3, activation="relu")
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    layer(x).sum().backward()
    y = layer(x)
    assert type(y.grad_fn).__name__ == "BatchNormFunctionBackward"
    assert isinstance(y.grad_fn, _bn_plan.BatchNormFunction._backward_cls)
    assert _custom_op_calls(lambda: layer(x).sum().backward()) == []
    with torch.no_grad():
        assert layer(x).grad_fn is None
    # a gradient of a tensor subclass goes to the backward custom op, as on the general path
    class Sub(torch.Tensor):
        pass

    dy = torch.randn(2, 3, 4, 4).as_subclass(Sub)
    calls = _custom_op_calls(lambda: layer(x).backward(dy))
    assert calls.count("convfuse::batchnorm_backward") == 1
    assert "convfuse::batchnorm_training" not in calls


def _signatures():
    return len(bn_module.CALLS)


@pytest.mark.parametrize(("name", "value"), [("eps", 1e-2), ("momentum", 0.5),
                                             ("momentum", None), ("activation", "tanh"),
                                             ("track_running_stats", False)])
def test_a_changed_hyperparameter_makes_a_new_plan(name, value):
    torch.manual_seed(0)
    layer = ct.BatchNorm2d(2, dtype=F64)
    fresh = ct.BatchNorm2d(2, dtype=F64)
    x = torch.randn(3, 2, 4, 4, dtype=F64)
    for _ in range(2):
        layer(x)
        fresh(x)
    setattr(layer, name, value)
    setattr(fresh, name, value)
    before = _signatures()
    _same([layer(x), *layer.buffers()], [fresh(x), *fresh.buffers()])
    assert _signatures() == before + 1  # one new plan, shared by both layers


def test_a_buffer_changed_behind_the_layer_makes_a_new_plan_or_the_fresh_error():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, 4)
    layer, fresh = ct.BatchNorm2d(2), ct.BatchNorm2d(2)
    layer(x)
    fresh(x)
    # strided statistics: a copy written back (was: in place)
    for bn in (layer, fresh):
        store = torch.zeros(4)
        bn.running_mean = store[::2]
    _same([layer(x), layer.running_mean], [fresh(x), fresh.running_mean])
    # a dtype the checks refuse: the fresh layer's error, nothing counted
    count = int(layer.num_batches_tracked)
    for bn in (layer, fresh):
        bn.running_var = bn.running_var.double()
    with pytest.raises(TypeError) as want:
        fresh(x)
    with pytest.raises(TypeError) as got:
        layer(x)
    assert str(got.value) == str(want.value)
    assert int(layer.num_batches_tracked) == count
    # float16 data with its own half parameters after module.half(): a new plan
    layer, fresh = ct.BatchNorm2d(2), ct.BatchNorm2d(2)
    layer(x)
    fresh(x)
    layer.half()  # the same Parameter and buffer objects, now float16
    fresh.half()
    _same([layer(x.half()), *layer.buffers()], [fresh(x.half()), *fresh.buffers()])


def test_an_activation_or_momentum_the_op_refuses_gets_the_general_paths_error():
    x = torch.randn(3, 2, 4, 4)
    # an activation is refused at its assignment now (test_torch_after_construction.py)
    with pytest.raises(ValueError, match=r"^BatchNorm2d: unknown activation 'swish2'"):
        ct.BatchNorm2d(2).activation = "swish2"
    for name, value in (("momentum", float("inf")),):
        layer, fresh = ct.BatchNorm2d(2), ct.BatchNorm2d(2)
        layer(x)
        setattr(layer, name, value)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(eager, "takes_eager_path", lambda *a: False)
            setattr(fresh, name, value)
            with pytest.raises(ValueError) as want:
                fresh(x)
        with pytest.raises(ValueError) as got:
            layer(x)
        assert str(got.value) == str(want.value)


def test_layers_sharing_a_plan_keep_their_own_parameters_and_statistics():
    torch.manual_seed(0)
    a, b = ct.BatchNorm2d(2, activation="relu"), ct.BatchNorm2d(2, activation="relu")
    with torch.no_grad():
        b.weight.fill_(2.0)
        b.bias.fill_(-0.5)
    ref_a, ref_b = torch.nn.BatchNorm2d(2), torch.nn.BatchNorm2d(2)
    ref_a.load_state_dict(a.state_dict())
    ref_b.load_state_dict(b.state_dict())
    x = torch.randn(3, 2, 4, 4, dtype=F64)
    for ours, ref in ((a, ref_a), (b, ref_b), (a, ref_a)):
        y = ours(x.float())
        want = torch.relu(ref.double()(x)).float()
        ref.float()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
    assert int(a.num_batches_tracked) == 2 and int(b.num_batches_tracked) == 1


def test_parametrized_and_functional_call_parameters_are_the_ones_used():
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, 4, dtype=F64)
    layer = ct.BatchNorm2d(2, dtype=F64).eval()
    plain = layer(x)
    parametrize.register_parametrization(layer, "weight", Double())
    torch.testing.assert_close(layer(x), 2 * plain - layer.bias.view(1, 2, 1, 1),
                               rtol=1e-12, atol=1e-12)
    layer = ct.BatchNorm2d(2, dtype=F64).eval()
    layer(x)
    swapped = {"weight": torch.full((2,), 3.0, dtype=F64),
               "bias": torch.zeros(2, dtype=F64)}
    y = torch.func.functional_call(layer, swapped, (x,))
    torch.testing.assert_close(y, 3 * plain, rtol=1e-12, atol=1e-12)


def test_backward_keeps_its_safety_rules_with_the_forwards_arrays():
    layer = ct.BatchNorm2d(2, activation="relu", dtype=F64)
    x = torch.randn(3, 2, 4, 4, dtype=F64, requires_grad=True)
    layer(x)
    y = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)  # saved for the backward: refused, as torch does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = layer(x)
    assert y.grad_fn.kept[2][0] is not None  # the forward's array of x, kept
    g1 = torch.autograd.grad(y.sum(), x, retain_graph=True)[0]
    # released with the first backward, as autograd releases its saved tensors; the
    # retained graph's second backward makes it again, with the same result
    assert y.grad_fn.kept[2][0] is None and y.grad_fn.kept[2][3] is None
    g2 = torch.autograd.grad(y.sum(), x)[0]
    _same([g1], [g2])
    # under saved-tensor hooks x, the output and the statistics are autograd's saved
    # tensors only (Note [what a batch norm keeps]); the result is the same
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = layer(x)
    assert y.grad_fn.kept[2][0] is None and y.grad_fn.kept[0] is None
    assert len(y.grad_fn.saved_tensors) == 6  # x, weight, bias, y, mean, invstd
    _same([torch.autograd.grad(y.sum(), x)[0]], [g1])


def test_statistics_overlapping_an_input_get_the_ops_refusal_on_every_call():
    """The overlap test of in-place statistics depends on addresses, not on the key: a
    cached signature whose statistics now share memory with the input is refused by
    convfuse.ops, as on the custom-op path."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, 4)
    layer = ct.BatchNorm2d(2)
    layer(torch.randn(3, 2, 4, 4))
    errors = []
    for path in ("eager", "custom_op"):
        with pytest.MonkeyPatch.context() as mp:
            if path == "custom_op":
                mp.setattr(eager, "takes_eager_path", lambda *a: False)
            layer.running_mean = x.view(-1)[:2]  # the input's first values
            with pytest.raises(ValueError) as err:
                layer(x)
            errors.append(str(err.value))
    assert "overlap" in errors[0] and errors[0] == errors[1]
