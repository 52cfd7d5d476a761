"""Note [batch split] on a real GPU: a float16 convolution of 5 x 2**29 elements (more than
cuDNN's 32-bit descriptors index) runs as parts of 3 and 2 samples. Each result is compared
with the same op run on one sample at a time (one call, no split), the filter and bias
gradients with the float64 sum of the per-sample ones; outputs passed in are NaN-poisoned.
The binding's calls are spied on: the parts, not one call, ran. tests/test_batch_split.py
checks the pointers and scaling factors of each part on a fake GPU."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest

import convfuse.ops as ops
from convfuse._binding import cudnn
from convfuse.geometry import ConvGeometry
from convfuse.plan import clear_plan_cache

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

N, SAMPLE = 5, (1, 16384, 32768)  # 2**29 elements a sample: parts of 3 and 2 samples
GEOM = ConvGeometry.create((N, *SAMPLE), (1, 1, 3, 3), padding=1)
ONE = ConvGeometry.create((1, *SAMPLE), (1, 1, 3, 3), padding=1)
NEED = 40 << 30  # x, dz, residual, outputs and the per-sample references, with room


@pytest.fixture(scope="module")
def data():
    cp.get_default_memory_pool().free_all_blocks()  # earlier tests' cached blocks
    with contextlib.suppress(ImportError):
        import torch

        torch.cuda.empty_cache()
    if cp.cuda.runtime.memGetInfo()[0] < NEED:
        pytest.skip(f"needs {NEED >> 30} GiB of free device memory for 2**31+ elements")
    clear_plan_cache()
    rng = cp.random.default_rng(3)

    def draw(shape, scale):
        a = cp.empty(shape, cp.float16)
        for i in range(shape[0]):  # one sample at a time: a float32 draw of it, not of all
            a[i] = (rng.random(shape[1:], dtype=cp.float32) * 2 - 1) * scale
        return a

    d = {"x": draw(GEOM.input_shape, 1.0), "res": draw(GEOM.output_shape, 1.0),
         "dz": draw(GEOM.output_shape, 0.01),
         "w": cp.asarray(np.random.default_rng(4).uniform(-0.3, 0.3, GEOM.weight_shape),
                         cp.float16),
         "b": cp.asarray([0.25], cp.float16)}
    yield d
    d.clear()
    clear_plan_cache()
    cp.get_default_memory_pool().free_all_blocks()


@pytest.fixture
def batches(monkeypatch):
    """The batch size of each cuDNN call's x descriptor (its first dim)."""
    lib, seen = cudnn(), []
    for name, desc_at in (("convolutionBiasActivationForward", 2), ("convolutionForward", 2),
                          ("convolutionBackwardData", 11), ("convolutionBackwardFilter", 2),
                          ("convolutionBackwardBias", 2)):
        real = getattr(lib, name)

        def spy(*a, _real=real, _at=desc_at):
            seen.append(a[_at].getNd()[1][0])
            return _real(*a)

        monkeypatch.setattr(lib, name, spy)
    return seen


def runs(batches):
    """The parts that ran: a part's retries after a refused algorithm count once."""
    return [k for k, _ in itertools.groupby(batches)]


def poisoned(shape):
    return cp.full(shape, np.nan, cp.float16)


def per_sample_error(got, one):
    """max over samples of max|got[i] - one(i)| / max|one(i)|."""
    worst = 0.0
    for i in range(N):
        ref = one(i).astype(cp.float32)
        err = float(cp.abs(got[i:i + 1].astype(cp.float32) - ref).max())
        worst = max(worst, err / max(float(cp.abs(ref).max()), 1e-30))
    return worst


def test_the_fused_forward_runs_in_parts_and_matches_one_sample_at_a_time(data, batches):
    x, w, b, res = data["x"], data["w"], data["b"], data["res"]
    y, _ = ops.conv_bias_act(x, w, b, GEOM, "relu", res, 0.5)
    assert runs(batches) == [3, 2]
    assert per_sample_error(y, lambda i: ops.conv_bias_act(
        x[i:i + 1], w, b, ONE, "relu", res[i:i + 1], 0.5)[0]) < 2e-3


def test_the_data_gradient_runs_in_parts_into_a_poisoned_output(data, batches):
    dz, w = data["dz"], data["w"]
    dx = ops.conv_backward_data(dz, w, GEOM, out=poisoned(GEOM.input_shape), beta=0.0)
    assert runs(batches) == [3, 2] and bool(cp.isfinite(dx).all())
    assert per_sample_error(dx, lambda i: ops.conv_backward_data(dz[i:i + 1], w, ONE)) < 2e-3


def test_the_filter_gradient_sums_its_parts(data, batches):
    x, dz = data["x"], data["dz"]
    dw = ops.conv_backward_filter(x, dz, GEOM, out=poisoned(GEOM.weight_shape), beta=0.0)
    assert runs(batches) == [3, 2]
    ref = sum(cp.asnumpy(ops.conv_backward_filter(x[i:i + 1], dz[i:i + 1], ONE))
              .astype(np.float64) for i in range(N))
    got = cp.asnumpy(dw).astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()


def test_the_bias_gradient_of_a_split_batch(data, batches):
    dz = data["dz"]
    db = ops.conv_backward_bias(dz, GEOM, out=poisoned((1,)), beta=0.0)
    # a split batch sends the bias gradient to convfuse's kernel, in one launch over all
    # N, whatever `bias_grad` says: no cuDNN call (the spy sees BackwardBias too)
    assert batches == []
    ref = sum(float(dz[i].astype(cp.float64).sum()) for i in range(N))
    assert abs(float(db[0]) - ref) <= 1e-2 * max(abs(ref), 1.0)


def test_a_torch_layer_on_a_split_batch_matches_torch(data):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import convfuse.torch as cft

    # 15 GiB of data live, and two 5 GiB outputs to come: the earlier tests' cached blocks
    # go back first, and the error is taken a sample (2 GiB in float32) at a time
    cp.get_default_memory_pool().free_all_blocks()
    x = torch.from_dlpack(data["x"])
    layer = cft.Conv2d(1, 1, 3, padding=1, activation="relu").cuda().half()
    with torch.no_grad():
        ref = torch.nn.functional.conv2d(x, layer.weight, layer.bias, padding=1).relu_()
        y = layer(x)
        err = max((y[i].float() - ref[i].float()).abs().max().item() for i in range(N))
        scale = max(ref[i].float().abs().max().item() for i in range(N))
    assert err <= 2e-3 * scale
