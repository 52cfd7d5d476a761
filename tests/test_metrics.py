"""metrics.Mean on the CPU: sums 0-d arrays in float64, reads once, resets in place."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from convfuse import backend, metrics
from convfuse.errors import DeviceMismatchError
from convfuse.loss import CrossEntropyLoss


def test_mean_of_values_and_weighted_counts():
    acc = metrics.Mean()
    assert acc.device is None
    acc.add(np.asarray(2.0, np.float32))
    acc.add(np.asarray(3.5, np.float64), count=3)
    acc.add(1)  # a host number
    acc.add(np.float32(0.25), count=0)
    assert acc.device == "cpu" and repr(acc) == "Mean(device='cpu')"
    assert acc.compute() == (2.0 + 3.5 + 1 + 0.25) / (1 + 3 + 1 + 0)
    assert float(acc) == acc.compute()


def test_totals_are_float64_whatever_the_values():
    acc = metrics.Mean()
    acc.add(np.asarray(1e8, np.float32))
    acc.add(np.asarray(1.0, np.float32))  # lost in a float32 sum: 1e8 + 1 rounds to 1e8
    acc.add(np.asarray(2.0, ml_dtypes.bfloat16))
    acc.add(np.asarray(2**40, np.int64))
    assert acc.compute() == (1e8 + 1 + 2 + 2**40) / 4


def test_accuracy_over_batches_matches_numpy(rng):
    loss_fn, acc, losses = CrossEntropyLoss(), metrics.Accumulator(), metrics.Mean()
    all_logits, all_labels = [], []
    for n in (5, 7, 3):
        logits = rng.standard_normal((n, 4)).astype(np.float32)
        labels = rng.integers(0, 4, n)
        loss = loss_fn(logits, labels)
        losses.add(loss * n, count=n)
        acc.add(loss_fn.correct, count=n)
        all_logits.append(logits)
        all_labels.append(labels)
    logits, labels = np.concatenate(all_logits), np.concatenate(all_labels)
    want_acc = np.mean(np.argmax(logits, axis=1) == labels)
    assert acc.compute() == pytest.approx(want_acc, abs=1e-15)
    shifted = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    rows = -(shifted[np.arange(15), labels] - np.log(np.exp(shifted).sum(axis=1)))
    assert losses.compute() == pytest.approx(rows.mean(), rel=1e-6)


def test_reset_zeroes_in_place_and_values_are_never_aliased():
    acc = metrics.Mean()
    value = np.asarray(4.0)
    acc.add(value, count=2)
    buffer = acc._buffer
    acc.reset()
    # a captured CUDA graph keeps adding into the buffer it recorded, so reset must not
    # replace it
    assert acc._buffer is buffer
    with pytest.raises(ValueError, match="sum to 0"):
        acc.compute()
    acc.add(value)
    acc.add(value)
    assert acc.compute() == 4.0 and value == 4.0  # the first value was copied, not kept


def test_compute_before_anything_was_added():
    with pytest.raises(ValueError, match="nothing was added"):
        metrics.Mean().compute()


@pytest.mark.parametrize(
    ("value", "count", "error", "match"),
    [
        (np.zeros(2), 1, ValueError, r"0-d .* got shape \(2,\)"),
        (np.zeros((1, 1)), 1, ValueError, "0-d"),
        (True, 1, TypeError, "bool"),
        (np.bool_(True), 1, TypeError, "bool"),
        ("1.0", 1, TypeError, "NumPy or CuPy array"),
        (np.asarray(1 + 2j), 1, TypeError, "real number"),
        (np.asarray(1.0), -1, ValueError, "count must be >= 0"),
        (np.asarray(1.0), 1.0, TypeError, "count must be an int"),
        (np.asarray(1.0), True, TypeError, "count must be an int"),
    ],
)
def test_bad_values_and_counts(value, count, error, match):
    acc = metrics.Mean()
    with pytest.raises(error, match=match) as got:
        acc.add(value, count)
    assert str(got.value).startswith("Mean.add: ")
    assert acc.device is None


def test_mixing_devices_raises(monkeypatch):
    class FakeDeviceArray:  # stands in for a CuPy 0-d array; no GPU needed for the check
        shape, ndim, dtype = (), 0, np.dtype(np.float32)

    monkeypatch.setattr(backend, "is_cupy", lambda a: isinstance(a, FakeDeviceArray))
    acc = metrics.Mean()
    acc.add(np.asarray(1.0))
    with pytest.raises(DeviceMismatchError):
        acc.add(FakeDeviceArray())
    assert acc.compute() == 1.0


def test_a_count_or_value_too_large_for_float64_adds_nothing():
    """The total went up before the count's conversion failed (an unlabelled
    OverflowError): both are checked first now."""
    m = metrics.Mean()
    m.add(1.0, 1)
    with pytest.raises(ValueError, match=r"^Mean.add: count is too large for a float64"):
        m.add(5.0, 10**400)
    with pytest.raises(ValueError, match=r"^Mean.add: value is too large for a float64"):
        m.add(10**400)
    assert m.compute() == 1.0
