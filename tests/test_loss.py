"""CrossEntropyLoss on the CPU against an independent float64 oracle and finite differences."""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest

from convfuse import backend
from convfuse.errors import BackwardBeforeForwardError, DeviceMismatchError
from convfuse.loss import CrossEntropyLoss

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def oracle(logits, labels):
    """Row losses, correct flags and gradient in float64, one row at a time with exact sums.

    Shifts each row by its own label's logit (not the max): exp may then overflow for
    huge logits, so it falls back to the max shift only where it must.
    """
    x = np.asarray(logits, dtype=np.float64)
    n, c = x.shape
    losses, grad = [], np.zeros_like(x)
    for i in range(n):
        row, lab = [float(v) for v in x[i]], int(labels[i])
        shift = row[lab] if max(row) - row[lab] < 700 else max(row)
        total = math.fsum(math.exp(v - shift) for v in row)
        losses.append(math.log(total) + shift - row[lab])
        for j, v in enumerate(row):
            grad[i, j] = (math.exp(v - shift) / total - (j == lab)) / n
    first_max = [max(range(c), key=lambda j, r=x[i]: (r[j], -j)) for i in range(n)]
    correct = sum(int(first_max[i] == labels[i]) for i in range(n))
    return math.fsum(losses) / n, correct, grad


def make_batch(rng, n, c, dtype, scale=3.0):
    logits = (rng.standard_normal((n, c)) * scale).astype(dtype)
    labels = rng.integers(0, c, n)
    # make about half the rows confidently right, so correct is neither 0 nor n
    right = rng.random(n) < 0.5
    logits[right, labels[right]] = (np.abs(logits[right]).max(axis=1) + 2).astype(dtype)
    return logits, labels


def grad_tolerance(dtype):
    """The gradient is rounded once to its dtype; 16-bit types get one ulp of slack."""
    if np.dtype(dtype) in (np.float64, np.float32):
        return 1e-12 if dtype == np.float64 else 2e-6
    return float(ml_dtypes.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_loss_correct_and_gradient_match_float64_oracle(rng, dtype):
    logits, labels = make_batch(rng, 9, 7, dtype)
    loss_fn = CrossEntropyLoss()
    loss = loss_fn(logits, labels)
    want_loss, want_correct, want_grad = oracle(logits, labels)

    out_dtype = np.float64 if dtype == np.float64 else np.float32
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == out_dtype
    # 16-bit logits widen exactly and the loss is computed in float32, as for float32
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-12 if dtype == np.float64 else 2e-6)
    assert loss_fn.correct.shape == () and loss_fn.correct.dtype == np.int64
    assert int(loss_fn.correct) == want_correct and 0 < want_correct < 9

    grad = loss_fn.backward()
    assert grad.shape == logits.shape and grad.dtype == np.dtype(dtype)
    eps = grad_tolerance(dtype)
    np.testing.assert_allclose(grad.astype(np.float64), want_grad, rtol=eps, atol=eps / 9)


def test_gradient_matches_finite_differences(rng):
    logits, labels = make_batch(rng, 4, 5, np.float64, scale=1.0)
    loss_fn = CrossEntropyLoss()
    loss_fn(logits, labels)
    grad = loss_fn.backward()
    h = 1e-6
    fd = np.zeros_like(logits)
    for idx in np.ndindex(*logits.shape):
        plus, minus = logits.copy(), logits.copy()
        plus[idx] += h
        minus[idx] -= h
        fd[idx] = (float(loss_fn(plus, labels)) - float(loss_fn(minus, labels))) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(grad.sum(axis=1), 0.0, atol=1e-15)  # softmax sums to one


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_huge_logits_stay_finite(dtype):
    logits = np.array([[1e4, 0.0, -1e4], [1e4, 0.0, -1e4], [-1e4, -1e4, -1e4]], dtype=dtype)
    labels = np.array([0, 2, 1])
    loss_fn = CrossEntropyLoss()
    loss = float(loss_fn(logits, labels))
    grad = loss_fn.backward().astype(np.float64)
    # row 0 is certain and right (0), row 1 is 2e4 off, row 2 is uniform (log 3)
    np.testing.assert_allclose(loss, (0.0 + 2e4 + math.log(3)) / 3, rtol=1e-6)
    want = np.array([[0, 0, 0], [1, 0, -1], [1 / 3, -2 / 3, 1 / 3]]) / 3
    np.testing.assert_allclose(grad, want, atol=1e-3 if dtype == np.float16 else 1e-7)
    assert int(loss_fn.correct) == 1  # row 2 ties: the first maximum (0) is not label 1


def test_agrees_with_scipy_log_softmax(rng):
    special = pytest.importorskip("scipy.special")
    logits, labels = make_batch(rng, 6, 11, np.float64)
    want = -special.log_softmax(logits, axis=1)[np.arange(6), labels].mean()
    np.testing.assert_allclose(float(CrossEntropyLoss()(logits, labels)), want, rtol=1e-13)


@pytest.mark.parametrize("label_dtype", [np.int8, np.uint8, np.int32, np.int64, np.uint64])
def test_any_integer_label_dtype(rng, label_dtype):
    logits, labels = make_batch(rng, 5, 4, np.float64)
    want, _, _ = oracle(logits, labels)
    got = float(CrossEntropyLoss()(logits, labels.astype(label_dtype)))
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_inputs_are_not_modified(rng):
    logits, labels = make_batch(rng, 5, 3, np.float32)
    logits_before, labels_before = logits.copy(), labels.copy()
    loss_fn = CrossEntropyLoss()
    loss_fn(logits, labels)
    grad = loss_fn.backward()
    assert not np.shares_memory(grad, logits)
    np.testing.assert_array_equal(logits, logits_before)
    np.testing.assert_array_equal(labels, labels_before)


def test_backward_needs_a_forward_and_is_handed_out_once(rng):
    loss_fn = CrossEntropyLoss()
    assert loss_fn.correct is None and repr(loss_fn) == "CrossEntropyLoss()"
    with pytest.raises(BackwardBeforeForwardError, match="needs a forward"):
        loss_fn.backward()
    logits, labels = make_batch(rng, 3, 3, np.float32)
    loss_fn(logits, labels)
    loss_fn.backward()
    with pytest.raises(BackwardBeforeForwardError):
        loss_fn.backward()


@pytest.mark.parametrize(
    ("logits", "labels", "error", "match"),
    [
        (np.zeros((2, 3, 1), np.float32), np.zeros(2, np.int64), ValueError, r"2-D \(N, C\)"),
        (np.zeros(3, np.float32), np.zeros(3, np.int64), ValueError, "2-D"),
        (np.zeros((2, 3), np.float32), np.zeros((2, 1), np.int64), ValueError, r"1-D \(N,\)"),
        (np.zeros((2, 3), np.float32), np.zeros(2, np.float32), TypeError, "integer array"),
        (np.zeros((2, 3), np.float32), np.zeros(2, bool), TypeError, "integer array"),
        (np.zeros((2, 3), np.int64), np.zeros(2, np.int64), TypeError, "float array"),
        (np.zeros((2, 3), np.float32), np.zeros(3, np.int64), ValueError, "3 entries, .* 2 rows"),
        (np.zeros((0, 3), np.float32), np.zeros(0, np.int64), ValueError, "at least one row"),
        (np.zeros((2, 0), np.float32), np.zeros(2, np.int64), ValueError, "one class"),
        (np.zeros((3, 4), np.float32), np.array([0, 1, 4]), ValueError, r"\[0, 4\).* 4 at row 2"),
        (np.zeros((3, 4), np.float32), np.array([0, -1, 2]), ValueError, "got -1 at row 1"),
        ([[0.0, 1.0]], np.zeros(1, np.int64), TypeError, "NumPy or CuPy array"),
    ],
)
def test_bad_input_raises_before_computing(logits, labels, error, match):
    loss_fn = CrossEntropyLoss()
    with pytest.raises(error, match=match):
        loss_fn(logits, labels)
    assert loss_fn.correct is None


def test_mixing_numpy_and_cupy_raises(monkeypatch):
    class FakeDeviceArray:  # stands in for a CuPy array: no GPU is needed to test the check
        shape, dtype, ndim = (2,), np.dtype(np.int64), 1

    monkeypatch.setattr(backend, "is_cupy", lambda a: isinstance(a, FakeDeviceArray))
    with pytest.raises(DeviceMismatchError, match="cannot mix NumPy and CuPy"):
        CrossEntropyLoss()(np.zeros((2, 3), np.float32), FakeDeviceArray())


_INF = [
    ([[np.inf, 0.0, 0.0], [0.0, 1.0, 2.0]], [0, 1]),  # +inf at the label
    ([[np.inf, 0.0, 0.0], [0.0, 1.0, 2.0]], [1, 1]),
    ([[-np.inf, 0.0, 0.0], [0.0, 1.0, 2.0]], [0, 1]),  # -inf at the label: loss inf
    ([[-np.inf, -np.inf, -np.inf], [0.0, 1.0, 2.0]], [1, 1]),  # an all -inf row
    ([[np.inf, np.inf, 0.0], [0.0, 1.0, 2.0]], [1, 0]),
    ([[np.nan, 0.0, 0.0], [0.0, 1.0, 2.0]], [1, 1]),
]


@pytest.mark.parametrize(("logits", "labels"), _INF)
@pytest.mark.parametrize("strict", ["warnings", "seterr"])
def test_non_finite_logits_give_torchs_values_with_warnings_as_errors(logits, labels, strict):
    """IEEE semantics, as torch: with warnings as errors (or np.seterr(all='raise')) an inf
    or NaN logit gives torch's inf/NaN loss and gradient, raising nothing."""
    torch = pytest.importorskip("torch")
    x, y = np.array(logits), np.array(labels)
    t = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(t, torch.tensor(y))
    want.backward()
    loss_fn = CrossEntropyLoss()
    with warnings.catch_warnings(), np.errstate(all="raise" if strict == "seterr" else "warn"):
        warnings.simplefilter("error")
        loss = loss_fn(x, y)
        grad = loss_fn.backward()
    # NaN and inf where torch has them; finite values to rounding (torch's exp differs)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-14)
    np.testing.assert_allclose(grad, t.grad.numpy(), rtol=1e-14, atol=1e-16)
    assert np.array_equal(np.isnan(grad), np.isnan(t.grad.numpy()))
    assert int(loss_fn.correct) == int((t.detach().argmax(1) == torch.tensor(y)).sum())


# ---- ignore_index, against torch.nn.CrossEntropyLoss(ignore_index=) ----

def torch_reference(logits, labels, ignore_index, torch_dtype="float64"):
    """torch's loss, autograd gradient (as float64) and the correct count over kept rows,
    on the logits widened exactly to float64 (or in float32)."""
    torch = pytest.importorskip("torch")
    t = torch.tensor(np.asarray(logits, np.float64), dtype=getattr(torch, torch_dtype),
                     requires_grad=True)
    y = torch.tensor(np.asarray(labels, np.int64))
    loss = torch.nn.CrossEntropyLoss(ignore_index=ignore_index)(t, y)
    loss.backward()
    hits = (t.detach().argmax(1) == y) & (y != ignore_index)  # argmax: the first maximum
    return loss.item(), int(hits.sum()), t.grad.double().numpy()


#: case -> (ignore_index, rows given that label; None: every row)
IGNORE_CASES = {
    "none": (-100, []),
    "some": (-100, [1, 4, 5]),
    "all": (-100, None),
    "a class": (2, [0, 3, 7]),  # inside [0, C): class 2's rows are ignored, as in torch
    "custom negative": (-1, [2, 6]),
}


def ignore_batch(rng, dtype, case, label_dtype=np.int64):
    ignore_index, rows = IGNORE_CASES[case]
    logits, labels = make_batch(rng, 9, 7, dtype)
    if ignore_index == 2:
        labels[labels == 2] = 3  # only the chosen rows carry the class
    labels[slice(None) if rows is None else rows] = ignore_index
    return ignore_index, logits, labels.astype(label_dtype)


@pytest.mark.parametrize("label_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("case", list(IGNORE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ignore_index_matches_torch(rng, dtype, case, label_dtype):
    ignore_index, logits, labels = ignore_batch(rng, dtype, case, label_dtype)
    ignored = labels == ignore_index
    kept = int((~ignored).sum())
    loss_fn = CrossEntropyLoss(ignore_index=ignore_index)
    loss = loss_fn(logits, labels)
    grad = loss_fn.backward()
    want_loss, want_correct, want_grad = torch_reference(logits, labels, ignore_index)

    out_dtype = np.float64 if dtype == np.float64 else np.float32
    assert loss.shape == () and loss.dtype == out_dtype
    if kept == 0:  # torch's 0/0
        assert math.isnan(float(loss)) and math.isnan(want_loss)
    else:
        rtol = 1e-12 if dtype == np.float64 else 2e-6
        np.testing.assert_allclose(float(loss), want_loss, rtol=rtol)
    assert loss_fn.correct.dtype == np.int64 and int(loss_fn.correct) == want_correct
    assert grad.dtype == np.dtype(dtype) and grad.shape == logits.shape
    assert (grad[ignored] == 0).all() and (want_grad[ignored] == 0).all()
    eps = grad_tolerance(dtype)
    np.testing.assert_allclose(grad.astype(np.float64), want_grad, rtol=eps,
                               atol=eps / max(kept, 1))
    if dtype == np.float32:  # and against torch computing in float32 itself
        want32_loss, _, want32_grad = torch_reference(logits, labels, ignore_index, "float32")
        np.testing.assert_allclose(float(loss), want32_loss, rtol=2e-6)
        np.testing.assert_allclose(grad, want32_grad, rtol=2e-6, atol=2e-6 / max(kept, 1))


def test_ignored_rows_leave_the_denominator(rng):
    """The mean is over kept rows only: the same as the loss of the kept rows alone."""
    logits, labels = make_batch(rng, 8, 5, np.float64)
    padded = labels.copy()
    padded[[1, 6]] = -100
    loss_fn = CrossEntropyLoss()
    loss = float(loss_fn(logits, padded))
    grad = loss_fn.backward()
    keep = padded != -100
    alone = CrossEntropyLoss()
    np.testing.assert_allclose(loss, float(alone(logits[keep], labels[keep])), rtol=1e-14)
    np.testing.assert_allclose(grad[keep], alone.backward(), rtol=1e-14, atol=1e-17)
    assert (grad[~keep] == 0).all()
    assert int(loss_fn.correct) == int(alone.correct)


@pytest.mark.parametrize(("label_dtype", "ignore_index"),
                         [(np.int8, -100), (np.uint8, -100), (np.uint8, 3), (np.uint64, 3),
                          (np.uint64, -100), (np.int16, 2**40)])
def test_ignore_index_with_any_integer_label_dtype(rng, label_dtype, ignore_index):
    """Compared exactly: -100 or 2**40 never matches a uint8 (or int16) label, 3 does."""
    logits, labels = make_batch(rng, 6, 5, np.float64)
    labels[labels == 3] = 4
    if np.can_cast(np.min_scalar_type(ignore_index), label_dtype):
        labels[[0, 2]] = ignore_index
    loss_fn = CrossEntropyLoss(ignore_index=ignore_index)
    loss = float(loss_fn(logits, labels.astype(label_dtype)))
    want_loss, want_correct, want_grad = torch_reference(logits, labels, ignore_index)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    assert int(loss_fn.correct) == want_correct
    np.testing.assert_allclose(loss_fn.backward(), want_grad, rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize("strict", [False, True])
def test_ignored_rows_with_non_finite_logits_give_zero_gradient_rows(strict):
    """An ignored row's inf/NaN logits touch nothing: the loss is torch's, and its gradient
    row is zero (torch's log_softmax backward leaves NaN there), warnings as errors or not."""
    torch = pytest.importorskip("torch")
    x = np.array([[np.inf, 0.0, 0.0], [0.0, 1.0, 2.0], [np.nan, 1.0, -np.inf], [3.0, 1.0, 0.5]])
    y = np.array([-100, 2, -100, 1])
    t = torch.tensor(x, requires_grad=True)
    want = torch.nn.functional.cross_entropy(t, torch.tensor(y))
    want.backward()
    loss_fn = CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error" if strict else "ignore")
        loss = loss_fn(x, y)
        grad = loss_fn.backward()
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-14)
    assert (grad[[0, 2]] == 0).all()
    assert np.isnan(t.grad.numpy()[[0, 2]]).all()  # torch's, which convfuse does not follow
    np.testing.assert_allclose(grad[[1, 3]], t.grad.numpy()[[1, 3]], rtol=1e-14, atol=1e-17)
    assert int(loss_fn.correct) == 1  # row 1 (argmax 2); row 0's inf argmax is not counted


def test_all_ignored_gives_nan_loss_and_zero_gradient_without_a_warning():
    loss_fn = CrossEntropyLoss(ignore_index=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = loss_fn(np.ones((3, 4), np.float32), np.full(3, 7))
    assert loss.dtype == np.float32 and math.isnan(float(loss))
    assert (loss_fn.backward() == 0).all() and int(loss_fn.correct) == 0


def test_other_out_of_range_labels_still_raise():
    loss_fn = CrossEntropyLoss(ignore_index=-1)
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss: labels must be in \[0, 4\) .*"
                                         r"ignore_index=-1\); got -100 at row 2"):
        loss_fn(np.zeros((3, 4), np.float32), np.array([-1, 1, -100]))
    with pytest.raises(ValueError, match="got 4 at row 1"):
        CrossEntropyLoss()(np.zeros((3, 4), np.float32), np.array([-100, 4, 0]))
    assert loss_fn.correct is None


@pytest.mark.parametrize("bad", [2.0, -100.0, True, "-100", None, np.float64(-1), [-100]])
def test_ignore_index_must_be_an_int(bad):
    with pytest.raises(TypeError, match=r"^CrossEntropyLoss: ignore_index must be an int"):
        CrossEntropyLoss(ignore_index=bad)


def test_ignore_index_is_keyword_only_and_shown_in_repr():
    with pytest.raises(TypeError):
        CrossEntropyLoss(-100)  # torch's first positional argument is `weight`
    assert repr(CrossEntropyLoss()) == "CrossEntropyLoss()"
    assert repr(CrossEntropyLoss(ignore_index=-100)) == "CrossEntropyLoss()"
    loss_fn = CrossEntropyLoss(ignore_index=np.int32(-1))  # NumPy ints are accepted
    assert loss_fn.ignore_index == -1 and type(loss_fn.ignore_index) is int
    assert repr(loss_fn) == "CrossEntropyLoss(ignore_index=-1)"
    assert CrossEntropyLoss().ignore_index == -100
    assert repr(CrossEntropyLoss(ignore_index=np.uint8(3))) == "CrossEntropyLoss(ignore_index=3)"
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss: ignore_index must fit in int64"):
        CrossEntropyLoss(ignore_index=2**63)
    with pytest.raises(AttributeError):
        loss_fn.ignore_index = 5  # fixed at construction
