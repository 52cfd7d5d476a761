"""convfuse.torch layers under torch.func's transforms and forward-mode AD (Note [torch.func
transforms] in convfuse/torch/_eager.py, Note [a fused convolution under torch.func] in
_functorch.py): Conv and ConvTranspose give torch.nn's first-order derivatives in float64
(grad, vjp, jacrev, jvp, jacfwd, per-sample gradients, dual tensors), and second order is
refused with a TransformError, never a silent zero; a batch norm is torch.nn's there."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402

F64 = torch.float64
func = torch.func
ACTS = {"identity": lambda t: t, "relu": torch.relu, "silu": torch.nn.functional.silu,
        "tanh": torch.tanh}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "no batching rule" performance note
        yield


def _pair(kind: str, act: str, bias: bool = True):
    """(convfuse layer, its torch.nn twin followed by the activation, the twin itself)."""
    torch.manual_seed(0)
    theirs = (torch.nn.Conv2d(3, 4, 3, padding=1, bias=bias) if kind == "conv"
              else torch.nn.ConvTranspose2d(3, 4, 3, stride=2, bias=bias)).double()
    ours = ct.convert(copy.deepcopy(theirs))
    ours.activation = act
    return ours, (lambda t, r=None: ACTS[act](theirs(t) + (0 if r is None else r))), theirs


def _close(a, b):
    for p, q in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b),
                    strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def _params(layer):
    return {k: v.detach() for k, v in layer.named_parameters()}


@pytest.mark.parametrize("kind", ["conv", "transpose"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("transform", ["grad", "grad_params", "vjp", "jacrev", "jvp",
                                       "jvp_params", "jacfwd", "per_sample"])
def test_first_order_transforms_match_torch_nn(kind, act, transform):
    ours, ref, twin = _pair(kind, act)
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    if transform == "grad":
        _close(func.grad(lambda t: ours(t).square().sum())(x),
               func.grad(lambda t: ref(t).square().sum())(x))
    elif transform == "grad_params":
        def loss(layer, head):
            return lambda p: head(func.functional_call(layer, p, (x,))).square().sum()
        _close(func.grad(loss(ours, lambda y: y))(_params(ours)),
               func.grad(loss(twin, ACTS[act]))(_params(twin)))
    elif transform == "vjp":
        v = torch.randn_like(ref(x))
        _close(func.vjp(ours, x)[1](v), func.vjp(ref, x)[1](v))
    elif transform == "jacrev":
        _close(func.jacrev(ours)(x[:1]), func.jacrev(ref)(x[:1]))
    elif transform == "jvp":
        t = torch.randn_like(x)
        _close(func.jvp(ours, (x,), (t,)), func.jvp(ref, (x,), (t,)))
    elif transform == "jvp_params":  # tangents of the weight and the bias
        tangents = {k: torch.randn_like(v) for k, v in _params(ours).items()}

        def through(layer, head):
            return lambda p: head(func.functional_call(layer, p, (x,)))
        _close(func.jvp(through(ours, lambda y: y), (_params(ours),), (tangents,)),
               func.jvp(through(twin, ACTS[act]), (_params(twin),), (tangents,)))
    elif transform == "jacfwd":
        _close(func.jacfwd(ours)(x[:1]), func.jacfwd(ref)(x[:1]))
    else:  # per-sample gradients, as Opacus's functorch mode computes them
        def sample_loss(layer, head):
            return lambda p, xi: head(func.functional_call(layer, p, (xi[None],))).sum()
        _close(func.vmap(func.grad(sample_loss(ours, lambda y: y)), in_dims=(None, 0))(
                   _params(ours), x),
               func.vmap(func.grad(sample_loss(twin, ACTS[act])), in_dims=(None, 0))(
                   _params(twin), x))


@pytest.mark.parametrize("kind", ["conv", "transpose"])
def test_the_residual_and_a_missing_bias_under_grad_and_jvp(kind):
    ours, ref, _ = _pair(kind, "relu", bias=False)
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    r = torch.randn_like(ref(x))
    _close(func.grad(lambda t, s: ours(t, residual=s).square().sum(), argnums=(0, 1))(x, r),
           func.grad(lambda t, s: ref(t, s).square().sum(), argnums=(0, 1))(x, r))
    tx, tr = torch.randn_like(x), torch.randn_like(r)
    _close(func.jvp(lambda t, s: ours(t, residual=s), (x, r), (tx, tr)),
           func.jvp(ref, (x, r), (tx, tr)))
    # a tangent on the residual alone: the tangent is act'(pre) * tr
    _close(func.jvp(lambda s: ours(x, residual=s), (r,), (tr,)),
           func.jvp(lambda s: ref(x, s), (r,), (tr,)))


@pytest.mark.parametrize("grad_mode", [True, False])
def test_forward_ad_dual_tensors_give_torch_nns_tangent(grad_mode):
    import torch.autograd.forward_ad as fwad

    ours, ref, _ = _pair("conv", "tanh")
    x, t = torch.randn(2, 3, 4, 4, dtype=F64), torch.randn(2, 3, 4, 4, dtype=F64)
    with torch.set_grad_enabled(grad_mode), fwad.dual_level():
        got = fwad.unpack_dual(ours(fwad.make_dual(x, t)))
        want = fwad.unpack_dual(ref(fwad.make_dual(x, t)))
        _close((got.primal, got.tangent), (want.primal, want.tangent))
        _close(ours(x), ref(x))  # a plain input inside the level runs as ever


@pytest.mark.parametrize("second_order", ["hessian", "grad(grad)", "jacfwd(jacrev)",
                                          "jacrev(jacfwd)", "jacfwd(jacfwd)",
                                          "jacrev(jacrev)", "grad(vjp_fn)",
                                          "vmap(jacrev(jacrev))"])
def test_second_order_transforms_are_refused(second_order):
    """The backward's and jvp's custom ops have no torch.func rule (and under jvp gave a
    zero tangent): refused, where torch.autograd's double backward works."""
    ours, _, _ = _pair("conv", "tanh")
    x = torch.randn(1, 3, 3, 3, dtype=F64)

    def f(t):
        return ours(t).sum()

    calls = {
        "hessian": lambda: func.hessian(f)(x),
        "grad(grad)": lambda: func.grad(lambda u: func.grad(f)(u).sum())(x),
        "jacfwd(jacrev)": lambda: func.jacfwd(func.jacrev(f))(x),
        "jacrev(jacfwd)": lambda: func.jacrev(func.jacfwd(f))(x),
        "jacfwd(jacfwd)": lambda: func.jacfwd(func.jacfwd(f))(x),
        # a vjp's or jacrev's backward runs after its own level is gone: these gave zeros
        "jacrev(jacrev)": lambda: func.jacrev(func.jacrev(f))(x),
        "grad(vjp_fn)": lambda: func.grad(
            lambda u: func.vjp(f, u)[1](torch.ones((), dtype=F64))[0].sum())(x),
        "vmap(jacrev(jacrev))": lambda: func.vmap(func.jacrev(func.jacrev(f)))(x[None]),
    }
    with pytest.raises(ct.TransformError, match="a second-order one"):
        calls[second_order]()
    assert issubclass(ct.TransformError, NotImplementedError)


def _bn_pair(training: bool):
    """(convfuse BatchNorm2d with relu and a residual, torch.nn's BatchNorm2d, its
    computation as a function of (x, residual))."""
    torch.manual_seed(0)
    theirs = torch.nn.BatchNorm2d(3).double().train(training)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        theirs.bias.normal_()
        theirs.running_mean.normal_()
        theirs.running_var.uniform_(0.5, 2.0)
    ours = ct.convert(copy.deepcopy(theirs))
    ours.activation = "relu"
    return ours, theirs, (lambda t, r: torch.relu(theirs(t) + r))


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "jacrev", "jacfwd",
                                       "per_sample"])
def test_a_batch_norm_under_torch_func_is_torch_nns(training, transform):
    """Note [torch.func transforms]: a batch norm under torch.func runs torch.nn's own
    computation: the same derivatives, and in training the same running statistics."""
    ours, theirs, ref = _bn_pair(training)
    x, r = torch.randn(4, 3, 3, 3, dtype=F64), torch.randn(4, 3, 3, 3, dtype=F64)

    def run(layer, f):
        if transform == "grad":
            return func.grad(lambda t: f(t, r).square().sum())(x)
        if transform == "vjp":
            return func.vjp(lambda t: f(t, r), x)[1](torch.ones_like(x))
        if transform == "jvp":
            return func.jvp(f, (x, r), (torch.ones_like(x), torch.ones_like(r)))
        if transform == "jacrev":
            return func.jacrev(lambda t: f(t, r))(x)
        if transform == "jacfwd":
            return func.jacfwd(lambda t: f(t, r))(x)
        params = {k: v.detach() for k, v in layer.named_parameters()}
        buffers = {k: v for k, v in layer.named_buffers()}

        def loss(p, xi, ri):
            y = func.functional_call(layer, (p, buffers), (xi[None],))
            return (torch.relu(y + ri) if layer is theirs else y).sum()
        if layer is ours:
            return func.vmap(func.grad(lambda p, xi, ri: func.functional_call(
                layer, (p, buffers), (xi[None],), {"residual": ri[None]}).sum()),
                in_dims=(None, 0, 0))(params, x, r)
        return func.vmap(func.grad(loss), in_dims=(None, 0, 0))(params, x, r)

    if training:  # torch.nn's count update under a transform: torch's error, as torch.nn's
        with pytest.raises(RuntimeError) as want:
            run(theirs, ref)
        with pytest.raises(RuntimeError) as got:
            run(ours, lambda t, s: ours(t, residual=s))
        assert str(got.value) == str(want.value)
    else:
        _close(run(ours, lambda t, s: ours(t, residual=s)), run(theirs, ref))
    _close((ours.running_mean, ours.running_var, ours.num_batches_tracked),
           (theirs.running_mean, theirs.running_var, theirs.num_batches_tracked))


@pytest.mark.parametrize("grad_mode", [True, False])
def test_a_batch_norm_takes_dual_tensors_as_torch_nn(grad_mode):
    import torch.autograd.forward_ad as fwad

    for training in (False, True):
        ours, _, ref = _bn_pair(training)
        x, t = torch.randn(4, 3, 3, 3, dtype=F64), torch.randn(4, 3, 3, 3, dtype=F64)
        r = torch.zeros_like(x)
        with torch.set_grad_enabled(grad_mode), fwad.dual_level():
            got = fwad.unpack_dual(ours(fwad.make_dual(x, t), residual=r))
            want = fwad.unpack_dual(ref(fwad.make_dual(x, t), r))
            _close((got.primal, got.tangent), (want.primal, want.tangent))


def test_vmap_alone_runs_the_layers():
    """vmap without an autodiff transform: the batched eager call's numbers (the custom
    ops' per-sample fallback for the convolutions, torch's batch norm)."""
    torch.manual_seed(0)
    layers = [ct.Conv2d(3, 4, 3).double(), ct.ConvTranspose2d(3, 4, 3).double(),
              ct.BatchNorm2d(3).double().eval()]
    x = torch.randn(2, 3, 5, 5, dtype=F64)
    for layer in layers:
        with torch.no_grad():
            per_sample = func.vmap(lambda t, m=layer: m(t[None])[0])(x)
        torch.testing.assert_close(per_sample, layer(x).detach(), rtol=1e-13, atol=1e-13)
        per_sample = func.vmap(lambda t, m=layer: m(t[None])[0])(x)  # recorded
        torch.testing.assert_close(per_sample, layer(x), rtol=1e-13, atol=1e-13)


def test_double_backward_inside_an_open_dual_level_is_autograds():
    """With a forward-AD level open (and no dual tensor) a layer takes its torch.func
    Function, whose backward records as the eager one's: double backward as ever."""
    import torch.autograd.forward_ad as fwad

    ours, ref, _ = _pair("conv", "tanh")
    x = torch.randn(2, 3, 4, 4, dtype=F64, requires_grad=True)

    def penalty(f):
        g, = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
        return torch.autograd.grad(g.square().sum(), x)[0]

    want = penalty(ref)
    with fwad.dual_level():
        _close(penalty(ours), want)


def test_forward_over_reverse_is_refused():
    """A dual tensor reaching a fused convolution's backward (a Hessian-vector product by
    forward over reverse) would lose its tangent: refused."""
    import torch.autograd.forward_ad as fwad

    ours, _, _ = _pair("conv", "tanh")
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    with fwad.dual_level():
        xd = fwad.make_dual(x, torch.ones_like(x)).requires_grad_()
        y = ours(xd).sum()
        with pytest.raises(ct.TransformError, match="forward-over-reverse"):
            torch.autograd.grad(y, xd, create_graph=True)
