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
        warnings.simplefilter("ignore")
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
    ops' batching rules for the convolutions, torch's batch norm)."""
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


# -- batching rules (Note [a fused convolution under vmap] in convfuse/torch/_vmap.py) ------
def _no_fallback():
    """torch's per-sample fallback warns; with the ops' own batching rules it never runs."""
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.filterwarnings("error", message=".*performance drop.*batching rule.*")
    return ctx


def _twins(kind: str, act: str, groups: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    theirs = (torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=groups, bias=bias)
              if kind == "conv" else
              torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1,
                                       groups=groups, bias=bias)).double()
    ours = ct.convert(copy.deepcopy(theirs))
    ours.activation = act
    return ours, torch.nn.Sequential(theirs, {"identity": torch.nn.Identity(),
                                              "relu": torch.nn.ReLU(),
                                              "silu": torch.nn.SiLU(),
                                              "tanh": torch.nn.Tanh()}[act])


@pytest.mark.parametrize("kind", ["conv", "transpose"])
@pytest.mark.parametrize(("act", "groups", "bias"), [("relu", 1, True), ("silu", 2, True),
                                                     ("identity", 2, False),
                                                     ("tanh", 1, False)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_per_sample_gradients_take_the_batching_rules(kind, act, groups, bias, channels_last):
    """vmap(grad) over samples: torch.nn's per-sample gradients in float64, computed by
    one grouped convolution per op, not torch's per-sample loop."""
    ours, ref = _twins(kind, act, groups, bias)
    x = torch.randn(5, 4, 6, 6, dtype=F64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)

    def per_sample(model, params):
        def loss(p, xi):
            return func.functional_call(model, p, (xi[None],)).square().sum()
        return func.vmap(func.grad(loss), in_dims=(None, 0))(params, x)

    want = per_sample(ref, {f"0.{k}": v for k, v in _params(ref[0]).items()})
    guard = _no_fallback()
    try:
        got = per_sample(ours, _params(ours))
    finally:
        guard.__exit__(None, None, None)
    _close(got, {k[2:]: v for k, v in want.items()})


@pytest.mark.parametrize("kind", ["conv", "transpose"])
def test_an_ensemble_vmapped_over_its_weights_takes_the_batching_rules(kind):
    """stack_module_state + vmap over the weights (one input, or one per model), and the
    gradient of each model's loss: torch.nn's numbers."""
    pairs = [_twins(kind, "silu", 2, True, seed=s) for s in range(3)]
    x = torch.randn(2, 4, 5, 5, dtype=F64)
    xs = torch.randn(3, 2, 4, 5, 5, dtype=F64)
    results = []
    for models in ([p[0] for p in pairs], [p[1] for p in pairs]):
        params, buffers = func.stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def f(p, b, xx, base=base):
            return func.functional_call(base, (p, b), (xx,))
        guard = _no_fallback() if models[0] is pairs[0][0] else None
        try:
            results.append([
                func.vmap(f, in_dims=(0, 0, None))(params, buffers, x),
                func.vmap(f, in_dims=(0, 0, 0))(params, buffers, xs),
                func.vmap(func.grad(lambda p, b, xx: f(p, b, xx).square().sum()),
                          in_dims=(0, 0, None))(params, buffers, x)])
        finally:
            if guard is not None:
                guard.__exit__(None, None, None)
    ours, theirs = results
    _close(ours[:2], theirs[:2])
    _close(ours[2], {k[2:]: v for k, v in theirs[2].items()})


def test_vmap_over_another_dim_nested_and_with_a_residual():
    ours, ref = _twins("conv", "relu", 1, True)
    conv = ref[0]
    x = torch.randn(3, 2, 4, 6, 6, dtype=F64)
    r = torch.randn(2, 6, 3, 3, dtype=F64)
    rs = torch.randn(3, 2, 6, 3, 3, dtype=F64)
    guard = _no_fallback()
    try:
        with torch.no_grad():
            got = [func.vmap(ours, in_dims=1)(x),
                   func.vmap(func.vmap(lambda t: ours(t[None])[0]))(x),
                   func.vmap(lambda t: ours(t, residual=r))(x),
                   func.vmap(lambda t, s: ours(t, residual=s))(x, rs)]
    finally:
        guard.__exit__(None, None, None)
    with torch.no_grad():
        want = [torch.relu(conv(x.movedim(1, 0).reshape(6, 4, 6, 6))).reshape(2, 3, 6, 3, 3)
                .movedim(0, 1).movedim(1, 0), torch.relu(conv(x.reshape(6, 4, 6, 6)))
                .reshape(3, 2, 6, 3, 3), torch.relu(conv(x.reshape(6, 4, 6, 6)).reshape(
                    3, 2, 6, 3, 3) + r), torch.relu(conv(x.reshape(6, 4, 6, 6)).reshape(
                        3, 2, 6, 3, 3) + rs)]
    _close(got, want)
