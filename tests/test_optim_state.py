"""convfuse.optim's state_dict round trips: a loaded optimizer continues identically, and
mismatched state is refused without being half-loaded."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import Parameter
from convfuse.optim import SGD, Adam, AdamW
from convfuse.optim._flat import slots_in_order
from tests._optim_helpers import grad_sequence, make_params, run


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
        opt.load_state_dict({**good, "state": {**good["state"], 1: {"step": 0}}})
    with pytest.raises(ValueError, match=r"must share one step count >= 0, got \[0, 3\] \(a "
                                         r"missing or empty entry"):
        opt.load_state_dict({**good, "state": {0: {**good["state"][0], "step": 3}}})
    with pytest.raises(ValueError, match=r"\['params'\] must be the ids 0..1 in order"):
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0],
                                                       "params": [1, 0]}]})
    with pytest.raises(ValueError, match="unknown Adam hyperparameter"):
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0], "nope": 1}]})
    with pytest.raises(ValueError, match=r"^Adam: amsgrad=True is not supported"):
        opt.load_state_dict({**good, "param_groups": [{**good["param_groups"][0],
                                                       "amsgrad": True}]})
    bad = opt.state_dict()
    bad["state"][0]["step"] = np.array(1.5)
    with pytest.raises(TypeError, match=r"\['step'\] must be an int \(or a 0-d tensor or "
                                        r"array holding one\), got ndarray"):
        opt.load_state_dict(bad)
    sgd = SGD(make_params(rng, np.float32, [(3,), (2,)]), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="unknown SGD hyperparameter"):
        sgd.load_state_dict(good)
    bad = SGD(make_params(rng, np.float32, [(3,), (2,)]), lr=0.1).state_dict()
    bad["state"][1]["step"] = 2
    with pytest.raises(ValueError, match="share one step count"):
        sgd.load_state_dict(bad)  # a momentum change refused with it changes nothing
    assert sgd.defaults["momentum"] == 0.9 and "momentum_buffer" in sgd.state_dict()["state"][0]
    assert opt.state_dict()["state"][0]["step"] == 0  # nothing was half-loaded


@pytest.mark.parametrize(("saved", "built"), [(0.9, 0.0), (0.0, 0.9)])
def test_load_state_dict_takes_the_checkpoints_momentum_as_torch_optim(rng, saved, built):
    """torch.optim's load_state_dict takes the checkpoint's hyperparameters whatever the
    optimizer was built with; the momentum buffer comes (or goes) with them."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 6)
    ours = make_params(rng, np.float64, shapes)
    theirs = [torch.tensor(p.data, requires_grad=True) for p in ours]
    opt, ref = SGD(ours, lr=0.1, momentum=saved), torch.optim.SGD(theirs, lr=0.1,
                                                                   momentum=saved)

    def steps(gs):
        run(opt, ours, gs)
        for g in gs:
            for t, gi in zip(theirs, g):
                t.grad = torch.tensor(gi)
            ref.step()

    steps(grads[:3])
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    fresh = [Parameter(p.data.copy()) for p in ours]
    opt = SGD(fresh, lr=0.5, momentum=built)
    ref = torch.optim.SGD(theirs, lr=0.5, momentum=built)
    opt.load_state_dict(sd)
    ref.load_state_dict(ref_sd)
    ours = fresh
    assert opt.defaults["momentum"] == ref.param_groups[0]["momentum"] == saved
    # the CPU captures no step: the replaced buffers are not kept (on the GPU a step
    # captured before would still use them, so they stay alive there)
    assert all(not g.retired for g in opt._groups)
    steps(grads[3:])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-14, atol=1e-15)


def test_a_step_on_another_stream_waits_for_the_host_written_state(monkeypatch):
    """Note [optimizer state across streams]: what the host wrote (construction's zero
    fills, load_state_dict, an lr) ends with an event on its stream; the next step's stream
    waits for it until the host has seen it done, then no more."""
    import contextlib

    from convfuse.optim import Adam, _base
    from convfuse.plan import capture
    from tests.test_ops_cudnn_wiring import FakeGpu, FakeStream

    gpu = FakeGpu(monkeypatch)
    monkeypatch.setattr(_base, "device_context", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(capture, "stream_is_capturing", lambda *a: False)
    opt = object.__new__(Adam)
    opt._device_id, opt._groups = 0, []
    opt._mark_filled()  # as construction's fills end
    [(_, event, on)] = gpu.stream_ops
    assert on == gpu.stream.ptr
    gpu.stream = FakeStream(0x6000)  # the step's stream
    opt.step()
    assert gpu.stream_ops[-1] == ("wait", event, 0x6000, 0) and opt._filled is not None
    opt._filled.event.done = True
    opt.step()  # seen done: dropped, no wait
    opt.step()
    assert len(gpu.stream_ops) == 2 and opt._filled is None


def test_an_event_a_capture_waited_on_outlives_its_optimizer_fill(monkeypatch):
    """A step captured while the optimizer's fill was pending records an external wait on
    its event; the event must outlive the graph, though the next lr assignment replaces
    the fill (constants._WAITED_IN_CAPTURE holds it)."""
    import contextlib
    import gc
    import weakref

    from convfuse.ops.cudnn import constants
    from convfuse.optim import Adam, _base
    from convfuse.plan import capture
    from tests.test_ops_cudnn_wiring import FakeGpu

    gpu = FakeGpu(monkeypatch)
    monkeypatch.setattr(_base, "device_context", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(constants, "_WAITED_IN_CAPTURE", [])
    opt = object.__new__(Adam)
    opt._device_id, opt._groups = 0, []
    opt._mark_filled()
    event = weakref.ref(opt._filled.event)
    monkeypatch.setattr(capture, "stream_is_capturing", lambda *a: True)
    opt.step()  # recorded into the graph: an external wait
    opt.step()
    assert [op[0] for op in gpu.stream_ops].count("wait") == 2
    assert gpu.stream_ops[-1][3] == constants.EVENT_WAIT_EXTERNAL
    opt._mark_filled()  # as `opt.lr = ...` between replays
    gc.collect()
    assert event() is not None and constants._WAITED_IN_CAPTURE[0] is event()


def test_a_step_on_the_writes_own_stream_needs_no_wait(monkeypatch):
    """Note [optimizer state across streams]: the stream the host's write was queued on
    already orders it before the step: no query, no wait (a per-step lr schedule costs
    nothing there)."""
    import contextlib

    from convfuse.optim import Adam, _base
    from convfuse.plan import capture
    from tests.test_ops_cudnn_wiring import FakeGpu

    gpu = FakeGpu(monkeypatch)
    monkeypatch.setattr(_base, "device_context", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(capture, "stream_is_capturing", lambda *a: False)
    opt = object.__new__(Adam)
    opt._device_id, opt._groups = 0, []
    opt._mark_filled()
    opt.step()
    assert [op[0] for op in gpu.stream_ops] == ["record"] and opt._filled is None


# -- torch.optim's checkpoints and flags ------------------------------------------------------
def _torch_pair(torch, rng, shapes, make_ours, make_theirs):
    ours = make_params(rng, np.float64, shapes)
    theirs = [torch.tensor(p.data, requires_grad=True) for p in ours]
    return ours, theirs, make_ours(ours), make_theirs(theirs)


def _torch_steps(torch, ours, theirs, opt, ref, grads):
    run(opt, ours, grads)
    for g in grads:
        for t, gi in zip(theirs, g):
            t.grad = torch.tensor(gi)
        ref.step()


@pytest.mark.parametrize(("saved", "loaded"), [("AdamW", "Adam"), ("Adam", "AdamW"),
                                               ("AdamW", "AdamW"), ("Adam", "Adam")])
def test_decoupled_weight_decay_loads_as_torch_optim(rng, saved, loaded):
    """torch 2.x saves decoupled_weight_decay in the group: Adam takes the checkpoint's
    (an AdamW checkpoint makes it decay as AdamW), AdamW stays decoupled. Both optimizers
    load the same convfuse checkpoint as torch's load torch's and continue in step."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 6)
    kw = {"lr": 0.01, "weight_decay": 0.3}
    ours, theirs, opt, ref = _torch_pair(
        torch, rng, shapes, lambda ps: getattr(cf.optim, saved)(ps, **kw),
        lambda ps: getattr(torch.optim, saved)(ps, **kw))
    _torch_steps(torch, ours, theirs, opt, ref, grads[:3])
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert sd["param_groups"][0]["decoupled_weight_decay"] == \
        ref_sd["param_groups"][0]["decoupled_weight_decay"] == (saved == "AdamW")
    fresh = [Parameter(p.data.copy()) for p in ours]
    opt = getattr(cf.optim, loaded)(fresh, **kw)
    ref = getattr(torch.optim, loaded)(theirs, **kw)
    opt.load_state_dict(sd)
    ref.load_state_dict(ref_sd)
    assert opt.defaults["decoupled_weight_decay"] == \
        ref.param_groups[0]["decoupled_weight_decay"]
    # what the GPU kernel is handed (its CPU twin is checked by the steps below)
    assert opt._hyper_args()[-1] == int(ref.param_groups[0]["decoupled_weight_decay"])
    _torch_steps(torch, fresh, theirs, opt, ref, grads[3:])
    for p, t in zip(fresh, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("loaded, flag", [("Adam", False), ("AdamW", False), ("Adam", True)])
def test_a_checkpoint_without_the_decoupled_flag_loads_as_in_torch_optim(rng, loaded, flag):
    """A checkpoint saved before the flag was (convfuse's, or torch 1.x's) has no key:
    torch.optim's __setstate__ defaults it to False, so Adam decays as L2 even when built
    with decoupled_weight_decay=True, and AdamW stays decoupled."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2)]
    grads = grad_sequence(rng, shapes, 4)
    kw = {"lr": 0.01, "weight_decay": 0.3}
    other = "Adam" if loaded == "AdamW" else "AdamW"
    ours, theirs, opt, ref = _torch_pair(
        torch, rng, shapes, lambda ps: getattr(cf.optim, other)(ps, **kw),
        lambda ps: getattr(torch.optim, other)(ps, **kw))
    _torch_steps(torch, ours, theirs, opt, ref, grads[:2])
    sd, ref_sd = opt.state_dict(), ref.state_dict()
    del sd["param_groups"][0]["decoupled_weight_decay"]
    del ref_sd["param_groups"][0]["decoupled_weight_decay"]
    extra = {"decoupled_weight_decay": True} if flag else {}
    opt = getattr(cf.optim, loaded)(ours, **kw, **extra)
    ref = getattr(torch.optim, loaded)(theirs, **kw, **extra)
    opt.load_state_dict(sd)
    ref.load_state_dict(ref_sd)
    decoupled = ref.param_groups[0]["decoupled_weight_decay"]
    assert decoupled == (loaded == "AdamW")
    assert opt.defaults["decoupled_weight_decay"] == decoupled
    assert opt._hyper_args()[-1] == int(decoupled)  # what the GPU kernel is handed
    _torch_steps(torch, ours, theirs, opt, ref, grads[2:])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_torch_optims_own_adam_state_dict_loads(rng, name):
    """torch.optim.Adam's state_dict as torch saves it (tensors, a 0-d float tensor step,
    the group's foreach/fused/... flags at their defaults) loads, and the two continue in
    step."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 6)
    ours, theirs, opt, ref = _torch_pair(
        torch, rng, shapes, lambda ps: getattr(cf.optim, name)(ps, lr=0.5),
        lambda ps: getattr(torch.optim, name)(ps, lr=0.02, betas=(0.8, 0.99),
                                              weight_decay=0.1))
    for g in grads[:3]:
        for t, gi in zip(theirs, g):
            t.grad = torch.tensor(gi)
        ref.step()
    ref_sd = ref.state_dict()
    assert ref_sd["state"][0]["step"].shape == () and ref_sd["state"][0]["step"].is_floating_point()
    for p, t in zip(ours, theirs):
        p.data[...] = t.detach().numpy()
    opt.load_state_dict(ref_sd)
    assert opt.lr == 0.02 and opt.defaults["betas"] == (0.8, 0.99)
    assert opt.state_dict()["state"][1]["step"] == 3
    _torch_steps(torch, ours, theirs, opt, ref, grads[3:])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("before", [0, 3])
def test_torch_optims_sgd_state_dict_loads_and_continues(rng, before):
    """torch.optim.SGD's state counts no steps (an entry is its momentum buffer, none before
    the first step): it loads as stepped, all the rule reads, and the two continue in step."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, before + 3)
    ours, theirs, opt, ref = _torch_pair(
        torch, rng, shapes, lambda ps: SGD(ps, lr=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.1))
    for g in grads[:before]:
        for t, gi in zip(theirs, g):
            t.grad = torch.tensor(gi)
        ref.step()
    for p, t in zip(ours, theirs):
        p.data[...] = t.detach().numpy()
    opt.load_state_dict(ref.state_dict())
    assert opt.lr == 0.02 and opt.defaults["nesterov"] is True
    assert opt.state_dict()["state"][0]["step"] == min(before, 1)
    _torch_steps(torch, ours, theirs, opt, ref, grads[before:])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("make", [
    lambda m, ps: m.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
    lambda m, ps: m.SGD(ps, lr=0.05),
    lambda m, ps: m.Adam(ps, lr=0.05, betas=(0.8, 0.99), weight_decay=0.1),
    lambda m, ps: m.AdamW(ps, lr=0.05),
], ids=["sgd-momentum", "sgd", "adam", "adamw"])
def test_a_convfuse_checkpoint_loads_into_torch_optim_and_continues(rng, make):
    """The other direction: torch.optim loads what state_dict() saves (the group carries
    torch's flags at their defaults: without `dampening`, torch.optim.SGD's first step
    raised KeyError) and continues the same trajectory."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 6)
    ours = make_params(rng, np.float64, shapes)
    opt = make(cf.optim, ours)
    run(opt, ours, grads[:3])
    theirs = [torch.tensor(p.data, requires_grad=True) for p in ours]
    ref = make(torch.optim, theirs)
    sd = opt.state_dict()
    ref.load_state_dict({"state": {i: {k: torch.as_tensor(v) for k, v in e.items()}
                                   for i, e in sd["state"].items()},
                         "param_groups": sd["param_groups"]})
    _torch_steps(torch, ours, theirs, opt, ref, grads[3:])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


def test_torch_optim_state_dicts_as_torch_writes_them_load(rng):
    """What torch.optim adds to a group (an lr_scheduler's initial_lr, named_parameters()'
    param_names) is not a hyperparameter and is ignored; a torch optimizer that has not
    stepped has an empty state, which is step 0."""
    torch = pytest.importorskip("torch")
    shapes = [(3, 2), (4,)]
    grads = grad_sequence(rng, shapes, 5)
    ours, theirs, opt, ref = _torch_pair(
        torch, rng, shapes, lambda ps: Adam(ps, lr=0.5),
        lambda ps: torch.optim.Adam([(f"p{i}", p) for i, p in enumerate(ps)], lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    sd = ref.state_dict()
    assert sd["state"] == {} and {"initial_lr", "param_names"} <= set(sd["param_groups"][0])
    opt.load_state_dict(sd)
    assert opt.lr == 0.1 and opt.state_dict()["state"][0]["step"] == 0
    for g in grads[:2]:
        for t, gi in zip(theirs, g):
            t.grad = torch.tensor(gi)
        ref.step()
        sched.step()
    for p, t in zip(ours, theirs):
        p.data[...] = t.detach().numpy()
    opt.load_state_dict(ref.state_dict())
    assert opt.lr == 0.025
    _torch_steps(torch, ours, theirs, opt, ref, grads[2:3])
    for p, t in zip(ours, theirs):
        np.testing.assert_allclose(p.data, t.detach().numpy(), rtol=1e-13, atol=1e-15)


def test_a_torch_bfloat16_state_loads(rng):
    """torch keeps a bfloat16 parameter's Adam moments in bfloat16, which NumPy cannot read
    over __array__: they load (as the model loader reads a bfloat16 tensor), exactly."""
    torch = pytest.importorskip("torch")
    t = torch.linspace(-1, 1, 6, dtype=torch.bfloat16).requires_grad_()
    ref = torch.optim.Adam([t], lr=0.1)
    t.grad = torch.linspace(0.5, -0.25, 6, dtype=torch.bfloat16)
    ref.step()
    opt = Adam([Parameter(np.zeros(6, dtype=cf.dtypes.bfloat16))])
    opt.load_state_dict(ref.state_dict())
    got = opt.state_dict()["state"][0]
    for k in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(got[k], ref.state[t][k].float().numpy())
    bad = ref.state_dict()
    bad["state"][0]["exp_avg"] = "zeros"
    with pytest.raises(TypeError, match=r"^Adam: state_dict\['state'\]\[0\]\['exp_avg'\] must "
                                         "be a floating array"):
        opt.load_state_dict(bad)


def test_a_write_into_defaults_changes_nothing(rng):
    """Every step reads the hyperparameters: a write into `defaults` skipped the
    constructor's checks (a momentum set there had no buffer: KeyError at the step). It is
    a copy, a plain dict (JSON, pickle, torch.save take it), and writing it changes no step,
    as writing torch.optim's changes no existing group."""
    import json
    import pickle

    params = make_params(rng, np.float64, [(3,)])
    opt = SGD(params, lr=0.1)
    opt.defaults["momentum"] = 0.9
    assert opt.defaults == {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}
    assert json.loads(json.dumps(opt.defaults)) == pickle.loads(pickle.dumps(opt.defaults))
    before = params[0].data.copy()
    params[0].grad[...] = 1.0
    opt.step()
    np.testing.assert_array_equal(params[0].data, before - 0.1)


def test_named_parameters_are_taken_as_torch_optim_takes_them(rng):
    """torch.optim (2.6+) takes model.named_parameters(): the same optimizer as from the
    parameters; a mix of pairs and parameters is refused, naming the entry."""
    model = cf.Linear(3, 2, dtype="float64", seed=0)
    a, b = SGD(model.named_parameters(), lr=0.1), SGD(model.parameters(), lr=0.1)
    for opt in (a, b):
        assert [s.param for _, s in slots_in_order(opt._groups)] == list(model.parameters())
    with pytest.raises(TypeError, match=r"^SGD: params\[1\] is a tuple, expected a convfuse "
                                        r"Parameter \(named parameters must all be"):
        SGD([model.weight, ("bias", model.bias)], lr=0.1)
