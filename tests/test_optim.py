"""convfuse.optim on the CPU: update rules against float64 transcriptions, flat buffers,
validation, state round trips, and the launcher's agreement with optim.cu's signatures.

The oracles below are written from the published algorithms (per parameter, float64),
in the textbook form where it differs from the library's (Adam's bias-corrected moments,
a plain moving average instead of lerp), so an error in the library's rearrangement shows.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import convfuse.kernels as kernels
from convfuse import Parameter, dtypes
from convfuse.optim import SGD, Adam, AdamW
from convfuse.optim._flat import ALIGN_BYTES

SHAPES = [(3, 4), (5,), (2, 3, 4), (), (0, 3), (17,), (1, 1, 2, 2)]
TOL = {np.float64: dict(rtol=1e-12, atol=1e-14), np.float32: dict(rtol=2e-5, atol=2e-6)}


def make_params(rng, dtype, shapes=SHAPES):
    return [Parameter(rng.standard_normal(s).astype(dtype)) for s in shapes]


def grad_sequence(rng, shapes, steps):
    return [[rng.standard_normal(s) for s in shapes] for _ in range(steps)]


def run(opt, params, grads, lrs=None):
    """Write each step's gradients in place, set the lr if a schedule is given, step."""
    for k, gs in enumerate(grads):
        if lrs is not None:
            opt.lr = lrs[k]
        for p, g in zip(params, gs):
            p.grad[...] = g
        opt.step()


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
    assert Adam(p).defaults == {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert Adam(p).lr == 1e-3
    assert AdamW(p).defaults["weight_decay"] == 1e-2
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


# -- flat buffers ----------------------------------------------------------------------------
def _root(a):
    while a.base is not None:
        a = a.base
    return a


def test_rehoming_preserves_values_and_shares_one_buffer(rng):
    params = make_params(rng, np.float32) + make_params(rng, np.float64, [(3,), (2, 2)])
    for p in params:
        p.grad[...] = rng.standard_normal(p.shape)
    old = [(p.data, p.grad, p.data.copy(), p.grad.copy()) for p in params]
    SGD(params, lr=0.1)
    for p, (od, og, d, g) in zip(params, old):
        assert p.data is not od and p.grad is not og
        np.testing.assert_array_equal(p.data, d)
        np.testing.assert_array_equal(p.grad, g)
        assert p.data.shape == d.shape and p.data.dtype == d.dtype and p.data.flags.c_contiguous
        assert p.data.ctypes.data % ALIGN_BYTES == 0 and p.grad.ctypes.data % ALIGN_BYTES == 0
    f32 = [p for p in params if p.dtype == np.float32]
    f64 = [p for p in params if p.dtype == np.float64]
    for group in (f32, f64):
        data_root, grad_root = _root(group[0].data), _root(group[0].grad)
        assert data_root is not grad_root and data_root.ndim == 1
        for p in group:
            assert _root(p.data) is data_root and _root(p.grad) is grad_root
            if p.size:  # an empty view shares no bytes with anything
                assert np.shares_memory(p.data, data_root)
                assert np.shares_memory(p.grad, grad_root)
    assert _root(f32[0].data) is not _root(f64[0].data)
    # Views never overlap, so one parameter's update cannot leak into its neighbour.
    for a in params:
        for b in params:
            if a is not b:
                assert not np.shares_memory(a.data, b.data)


def test_old_arrays_are_not_modified(rng):
    params = make_params(rng, np.float32, [(4,)])
    original = params[0].data
    kept = original.copy()
    opt = SGD(params, lr=0.1, weight_decay=0.1)
    params[0].grad[...] = 1.0
    opt.step()
    np.testing.assert_array_equal(original, kept)
    assert not np.array_equal(params[0].data, kept)


def test_zero_grad_is_one_fill_and_keeps_the_views(rng):
    params = make_params(rng, np.float64)
    opt = SGD(params, lr=0.1)
    views = [p.grad for p in params]
    for p in params:
        p.grad[...] = 3.0
    opt.zero_grad()
    for p, v in zip(params, views):
        assert p.grad is v
        assert not p.grad.any()
    before = [p.data.copy() for p in params]
    opt.step()  # zero gradient, no decay: nothing moves
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.data, b)


def test_replaced_grad_is_refused_at_step(rng):
    params = make_params(rng, np.float32, [(3,), (2,)])
    opt = SGD(params, lr=0.1)
    params[1].grad = np.ones(2, np.float32)
    with pytest.raises(RuntimeError, match=r"params\[1\].*\.grad replaced"):
        opt.step()
    params[1].grad = opt._groups[0].slots[1].grad
    opt.step()
    SGD(params, lr=0.1)  # a second optimizer re-homes the same parameters
    with pytest.raises(RuntimeError, match=r"params\[0\].*\.data replaced.*another optimizer"):
        opt.step()


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


# -- validation ------------------------------------------------------------------------------
def _p():
    return [Parameter(np.zeros(3, np.float32))]


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: SGD(_p(), lr=-1), ValueError, "Invalid learning rate: -1"),
        (lambda: SGD(_p(), lr=float("nan")), ValueError, "Invalid learning rate: nan"),
        (lambda: SGD(_p(), lr=0.1, momentum=-0.5), ValueError, "Invalid momentum value: -0.5"),
        (lambda: SGD(_p(), lr=0.1, weight_decay=-1e-4), ValueError,
         "Invalid weight_decay value: -0.0001"),
        (lambda: SGD(_p(), lr=0.1, nesterov=True), ValueError,
         "Nesterov momentum requires a momentum and zero dampening"),
        (lambda: SGD(_p(), lr=0.1, momentum=0.9, nesterov="yes"), TypeError, "nesterov must be"),
        (lambda: SGD(_p(), lr=None), TypeError, "lr must be a real number"),
        (lambda: Adam(_p(), lr=-0.1), ValueError, "Invalid learning rate: -0.1"),
        (lambda: Adam(_p(), eps=-1e-8), ValueError, "Invalid epsilon value: -1e-08"),
        (lambda: Adam(_p(), betas=(1.0, 0.999)), ValueError,
         "Invalid beta parameter at index 0: 1.0"),
        (lambda: Adam(_p(), betas=(0.9, -0.1)), ValueError,
         "Invalid beta parameter at index 1: -0.1"),
        (lambda: Adam(_p(), betas=(0.9,)), ValueError, "betas must be a pair"),
        (lambda: Adam(_p(), betas=(0.9, "x")), TypeError, r"betas\[1\] must be a real number"),
        (lambda: AdamW(_p(), weight_decay=-0.01), ValueError, "Invalid weight_decay value: -0.01"),
        (lambda: SGD([], lr=0.1), ValueError, "optimizer got an empty parameter list"),
        (lambda: SGD(iter([]), lr=0.1), ValueError, "empty parameter list"),
        (lambda: SGD(Parameter(np.zeros(2)), lr=0.1), TypeError, "single Parameter"),
        (lambda: SGD(3, lr=0.1), TypeError, "iterable of Parameter, got int"),
        (lambda: SGD([np.zeros(2)], lr=0.1), TypeError, r"params\[0\] is a ndarray"),
        (lambda: SGD([Parameter(np.zeros(2, np.int32))], lr=0.1), ValueError,
         r"params\[0\]: unsupported dtype int32"),
    ],
)
def test_validation_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_duplicate_parameters_are_refused():
    p, q = Parameter(np.zeros(2)), Parameter(np.zeros(2))
    with pytest.raises(ValueError, match=r"params\[2\] is the same Parameter as params\[0\]"):
        SGD([p, q, p], lr=0.1)


def test_grad_that_does_not_match_data_is_refused():
    p = Parameter(np.zeros((2, 3), np.float32))
    p.grad = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"params\[0\] has grad float32\(3, 2\) but data"):
        SGD([p], lr=0.1)
    p.grad = np.zeros((2, 3), np.float64)
    with pytest.raises(ValueError, match="float64"):
        SGD([p], lr=0.1)


def test_failed_construction_leaves_parameters_alone():
    p = Parameter(np.ones(3, np.float32))
    data = p.data
    with pytest.raises(ValueError):
        SGD([p], lr=-1.0)
    with pytest.raises(ValueError, match="same Parameter"):
        SGD([p, p], lr=1.0)
    assert p.data is data


def test_none_grad_becomes_zeros():
    p = Parameter(np.ones(3))
    p.grad = None
    SGD([p], lr=0.1)
    assert p.grad is not None and p.grad.shape == (3,) and not p.grad.any()


# -- state round trip ------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: AdamW(ps, lr=0.01, betas=(0.8, 0.99)),
])
def test_state_dict_round_trip_continues_identically(rng, make):
    shapes = [(3, 2), (4,)]
    a = make_params(rng, np.float32, shapes) + make_params(rng, np.float64, [(2,)])
    b = [Parameter(p.data.copy()) for p in a]
    opt_a = make(a)
    grads = grad_sequence(rng, [p.shape for p in a], 5)
    run(opt_a, a, grads[:3])
    opt_a.lr = 0.02
    sd = opt_a.state_dict()
    for p, q in zip(a, b):
        q.data[...] = p.data
    opt_b = make(b)
    opt_b.load_state_dict(sd)
    assert opt_b.lr == 0.02 and opt_b.defaults == opt_a.defaults
    run(opt_a, a, grads[3:])
    run(opt_b, b, grads[3:])
    for p, q in zip(a, b):
        np.testing.assert_array_equal(p.data, q.data)
    key = next(k for k in sd["state"][0] if k != "step")
    sd["state"][0][key][...] = 7.0  # state_dict hands out copies
    assert not (opt_a.state_dict()["state"][0][key] == 7.0).any()


def test_load_state_dict_rejects_mismatches(rng):
    params = make_params(rng, np.float32, [(3,), (2,)])
    opt = Adam(params)
    good = opt.state_dict()
    with pytest.raises(ValueError, match="keys 'state' and 'param_groups'"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="for 1 parameters, this optimizer has 2"):
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0], "params": [0]}]})
    bad = opt.state_dict()
    bad["state"][1]["exp_avg"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"\[1\]\['exp_avg'\] has shape \(3,\)"):
        opt.load_state_dict(bad)
    bad = opt.state_dict()
    bad["state"][1]["step"] = 4
    with pytest.raises(ValueError, match="share one step count"):
        opt.load_state_dict(bad)
    bad = opt.state_dict()
    bad["param_groups"][0]["betas"] = (2.0, 0.9)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 0"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="exactly one dict"):
        opt.load_state_dict({**good, "param_groups": [good["param_groups"][0]] * 2})
    with pytest.raises(ValueError, match=r"\['state'\]\[1\] must hold \['exp_avg', 'exp_avg_sq'"):
        opt.load_state_dict({**good, "state": {0: good["state"][0]}})
    with pytest.raises(ValueError, match="unknown Adam hyperparameter"):
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0], "amsgrad": 1}]})
    sgd = SGD(make_params(rng, np.float32, [(3,), (2,)]), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="unknown SGD hyperparameter"):
        sgd.load_state_dict(good)
    plain = SGD(make_params(rng, np.float32, [(3,), (2,)]), lr=0.1).state_dict()
    with pytest.raises(ValueError, match=r"needs state \(\), this optimizer keeps"):
        sgd.load_state_dict(plain)
    assert opt.state_dict()["state"][0]["step"] == 0  # nothing was half-loaded


# -- the launcher against the kernel source ---------------------------------------------------
def _kernel_signatures():
    src = kernels.source("optim")
    sigs = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)##SUFFIX\((.*?)\)', src,
                                   flags=re.S):
        sigs[name] = [re.sub(r"\s+", " ", a.replace("\\", "")).strip() for a in params.split(",")]
    return sigs


def _kind(c_decl):
    if "*" in c_decl:
        return "ptr"
    return {"long long": "i64", "double": "f64", "int": "i32"}[c_decl.rsplit(" ", 1)[0]]


def _arg_kind(a):
    if a is None or isinstance(a, (np.ndarray, np.uint64)):
        return "ptr"  # None: a device scalar, absent on the CPU; uint64: a NULL pointer
    return {np.int64: "i64", np.float64: "f64", np.int32: "i32"}[type(a)]


@pytest.mark.parametrize("make", [
    lambda ps: SGD(ps, lr=0.1), lambda ps: SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: Adam(ps), lambda ps: AdamW(ps),
])
def test_launch_arguments_match_kernel_signature(rng, make):
    sigs = _kernel_signatures()
    assert set(sigs) == {"sgd_", "adam_"}
    params = make_params(rng, np.float32, [(3,)]) + make_params(rng, dtypes.float16, [(5,)])
    opt = make(params)
    decl = sigs[f"{opt._kernel}_"]
    for g in opt._groups:
        args = opt._kernel_args(g)
        assert [_arg_kind(a) for a in args] == [_kind(d) for d in decl]
        # Pointer element types: T for data/grad, the compute type for the state.
        assert args[0] is g.data and args[1] is g.grad
        for a, d in zip(args[2:], decl[2:]):
            if isinstance(a, np.ndarray):
                assert "ComputeOf<T>::type" in d and a.dtype == g.compute_dtype
        assert args[decl.index("long long n")] == g.numel


def test_kernel_source_compiles_with_every_entry_point():
    pytest.importorskip("cupy")  # NVRTC comes with CuPy, which convfuse does not require
    for arch in kernels.CHECKED_ARCHS:
        cubin = kernels.nvrtc_compile("optim", arch)
        for kind in ("sgd", "adam"):
            for suffix in ("f32", "f64", "f16", "bf16"):
                assert f"{kind}_{suffix}\0".encode() in cubin


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
