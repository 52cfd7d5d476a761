"""convfuse.optim on the GPU: the fused kernels against the NumPy path, one launch per dtype
group per step, CUDA-graph capture and replay, and a learning rate changed without a sync.

The CPU path is itself checked against float64 transcriptions (and PyTorch when installed)
in tests/test_optim.py, so here it serves as the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import convfuse.kernels as kernels
from convfuse import Parameter, dtypes
from convfuse.errors import DeviceMismatchError
from convfuse.optim import SGD, Adam, AdamW
from convfuse.optim._flat import ALIGN_BYTES

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

MAKERS = {
    "sgd": lambda ps: SGD(ps, lr=0.05),
    "sgd_nesterov": lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    "adam": lambda ps: Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: AdamW(ps, lr=0.01, betas=(0.3, 0.99), weight_decay=0.1),
}
# float32/float64: the kernel contracts multiply-adds into FMAs where NumPy rounds twice.
# float16/bfloat16: a value on a rounding boundary may land one ulp apart.
TOL = {
    dtypes.float64: dict(rtol=1e-12, atol=1e-14),
    dtypes.float32: dict(rtol=1e-5, atol=1e-6),
    dtypes.float16: dict(rtol=2e-3, atol=2e-3),
    dtypes.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


def _big_size() -> int:
    """Larger than one wave of the kernel's grid, so the grid-stride loop wraps."""
    attrs = cp.cuda.Device().attributes
    return 3 * attrs["MultiProcessorCount"] * attrs["MaxThreadsPerMultiProcessor"] + 7


def _shapes():
    return [(3, 4), (5,), (), (0, 2), (2, 3, 5), (_big_size(),)]


def _grads(rng, shapes, steps, dtype):
    """Gradients bounded away from zero with a fixed sign per element, so that every
    element of every parameter moves by many ulps on every step (a missed element shows)."""
    signs = [np.where(rng.random(s) < 0.5, -1.0, 1.0) for s in shapes]
    return [[(sg * (0.5 + rng.random(s))).astype(dtype) for sg, s in zip(signs, shapes)]
            for _ in range(steps)]


def _twins(rng, dtype, shapes):
    host = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return [Parameter(h.copy()) for h in host], [Parameter(cp.asarray(h)) for h in host]


def _assert_close(got, want, dtype):
    got = cp.asnumpy(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), **TOL[dtype])


@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float64, dtypes.float16,
                                   dtypes.bfloat16], ids=str)
def test_gpu_matches_cpu_over_several_steps(rng, kind, dtype):
    shapes = _shapes()
    cpu, gpu = _twins(rng, dtype, shapes)
    start = [p.data.copy() for p in cpu]
    oc, og = MAKERS[kind](cpu), MAKERS[kind](gpu)
    for k, gs in enumerate(_grads(rng, shapes, 4, dtype)):
        if k == 2:
            oc.lr = og.lr = oc.lr / 2
        for pc, pg, g in zip(cpu, gpu, gs):
            pc.grad[...] = g
            pg.grad[...] = cp.asarray(g)
        oc.step()
        og.step()
    cp.cuda.get_current_stream().synchronize()
    for pc, pg, s in zip(cpu, gpu, start):
        assert pg.data.data.ptr % ALIGN_BYTES == 0 and pg.grad.data.ptr % ALIGN_BYTES == 0
        _assert_close(pg.data, pc.data, dtype)
        if dtype in (dtypes.float32, dtypes.float64):
            assert (cp.asnumpy(pg.data) != s).all()  # every element was written
    sc, sg = oc.state_dict(), og.state_dict()
    for i in sc["state"]:
        assert sg["state"][i]["step"] == sc["state"][i]["step"] == 4  # counted on the device
        for name, want in sc["state"][i].items():
            if name != "step":
                # a parameter one ulp apart feeds back through weight decay: param tolerances
                _assert_close(sg["state"][i][name], want, dtype)


def test_first_sgd_step_writes_every_momentum_element(rng):
    shapes = _shapes()
    _, gpu = _twins(rng, dtypes.float32, shapes)
    opt = SGD(gpu, lr=0.1, momentum=0.9)
    for g in opt._groups:
        g.state["momentum_buffer"].fill(cp.nan)  # poison: step 1 must overwrite, not blend
    grads = _grads(rng, shapes, 1, np.float32)[0]
    for p, g in zip(gpu, grads):
        p.grad[...] = cp.asarray(g)
    opt.step()
    state = opt.state_dict()["state"]
    for i, g in enumerate(grads):
        np.testing.assert_array_equal(state[i]["momentum_buffer"], g)


def _count_launches(monkeypatch):
    calls = []
    real_function = kernels.function

    def counting(module, name):
        kernel = real_function(module, name)

        def launch(grid, block, args, **kwargs):
            calls.append(name)
            return kernel(grid, block, args, **kwargs)

        return launch

    monkeypatch.setattr(kernels, "function", counting)
    return calls


@pytest.mark.parametrize("kind", ["sgd_nesterov", "adam"])
def test_one_launch_per_dtype_group_per_step(rng, monkeypatch, kind):
    calls = _count_launches(monkeypatch)
    params = [Parameter(cp.asarray(rng.standard_normal(s).astype(dt)))
              for s, dt in [((4, 4), np.float32), ((9,), dtypes.float16), ((3,), np.float32),
                            ((2, 2), dtypes.float16), ((5,), np.float64)]]
    opt = MAKERS[kind](params)
    prefix = opt._kernel
    for step in range(1, 4):
        opt.step()
        assert sorted(calls) == sorted([f"{prefix}_{s}" for s in ("f32", "f16", "f64")] * step)
    calls.clear()
    opt.zero_grad()
    opt.lr = 0.5
    assert calls == []


def test_lr_and_step_need_no_synchronisation(rng):
    import cupyx

    _, gpu = _twins(rng, dtypes.float32, [(64,), (7,)])
    opt = Adam(gpu, lr=0.01)
    with cupyx.allow_synchronize(False):  # raises DeviceSynchronized on any CuPy sync
        for lr in (0.01, 0.02, 0.005):
            opt.lr = lr
            opt.zero_grad()
            opt.step()
    assert opt.lr == 0.005
    assert opt.state_dict()["state"][0]["step"] == 3


@pytest.mark.parametrize("kind", ["sgd_nesterov", "adam", "adamw"])
def test_captured_step_replays_like_eager_steps(rng, kind):
    shapes = [(3, 4), (5,), (1000,)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    eager = [Parameter(cp.asarray(h)) for h in host]
    graphed = [Parameter(cp.asarray(h)) for h in host]
    oe, og = MAKERS[kind](eager), MAKERS[kind](graphed)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        og.step()
        graph = stream.end_capture()
    stream.synchronize()
    # Capturing records the launch without running it.
    assert og.state_dict()["state"][0]["step"] == 0
    np.testing.assert_array_equal(cp.asnumpy(graphed[2].data), host[2])
    with stream:
        for k, gs in enumerate(_grads(rng, shapes, 5, np.float32)):
            if k == 3:  # the graph reads the device scalar, so a new lr reaches the replay
                oe.lr = og.lr = oe.lr * 0.3
            for pe, pg, g in zip(eager, graphed, gs):
                pe.grad[...] = cp.asarray(g)  # in place: the graph reads these buffers
                pg.grad[...] = pe.grad
            oe.step()
            graph.launch(stream)
    stream.synchronize()
    for pe, pg in zip(eager, graphed):
        np.testing.assert_array_equal(cp.asnumpy(pg.data), cp.asnumpy(pe.data))
    se, sg = oe.state_dict(), og.state_dict()
    for i in se["state"]:
        assert sg["state"][i]["step"] == se["state"][i]["step"] == 5
        for name in se["state"][i]:
            np.testing.assert_array_equal(sg["state"][i][name], se["state"][i][name])


def test_assigning_lr_inside_a_capture_is_refused(rng):
    """The fill of the device copy would be recorded with that value and replayed over every
    later assignment: refused before the host mirror changes, and the capture ends cleanly."""
    from convfuse.errors import CaptureError

    p = Parameter(cp.asarray(rng.standard_normal(8).astype(np.float32)))
    opt = SGD([p], lr=0.1)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(CaptureError, match=r"SGD\.lr was assigned while a CUDA graph"):
                opt.lr = 0.05
        finally:
            stream.end_capture()
    assert opt.lr == 0.1  # refused before anything changed
    opt.lr = 0.02  # outside the capture: fine
    stream.synchronize()


def test_state_moves_between_cpu_and_gpu(rng):
    shapes = [(3, 2), (4,)]
    cpu, gpu = _twins(rng, np.float64, shapes)
    oc = AdamW(cpu, lr=0.02)
    grads = _grads(rng, shapes, 4, np.float64)
    for gs in grads[:2]:
        for p, g in zip(cpu, gs):
            p.grad[...] = g
        oc.step()
    for pc, pg in zip(cpu, gpu):
        pg.data[...] = cp.asarray(pc.data)
    og = AdamW(gpu, lr=0.5)
    og.load_state_dict(oc.state_dict())
    assert og.lr == 0.02
    for gs in grads[2:]:
        for pc, pg, g in zip(cpu, gpu, gs):
            pc.grad[...] = g
            pg.grad[...] = cp.asarray(g)
        oc.step()
        og.step()
    for pc, pg in zip(cpu, gpu):
        _assert_close(pg.data, pc.data, dtypes.float64)
    assert og.state_dict()["state"][1]["step"] == 4


def test_mixed_devices_are_refused():
    host = Parameter(np.zeros(3, np.float32))
    dev = Parameter(cp.zeros(3, np.float32))
    with pytest.raises(DeviceMismatchError, match="one device"):
        SGD([host, dev], lr=0.1)
    if cp.cuda.runtime.getDeviceCount() >= 2:
        with cp.cuda.Device(1):
            other = Parameter(cp.zeros(3, np.float32))
        with pytest.raises(DeviceMismatchError, match=r"cuda:0, cuda:1"):
            SGD([dev, other], lr=0.1)


def test_state_replaced_by_a_load_stays_alive_for_steps_captured_before():
    """A load whose checkpoint has other state (SGD's momentum into SGD without) replaces
    the state buffers; on the GPU the old ones are kept (a step captured before replays
    on them), on the CPU not (tests/test_optim_state.py)."""
    p = Parameter(cp.ones(8, dtype=cp.float32))
    p.grad = cp.ones(8, dtype=cp.float32)
    with_momentum = SGD([p], lr=0.1, momentum=0.9)
    with_momentum.step()
    plain = SGD([Parameter(cp.ones(8, dtype=cp.float32))], lr=0.1)
    plain.load_state_dict(with_momentum.state_dict())
    assert [list(r) for g in plain._groups for r in g.retired] == [[]]
    with_momentum.load_state_dict(SGD([p], lr=0.1).state_dict())
    assert [list(r) for g in with_momentum._groups for r in g.retired] == \
        [["momentum_buffer"]]
