"""convfuse.optim on the CPU: update rules against float64 transcriptions (and PyTorch when
installed), and the learning rate.

The oracles below are written from the published algorithms (per parameter, float64),
in the textbook form where it differs from the library's (Adam's bias-corrected moments,
a plain moving average instead of lerp), so an error in the library's rearrangement shows.

Flat buffers, validation, state round trips and the launcher's agreement with optim.cu's
signatures are tested in test_optim_flat.py, test_optim_validation.py, test_optim_state.py
and test_optim_kernel.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from convfuse import Parameter, dtypes
from convfuse.optim import SGD, Adam, AdamW
from tests._optim_helpers import SHAPES, grad_sequence, make_params, run

TOL = {np.float64: dict(rtol=1e-12, atol=1e-14), np.float32: dict(rtol=2e-5, atol=2e-6)}


# -- independent float64 oracles ------------------------------------------------------------
def ref_sgd(p0, grads, lrs, momentum=0.0, weight_decay=0.0, nesterov=False, dtype=np.float64):
    ps = [np.array(p, dtype=np.float64) for p in p0]
    bufs = [None] * len(ps)
    for gs, lr in zip(grads, lrs):
        for i, g in enumerate(gs):
            d = np.asarray(g, dtype).astype(np.float64) + weight_decay * ps[i]
            if momentum != 0:
                bufs[i] = d.copy() if bufs[i] is None else momentum * bufs[i] + d
                d = d + momentum * bufs[i] if nesterov else bufs[i]
            ps[i] = ps[i] - lr * d
    return ps, bufs


def ref_adam(p0, grads, lrs, betas, eps, weight_decay, decoupled, dtype=np.float64,
             round_param=None):
    b1, b2 = betas
    ps = [np.array(p, dtype=np.float64) for p in p0]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        for i, g in enumerate(gs):
            g = np.asarray(g, dtype).astype(np.float64)
            if decoupled:
                ps[i] = ps[i] * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * ps[i]
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t)
            v_hat = vs[i] / (1 - b2**t)
            ps[i] = ps[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
            if round_param is not None:
                ps[i] = ps[i].astype(round_param).astype(np.float64)
    return ps, ms, vs


# -- update rules --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "momentum, weight_decay, nesterov",
    [(0.0, 0.0, False), (0.0, 0.05, False), (0.9, 0.0, False), (0.9, 0.01, False),
     (0.9, 0.01, True), (0.5, 0.0, True)],
)
def test_sgd_matches_reference(rng, dtype, momentum, weight_decay, nesterov):
    params = make_params(rng, dtype)
    p0 = [p.data.copy() for p in params]
    grads = grad_sequence(rng, SHAPES, 5)
    lrs = [0.1, 0.1, 0.05, 0.05, 0.2]
    opt = SGD(params, lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    run(opt, params, grads, lrs)
    want, bufs = ref_sgd(p0, grads, lrs, momentum, weight_decay, nesterov, dtype)
    state = opt.state_dict()["state"]
    for i, (p, w) in enumerate(zip(params, want)):
        assert p.data.dtype == dtype and p.data.shape == w.shape
        np.testing.assert_allclose(p.data, w, **TOL[dtype])
        assert state[i]["step"] == 5
        if momentum:
            np.testing.assert_allclose(state[i]["momentum_buffer"], bufs[i], **TOL[dtype])
        else:
            assert set(state[i]) == {"step"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "cls, betas, eps, weight_decay",
    [(Adam, (0.9, 0.999), 1e-8, 0.0), (Adam, (0.9, 0.999), 1e-8, 0.1),
     (Adam, (0.3, 0.9), 1e-3, 0.02),  # 1 - beta1 >= 0.5: the other branch of lerp
     (AdamW, (0.9, 0.999), 1e-8, 0.01), (AdamW, (0.8, 0.99), 1e-6, 0.3),
     (AdamW, (0.0, 0.5), 1e-8, 0.0)],
)
def test_adam_matches_reference(rng, dtype, cls, betas, eps, weight_decay):
    params = make_params(rng, dtype)
    p0 = [p.data.copy() for p in params]
    grads = grad_sequence(rng, SHAPES, 6)
    lrs = [1e-2, 1e-2, 3e-2, 3e-2, 5e-3, 5e-3]
    opt = cls(params, lr=lrs[0], betas=betas, eps=eps, weight_decay=weight_decay)
    run(opt, params, grads, lrs)
    want, ms, vs = ref_adam(p0, grads, lrs, betas, eps, weight_decay, cls is AdamW, dtype)
    state = opt.state_dict()["state"]
    for i, p in enumerate(params):
        np.testing.assert_allclose(p.data, want[i], **TOL[dtype])
        np.testing.assert_allclose(state[i]["exp_avg"], ms[i], **TOL[dtype])
        np.testing.assert_allclose(state[i]["exp_avg_sq"], vs[i], **TOL[dtype])
        assert state[i]["step"] == 6


def test_first_sgd_step_overwrites_the_momentum_buffer(rng):
    # PyTorch starts the buffer as a copy of the first gradient (no blend with old state).
    params = make_params(rng, np.float32, [(4,), (3, 3)])
    opt = SGD(params, lr=0.1, momentum=0.9)
    opt._groups[0].state["momentum_buffer"].fill(np.nan)
    for p in params:
        p.grad[...] = rng.standard_normal(p.shape)
    opt.step()
    for i, p in enumerate(params):
        np.testing.assert_array_equal(opt.state_dict()["state"][i]["momentum_buffer"], p.grad)


def test_repr_names_hyperparameters_and_groups():
    opt = SGD([Parameter(np.zeros(2)), Parameter(np.zeros(3, np.float32))], lr=0.5, momentum=0.9)
    text = repr(opt)
    assert text.startswith("SGD(lr=0.5, momentum=0.9") and "cpu" in text
    assert "float64: 1 params" in text and "float32: 1 params" in text


def test_defaults_follow_pytorch():
    p = [Parameter(np.zeros(3, np.float32))]
    assert Adam(p).defaults == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                "decoupled_weight_decay": False}
    assert Adam(p).lr == 1e-3
    assert AdamW(p).defaults["weight_decay"] == 1e-2
    assert AdamW(p).defaults["decoupled_weight_decay"] is True
    assert SGD(p, lr=0.5).defaults == {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}


@pytest.mark.parametrize("dtype, rtol", [(dtypes.float16, 2e-3), (dtypes.bfloat16, 1.6e-2)])
def test_reduced_precision_params_keep_float32_state(rng, dtype, rtol):
    shapes = [(4, 5), (7,)]
    params = make_params(rng, dtype, shapes)
    p0 = [p.data.astype(np.float64) for p in params]
    grads = grad_sequence(rng, shapes, 3)
    opt = Adam(params, lr=0.05, weight_decay=0.01)
    run(opt, params, grads)
    want, ms, _ = ref_adam(p0, grads, [0.05] * 3, (0.9, 0.999), 1e-8, 0.01, False, dtype,
                           round_param=dtype)
    state = opt.state_dict()["state"]
    for i, p in enumerate(params):
        assert p.data.dtype == dtype and p.grad.dtype == dtype
        assert state[i]["exp_avg"].dtype == np.float32
        np.testing.assert_allclose(p.data.astype(np.float64), want[i], rtol=rtol, atol=rtol)
        np.testing.assert_allclose(state[i]["exp_avg"], ms[i], rtol=rtol, atol=rtol)
    sgd_params = make_params(rng, dtype, shapes)
    s0 = [p.data.astype(np.float64) for p in sgd_params]
    sgd = SGD(sgd_params, lr=0.1, momentum=0.9)
    run(sgd, sgd_params, grads[:1])
    want, _ = ref_sgd(s0, grads[:1], [0.1], 0.9, dtype=dtype)
    assert sgd.state_dict()["state"][0]["momentum_buffer"].dtype == np.float32
    for p, w in zip(sgd_params, want):
        np.testing.assert_allclose(p.data.astype(np.float64), w, rtol=rtol, atol=rtol)


def test_mixed_dtypes_form_groups_each_exact(rng):
    params = [Parameter(rng.standard_normal(s).astype(dt))
              for s, dt in [((3, 3), np.float64), ((4,), np.float32), ((2, 5), np.float64)]]
    p0 = [p.data.copy() for p in params]
    grads = grad_sequence(rng, [p.shape for p in params], 3)
    opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    run(opt, params, grads)
    for i, p in enumerate(params):
        want, _ = ref_sgd([p0[i]], [[g[i]] for g in grads], [0.1] * 3, 0.9, 0.0, True, p.dtype)
        np.testing.assert_allclose(p.data, want[0], **TOL[p.dtype.type])
    assert [int(k) for k in opt.state_dict()["state"]] == [0, 1, 2]


def test_step_leaves_gradients_untouched(rng):
    params = make_params(rng, np.float32, [(6,), (2, 2)])
    opt = AdamW(params, lr=0.1, weight_decay=0.5)
    for p in params:
        p.grad[...] = rng.standard_normal(p.shape)
    before = [p.grad.copy() for p in params]
    opt.step()
    for p, g in zip(params, before):
        np.testing.assert_array_equal(p.grad, g)


def test_nonfinite_values_propagate_silently(rng):
    params = make_params(rng, np.float32, [(3,)])
    opt = Adam(params, lr=0.1, eps=0.0)
    params[0].grad[...] = [np.inf, 0.0, 1.0]
    with np.errstate(all="raise"):  # the optimizer must not warn or raise, as PyTorch doesn't
        opt.step()
    assert np.isnan(params[0].data[0]) and np.isnan(params[0].data[1])
    assert np.isfinite(params[0].data[2])


# -- learning rate ---------------------------------------------------------------------------
def test_lr_change_mid_run_takes_effect(rng):
    params = make_params(rng, np.float64, [(5,)])
    p0 = [params[0].data.copy()]
    opt = SGD(params, lr=0.1, momentum=0.9)
    grads = grad_sequence(rng, [(5,)], 4)
    run(opt, params, grads[:2])
    opt.lr = 0.01
    assert opt.lr == 0.01 and type(opt.lr) is float
    run(opt, params, grads[2:])
    want, _ = ref_sgd(p0, grads, [0.1, 0.1, 0.01, 0.01], 0.9)
    np.testing.assert_allclose(params[0].data, want[0], rtol=1e-12)
    unchanged, _ = ref_sgd(p0, grads, [0.1] * 4, 0.9)
    assert not np.allclose(params[0].data, unchanged[0])


def test_lr_setter_validates_and_keeps_old_value():
    opt = Adam([Parameter(np.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        opt.lr = -1
    with pytest.raises(TypeError, match="lr must be a real number"):
        opt.lr = "0.1"
    assert opt.lr == 0.1
    opt.lr = np.float32(0.5)
    assert opt.lr == 0.5 and type(opt.lr) is float


# -- PyTorch itself, when installed ------------------------------------------------------------
@pytest.mark.parametrize("name, kwargs", [
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
    ("SGD", dict(lr=0.1)),
    ("Adam", dict(lr=0.01, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, betas=(0.3, 0.9))),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_torch_step_for_step(rng, name, kwargs, dtype):
    torch = pytest.importorskip("torch")
    import convfuse.optim as co

    shapes = [(3, 4), (5,), (2, 1, 3)]
    params = make_params(rng, dtype, shapes)
    tparams = [torch.tensor(p.data.copy(), requires_grad=True) for p in params]
    ours = getattr(co, name)(params, **kwargs)
    theirs = getattr(torch.optim, name)(tparams, foreach=False, **kwargs)
    for k, gs in enumerate(grad_sequence(rng, shapes, 6)):
        if k == 3:
            ours.lr = kwargs["lr"] / 3
            for group in theirs.param_groups:
                group["lr"] = kwargs["lr"] / 3
        for p, tp, g in zip(params, tparams, gs):
            p.grad[...] = g
            tp.grad = torch.tensor(g.astype(dtype))
        ours.step()
        theirs.step()
        for p, tp in zip(params, tparams):
            # A few ulps: PyTorch's CPU kernels fuse some multiply-adds that NumPy rounds twice.
            tol = dict(rtol=1e-6, atol=1e-7)
            if dtype == np.float64:
                tol = dict(rtol=1e-14, atol=1e-16)
            np.testing.assert_allclose(p.data, tp.detach().numpy(), **tol)


def test_bias_correction_is_computed_in_double():
    # A long run where float32 powers would drift: the 10_000th step's bias correction.
    p = [Parameter(np.zeros(1, np.float64))]
    opt = Adam(p, lr=1.0, betas=(0.9, 0.999), eps=0.0)
    opt.load_state_dict({**opt.state_dict(), "state": {0: {
        "step": 9999, "exp_avg": np.zeros(1), "exp_avg_sq": np.zeros(1)}}})
    p[0].grad[...] = 2.0
    opt.step()
    t = 10_000
    m, v = (1 - 0.9) * 2.0, (1 - 0.999) * 4.0
    want = -(m / (1 - 0.9**t)) / (math.sqrt(v) / math.sqrt(1 - 0.999**t))
    np.testing.assert_allclose(p[0].data, [want], rtol=1e-15)
