"""padding_mode and even-kernel padding='same' on the GPU: the pad op on CuPy against the
NumPy engine, layers on cuda against the same layers on the CPU in float64, and a captured
step (the pad path has no host sync)."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
import convfuse.ops as ops
from convfuse.ops import pad_slices
from convfuse.pad_geometry import PadGeometry

pytestmark = pytest.mark.gpu

MODES = ("zeros", "reflect", "replicate", "circular")
CASES = [  # spatial, pads (limits of each mode included: reflect size-1, circular size)
    ((5,), [(4, 3)]),
    ((4, 3), [(3, 2), (2, 0)]),
    ((3, 4, 2), [(1, 2), (0, 3), (1, 1)]),
]


def limit(pads, spatial, mode):
    if mode == "reflect":
        return [(min(a, n - 1), min(b, n - 1)) for (a, b), n in zip(pads, spatial)]
    if mode == "circular":
        return [(min(a, n), min(b, n)) for (a, b), n in zip(pads, spatial)]
    return pads


@pytest.fixture
def engine_calls(monkeypatch):
    """Record which engine's pad functions run; the reference must not see CuPy arrays."""
    from convfuse.ops.cudnn import pad as gpu_pad
    from convfuse.ops.reference import pad as ref_pad

    calls = []
    for name in ("pad_forward", "pad_backward"):
        real = getattr(gpu_pad, name)

        def spy(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        def forbidden(*args, _name=name):
            raise AssertionError(f"the NumPy engine ran {_name} on CuPy arrays")

        monkeypatch.setattr(gpu_pad, name, spy)
        monkeypatch.setattr(ref_pad, name, forbidden)
    return calls


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_pad_op_on_cupy_matches_numpy(engine_calls, monkeypatch, dtype, mode, layout, case):
    import cupy as cp

    from tests.gpu.test_cudnn_ops import poison_outputs

    spatial, pads = CASES[case]
    pads = limit(pads, spatial, mode)
    rng = np.random.default_rng(case)
    dt = cf.dtypes.canonical(dtype)
    shape_cf = (2, 3, *spatial)
    shape = (shape_cf[0], *shape_cf[2:], shape_cf[1]) if layout == "NHWC" else shape_cf
    g = PadGeometry.create(shape, pads, mode, layout)
    x = rng.standard_normal(shape).astype(dt)
    dy = rng.standard_normal(g.output_shape).astype(dt)
    xd, dyd = cp.asarray(x), cp.asarray(dy)
    with poison_outputs(monkeypatch):  # every element of y and dx is compared: NaN shows
        y = ops.pad_forward(xd, g)
        dx = ops.pad_backward(dyd, g)
    assert engine_calls == ["pad_forward", "pad_backward"]
    assert isinstance(y, cp.ndarray) and y.dtype == dt and y.flags.c_contiguous
    # the NumPy engine is patched out above: its body, called directly, is the oracle
    np.testing.assert_array_equal(y.get(), pad_slices.pad_forward(np, x, g))
    expect = pad_slices.pad_backward(np, dy.astype(np.float64), g)
    tol = {"float64": 1e-13, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    np.testing.assert_allclose(dx.get().astype(np.float64), expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("rank,kernel,padding", [(1, 4, "same"), (2, 3, 2), (2, (2, 3), "same"),
                                                 (3, 3, 1)])
def test_layer_on_cuda_matches_cpu_float64(mode, layout, rank, kernel, padding):
    import cupy as cp

    cls = {1: cf.Conv1d, 2: cf.Conv2d, 3: cf.Conv3d}[rank]
    kw = dict(padding=padding, activation="relu", layout=layout, padding_mode=mode, seed=5,
              dtype="float64")
    gpu, ref = cls(3, 4, kernel, device="cuda", **kw), cls(3, 4, kernel, device="cpu", **kw)
    ref.load_state_dict({k: cp.asnumpy(v) for k, v in gpu.state_dict().items()})
    rng = np.random.default_rng(rank)
    spatial = (6, 5, 4)[:rank]
    shape = (2, *spatial, 3) if layout == "NHWC" else (2, 3, *spatial)
    x = rng.standard_normal(shape)
    with cf.config.flags(allow_tf32=False):
        y = gpu(cp.asarray(x))
        y_ref = ref(x)
        np.testing.assert_allclose(y.get(), y_ref, rtol=1e-10, atol=1e-10)
        dy = rng.standard_normal(y_ref.shape)
        dx = gpu.backward(cp.asarray(dy))
        dx_ref = ref.backward(dy)
    np.testing.assert_allclose(dx.get(), dx_ref, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gpu.weight.grad.get(), ref.weight.grad, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gpu.bias.grad.get(), ref.bias.grad, rtol=1e-10, atol=1e-10)


def test_reflect_too_wide_is_refused_before_cudnn(monkeypatch):
    import cupy as cp

    from convfuse.ops.cudnn import conv as gpu_conv

    def forbidden(*args, **kwargs):
        raise AssertionError("cuDNN was reached")

    monkeypatch.setattr(gpu_conv, "conv_bias_act", forbidden)
    layer = cf.Conv2d(1, 1, 3, padding=3, padding_mode="reflect", device="cuda")
    with pytest.raises(ValueError, match=r"^Conv2d: padding_mode='reflect' needs padding <"):
        layer(cp.zeros((1, 1, 3, 8), dtype=cp.float32))


def test_captured_step_with_reflect_padding_replays_like_eager():
    """graph.capture refuses a host sync, so a replay equal to eager steps shows the pad
    op and its backward stay on the device."""
    import cupy as cp

    def build():
        model = cf.Sequential(
            cf.Conv2d(1, 4, 4, padding="same", padding_mode="reflect", activation="relu",
                      device="cuda", seed=0),
            cf.Conv2d(4, 2, 3, padding=1, padding_mode="circular", device="cuda", seed=1),
        )
        opt = cf.optim.SGD(model.parameters(), lr=0.1)

        def step(x, dy):
            opt.zero_grad()
            y = model(x)
            model.backward(dy)
            opt.step()
            return y

        return model, step

    rng = np.random.default_rng(0)
    data = [(rng.random((2, 1, 6, 6), dtype=np.float32),
             rng.random((2, 2, 6, 6), dtype=np.float32)) for _ in range(4)]
    eager, eager_step = build()
    for x, dy in data:
        eager_step(cp.asarray(x), cp.asarray(dy))
    graph, graph_step = build()
    captured = cf.graph.capture(graph_step, cp.asarray(data[0][0]), cp.asarray(data[0][1]))
    for x, dy in data[1:]:
        captured(cp.asarray(x), cp.asarray(dy))
    captured.synchronize()
    for pe, pg in zip(eager.parameters(), graph.parameters()):
        np.testing.assert_allclose(pg.data.get(), pe.data.get(), rtol=1e-5, atol=1e-6)
