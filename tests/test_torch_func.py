"""convfuse.torch layers under torch.func's transforms and forward-mode AD (Note [torch.func
transforms] in convfuse/torch/_eager.py, Note [a fused convolution under torch.func] in
_functorch.py): Conv and ConvTranspose give torch.nn's first-order derivatives in float64
(grad, vjp, jacrev, jvp, jacfwd, per-sample gradients, dual tensors); what cannot be
differentiated (second order, batch norm) is refused with a TransformError, never a silent
zero."""

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
                                          "jacrev(jacfwd)", "jacfwd(jacfwd)"])
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
    }
    with pytest.raises(ct.TransformError, match="a second-order transform"):
        calls[second_order]()
    assert issubclass(ct.TransformError, NotImplementedError)


def _batch_norms():
    torch.manual_seed(0)
    return [ct.BatchNorm2d(3).double().eval(), ct.BatchNorm2d(3).double().train()]


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "jacfwd", "vmap(grad)"])
def test_a_batch_norm_refuses_autodiff_transforms_naming_itself(transform):
    x = torch.randn(2, 3, 4, 4, dtype=F64)
    for bn in _batch_norms():
        before = (bn.running_mean.clone(), bn.num_batches_tracked.clone())
        calls = {
            "grad": lambda b=bn: func.grad(lambda t: b(t).sum())(x),
            "vjp": lambda b=bn: func.vjp(b, x),
            "jvp": lambda b=bn: func.jvp(b, (x,), (x,)),
            "jacfwd": lambda b=bn: func.jacfwd(b)(x[:1]),
            "vmap(grad)": lambda b=bn: func.vmap(func.grad(lambda t: b(t[None]).sum()))(x),
        }
        with pytest.raises(ct.TransformError, match=r"^BatchNorm2d: a torch\.func (Grad|Jvp) "):
            calls[transform]()
        assert torch.equal(bn.running_mean, before[0])  # refused before any state changed
        assert torch.equal(bn.num_batches_tracked, before[1])


@pytest.mark.parametrize("grad_mode", [True, False])
def test_a_batch_norm_refuses_dual_tensors(grad_mode):
    import torch.autograd.forward_ad as fwad

    x = torch.randn(2, 3, 4, 4, dtype=F64)
    for bn in _batch_norms():
        want = bn(x).detach()
        with torch.set_grad_enabled(grad_mode), fwad.dual_level():
            with pytest.raises(ct.TransformError, match=r"^BatchNorm2d: forward-mode AD"):
                bn(fwad.make_dual(x, torch.ones_like(x)))
            if not bn.training:  # a plain input inside the level runs as ever
                torch.testing.assert_close(bn(x).detach(), want, rtol=0, atol=0)


def test_vmap_alone_runs_the_layers():
    """vmap without an autodiff transform runs the custom ops (torch's per-sample
    fallback): the batched eager call's numbers; a batch norm's only under no_grad (its
    Function cannot run under vmap), refused otherwise."""
    torch.manual_seed(0)
    layers = [ct.Conv2d(3, 4, 3).double(), ct.ConvTranspose2d(3, 4, 3).double(),
              ct.BatchNorm2d(3).double().eval()]
    x = torch.randn(2, 3, 5, 5, dtype=F64)
    for layer in layers:
        with torch.no_grad():
            per_sample = func.vmap(lambda t, m=layer: m(t[None])[0])(x)
        torch.testing.assert_close(per_sample, layer(x).detach(), rtol=1e-13, atol=1e-13)
    per_sample = func.vmap(lambda t: layers[0](t[None])[0])(x)  # recorded: conv runs
    torch.testing.assert_close(per_sample, layers[0](x), rtol=1e-13, atol=1e-13)
    with pytest.raises(ct.TransformError, match=r"BatchNorm2d: under torch\.func\.vmap with "
                                                r"autograd recording"):
        func.vmap(lambda t: layers[2](t[None])[0])(x)  # its parameters require grad
