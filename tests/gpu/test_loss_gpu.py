"""CrossEntropyLoss and metrics.Mean on a GPU: against the CPU path (itself checked against
a float64 oracle and torch in tests/test_loss.py), ignore_index, bad labels, and inside
CUDA stream capture."""

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


def run_both(logits, labels, label_dtype=np.int64, ignore_index=-100):
    cpu = CrossEntropyLoss(ignore_index=ignore_index)
    want = cpu(logits, labels), cpu.correct, cpu.backward()
    gpu = CrossEntropyLoss(ignore_index=ignore_index)
    n, c = logits.shape
    size = np.dtype(logits.dtype).itemsize
    poison_pool(n * c * size, (n + 2) * 8, (n + 1) * 4)
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


#: case -> (ignore_index, fraction of rows given that label)
IGNORE_CASES = {
    "none": (-100, 0.0),
    "some": (-100, 0.3),
    "all": (-100, 1.0),
    "a class": (2, 0.2),  # inside [0, C): that class's rows are ignored
    "custom negative": (-1, 0.5),
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_index_matches_cpu(rng, dtype):
    """xent_kept counts the kept rows on the device; the rows and mean kernels divide by
    that count: the mean over kept rows, zero gradient rows for ignored ones, NaN and an
    all-zero gradient when every row is ignored (torch's values; the CPU path is checked
    against torch). One test per dtype over the cases, label dtypes and shapes: the
    acceptance plan counts tests, and a grid of 120 pushed a chunk out of lease 1."""
    for case in IGNORE_CASES:
        for label_dtype in (np.int32, np.int64):
            for shape in ((9, 7), (1, 3), (3000, 1000)):
                _ignore_case(rng, dtype, case, label_dtype, shape)


def _ignore_case(rng, dtype, case, label_dtype, shape):
    ignore_index, fraction = IGNORE_CASES[case]
    logits, labels = make_batch(rng, *shape, dtype)
    if ignore_index == 2:
        labels[labels == 2] = 0
    ignored = rng.random(shape[0]) < fraction if fraction < 1 else np.ones(shape[0], bool)
    labels[ignored] = ignore_index
    (want_loss, want_correct, want_grad), (loss, correct, grad) = run_both(
        logits, labels, label_dtype, ignore_index
    )
    kept = int((~ignored).sum())
    assert loss.shape == () and loss.dtype == want_loss.dtype
    if kept == 0:
        assert math.isnan(float(loss)) and math.isnan(float(want_loss))
    else:
        rtol = 1e-12 if dtype == np.float64 else 1e-5
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=rtol)
    assert int(correct) == int(want_correct)
    host = cp.asnumpy(grad).astype(np.float64)
    assert np.isfinite(host).all() and (host[ignored] == 0).all()
    rtol, atol = grad_tol(dtype, max(kept, 1))
    np.testing.assert_allclose(host, want_grad.astype(np.float64), rtol=rtol, atol=atol)


def test_an_out_of_range_label_is_a_kept_row(rng):
    """A label outside [0, C) that is not ignore_index makes the mean NaN and its gradient
    row zero, and counts in the denominator: the other rows' gradient is divided by the
    kept rows, that one included."""
    logits, labels = make_batch(rng, 8, 5, np.float32)
    bad = labels.copy()
    bad[[1, 6]] = -100  # ignored
    bad[3] = 5          # out of range: kept
    loss_fn = CrossEntropyLoss()
    poison_pool(8 * 5 * 4, 10 * 8)
    loss = loss_fn(cp.asarray(logits), cp.asarray(bad))
    grad = cp.asnumpy(loss_fn.backward())
    assert math.isnan(float(loss))
    assert (grad[[1, 3, 6]] == 0).all()
    cpu = CrossEntropyLoss()
    stand_in = bad.copy()
    stand_in[3] = labels[3]  # a valid label: the same 6 kept rows
    cpu(logits, stand_in)
    want = cpu.backward()
    ok = [0, 2, 4, 5, 7]
    rtol, atol = grad_tol(np.float32, 6)
    np.testing.assert_allclose(grad[ok], want[ok], rtol=rtol, atol=atol)
    right = np.argmax(logits, axis=1) == labels
    assert int(loss_fn.correct) == int(right[ok].sum())


def test_ignored_rows_with_non_finite_logits_are_not_read():
    logits = np.array([[np.inf, 0.0, 0.0], [0.0, 1.0, 2.0], [np.nan, 1.0, -np.inf],
                       [3.0, 1.0, 0.5]], np.float32)
    labels = np.array([-100, 2, -100, 1])
    with np.errstate(all="ignore"):  # the CPU reference's inf - inf
        (want_loss, want_correct, want_grad), (loss, correct, grad) = run_both(logits, labels)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert int(correct) == int(want_correct) == 1
    host = cp.asnumpy(grad)
    assert (host[[0, 2]] == 0).all()
    np.testing.assert_allclose(host, want_grad, rtol=1e-6, atol=1e-8)


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


def test_ignored_rows_counted_on_the_device_in_each_graph_replay(rng):
    """The kept count is the device's, not a host number baked into the captured graph:
    replays over batches with no, some and every row ignored each divide by their own."""
    n, c = 40, 6
    x = cp.asarray(make_batch(rng, n, c, np.float32)[0])
    y = cp.asarray(make_batch(rng, n, c, np.float32)[1])
    loss_fn = CrossEntropyLoss(ignore_index=-1)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        loss_fn(x, y)  # warm-up: compiles the kernels
        loss_fn.backward()
        stream.synchronize()
        stream.begin_capture()
        loss = loss_fn(x, y)
        grad = loss_fn.backward()
        correct = loss_fn.correct
        graph = stream.end_capture()
        for fraction in (0.0, 0.4, 1.0, 0.1):
            logits, labels = make_batch(rng, n, c, np.float32)
            labels[rng.random(n) < fraction if fraction < 1 else slice(None)] = -1
            x[...] = cp.asarray(logits)
            y[...] = cp.asarray(labels)
            graph.launch(stream)
            stream.synchronize()
            cpu = CrossEntropyLoss(ignore_index=-1)
            want = float(cpu(logits, labels))
            if math.isnan(want):
                assert fraction == 1.0 and math.isnan(float(loss))
            else:
                np.testing.assert_allclose(float(loss), want, rtol=1e-5)
            assert int(correct) == int(cpu.correct)
            np.testing.assert_allclose(cp.asnumpy(grad), cpu.backward(), rtol=1e-5, atol=1e-8)


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
