"""CrossEntropyLoss and metrics.Mean on a GPU: against the CPU path (itself checked against
a float64 oracle in tests/test_loss.py), bad labels, and inside CUDA stream capture."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from convfuse import metrics
from convfuse.errors import DeviceMismatchError
from convfuse.loss import CrossEntropyLoss

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def poison_pool(*nbytes):
    """Leave NaN-filled (all-ones) blocks of these sizes in CuPy's pool, so buffers the loss
    allocates next most likely start as NaN and an unwritten element cannot pass."""
    junk = [cp.full(n, 0xFF, dtype=np.uint8) for n in nbytes for _ in range(3)]
    cp.cuda.Device().synchronize()
    del junk


def make_batch(rng, n, c, dtype):
    logits = (rng.standard_normal((n, c)) * 3).astype(dtype)
    labels = rng.integers(0, c, n)
    right = rng.random(n) < 0.5
    logits[right, labels[right]] = (np.abs(logits[right]).max(axis=1) + 2).astype(dtype)
    return logits, labels


def grad_tol(dtype, n):
    eps = {np.dtype(np.float64): 1e-13, np.dtype(np.float32): 1e-6}.get(np.dtype(dtype))
    eps = eps if eps is not None else float(ml_dtypes.finfo(dtype).eps)
    return eps, eps / n


def run_both(logits, labels, label_dtype=np.int64):
    cpu = CrossEntropyLoss()
    want = cpu(logits, labels), cpu.correct, cpu.backward()
    gpu = CrossEntropyLoss()
    n, c = logits.shape
    size = np.dtype(logits.dtype).itemsize
    poison_pool(n * c * size, (n + 1) * 8, (n + 1) * 4)
    loss = gpu(cp.asarray(logits), cp.asarray(labels.astype(label_dtype)))
    got = loss, gpu.correct, gpu.backward()
    return want, got


@pytest.mark.parametrize("shape", [(9, 7), (1, 1), (33, 2), (3000, 1000), (5, 4097)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matches_cpu(rng, dtype, shape):
    logits, labels = make_batch(rng, *shape, dtype)
    (want_loss, want_correct, want_grad), (loss, correct, grad) = run_both(logits, labels)
    assert isinstance(loss, cp.ndarray) and loss.shape == () and loss.dtype == want_loss.dtype
    assert correct.shape == () and correct.dtype == np.int64
    rtol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=rtol)
    assert int(correct) == int(want_correct)
    assert grad.dtype == np.dtype(dtype) and grad.shape == shape
    host = cp.asnumpy(grad).astype(np.float64)
    assert np.isfinite(host).all()
    rtol, atol = grad_tol(dtype, shape[0])
    np.testing.assert_allclose(host, want_grad.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64, np.uint8])
def test_label_dtypes(rng, label_dtype):
    logits, labels = make_batch(rng, 40, 10, np.float32)
    (want_loss, want_correct, _), (loss, correct, _) = run_both(logits, labels, label_dtype)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert int(correct) == int(want_correct)


def test_out_of_range_label_gives_nan_loss_and_zero_gradient_row(rng):
    logits, labels = make_batch(rng, 6, 5, np.float32)
    bad = labels.copy()
    bad[2], bad[4] = 5, -1
    loss_fn = CrossEntropyLoss()
    poison_pool(6 * 5 * 4)
    loss = loss_fn(cp.asarray(logits), cp.asarray(bad))
    grad = cp.asnumpy(loss_fn.backward())
    assert math.isnan(float(loss))
    assert (grad[[2, 4]] == 0).all()
    cpu = CrossEntropyLoss()
    cpu(logits, labels)
    want = cpu.backward()  # the other rows: the same (softmax - onehot) / N, N counting all
    ok = [0, 1, 3, 5]
    np.testing.assert_allclose(grad[ok], want[ok], rtol=1e-6, atol=1e-8)
    right = np.argmax(logits, axis=1) == labels
    assert int(loss_fn.correct) == int(right[ok].sum())


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_subnormal_logits_pick_numpys_argmax(dtype):
    """Note [argmax compares keys] (loss.cu): under CuPy's -ftz=true a float compare reads
    1e-40 as 0; the correct count follows numpy.argmax on subnormal logits all the same.
    Each row's label is numpy's argmax, lanes apart (columns 0 and 33: two lanes' maxima
    meet in the butterfly) and within one lane."""
    rows = [[0.0, 1e-40], [-1e-40, 0.0], [1e-41, 3e-39, 2e-39], [-0.0, 0.0, -1e-40]]
    width = 40
    logits = np.full((len(rows) * 2, width), -1.0, np.float64)
    for i, row in enumerate(rows):
        logits[2 * i, :len(row)] = row  # within lanes 0..2
        logits[2 * i + 1, [0, 33, 34][:len(row)]] = row  # lanes 0, 1 and 2 (33 = lane 1)
    logits = logits.astype(dtype)
    labels = np.argmax(logits.astype(np.float64), axis=1)
    assert labels[0] == 1 and labels[1] == 33  # the case: a subnormal beats 0
    loss_fn = CrossEntropyLoss()
    loss_fn(cp.asarray(logits), cp.asarray(labels))
    assert int(loss_fn.correct) == len(labels)


def test_huge_logits_stay_finite():
    logits = np.array([[1e4, 0.0, -1e4], [1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]], np.float32)
    loss_fn = CrossEntropyLoss()
    loss = float(loss_fn(cp.asarray(logits), cp.asarray(np.array([0, 2, 1]))))
    np.testing.assert_allclose(loss, (2e4 + math.log(3)) / 3, rtol=1e-6)
    assert np.isfinite(cp.asnumpy(loss_fn.backward())).all()


def test_inputs_unchanged_and_results_reproducible(rng):
    logits, labels = make_batch(rng, 64, 33, np.float16)
    x, y = cp.asarray(logits), cp.asarray(labels)
    loss_fn = CrossEntropyLoss()
    first = loss_fn(x, y)
    g1 = loss_fn.backward()
    second = loss_fn(x, y)
    g2 = loss_fn.backward()
    assert float(first) == float(second)  # bit-identical: no atomics
    cp.testing.assert_array_equal(g1, g2)
    cp.testing.assert_array_equal(x, cp.asarray(logits))
    cp.testing.assert_array_equal(y, cp.asarray(labels))


def test_mixing_numpy_and_cupy_raises():
    with pytest.raises(DeviceMismatchError):
        CrossEntropyLoss()(cp.zeros((2, 3), np.float32), np.zeros(2, np.int64))


def test_loss_and_metrics_inside_stream_capture(rng):
    n, c = 32, 10
    batches = [make_batch(rng, n, c, np.float32) for _ in range(4)]
    x = cp.asarray(batches[0][0])
    y = cp.asarray(batches[0][1])
    loss_fn, loss_mean, acc = CrossEntropyLoss(), metrics.Mean(), metrics.Mean()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        # warm-up: compiles the kernels and creates the accumulators' buffers
        loss_mean.add(loss_fn(x, y))
        acc.add(loss_fn.correct, count=n)
        loss_fn.backward()
        stream.synchronize()
        loss_mean.reset()
        acc.reset()
        stream.begin_capture()
        loss = loss_fn(x, y)
        grad = loss_fn.backward()
        loss_mean.add(loss)
        acc.add(loss_fn.correct, count=n)
        graph = stream.end_capture()
        losses, rights = [], 0
        for logits, labels in batches[1:]:
            x[...] = cp.asarray(logits)
            y[...] = cp.asarray(labels)
            graph.launch(stream)
            stream.synchronize()
            cpu = CrossEntropyLoss()
            losses.append(float(cpu(logits, labels)))
            rights += int(cpu.correct)
            np.testing.assert_allclose(float(loss), losses[-1], rtol=1e-5)
            np.testing.assert_allclose(cp.asnumpy(grad), cpu.backward(), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(loss_mean.compute(), np.mean(losses), rtol=1e-5)
    assert acc.compute() == rights / (n * 3)


def test_mean_on_the_gpu(rng):
    acc = metrics.Mean()
    acc.add(cp.asarray(1.5, np.float32))
    acc.add(cp.asarray(7, np.int64), count=4)
    acc.add(2.0)  # host numbers become kernel arguments
    assert acc.device == "cuda"
    assert acc.compute() == (1.5 + 7 + 2.0) / 6
    with pytest.raises(DeviceMismatchError):
        acc.add(np.asarray(1.0))
    acc.reset()
    acc.add(cp.asarray(3.0, np.float16))
    assert float(acc) == 3.0
