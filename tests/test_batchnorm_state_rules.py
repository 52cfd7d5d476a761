"""Native BatchNorm's state rules against torch.nn as the oracle: which statistics a call
uses (torch decides by the buffers, not the flag), a count of None, a count that cannot be
written (refused before the statistics are), and a reset between forward and backward."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse.errors import SavedTensorModifiedError

torch = pytest.importorskip("torch")


def _pair(**kw):
    rng = np.random.default_rng(0)
    ours = cf.BatchNorm2d(3, dtype="float64", device="cpu", **kw)
    theirs = torch.nn.BatchNorm2d(3, **kw).double()
    if ours.running_mean is not None:
        mean, var = rng.standard_normal(3), rng.uniform(0.5, 2.0, 3)
        ours.running_mean[...], ours.running_var[...] = mean, var
        theirs.running_mean.copy_(torch.tensor(mean))
        theirs.running_var.copy_(torch.tensor(var))
    return ours, theirs, rng.standard_normal((4, 3, 2, 2))


def _same(ours, theirs, x):
    np.testing.assert_allclose(ours(x), theirs(torch.tensor(x)).detach().numpy(), rtol=1e-12,
                               atol=1e-14)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_allclose(a, b.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("training", [True, False])
def test_track_running_stats_turned_off_after_construction_as_torch(training):
    """torch.nn keeps using the running statistics in eval when the flag is turned off
    with the buffers still there (and updates none in training)."""
    ours, theirs, x = _pair()
    for m in (ours, theirs):
        m.train(training)
        m.track_running_stats = False
    _same(ours, theirs, x)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_a_count_of_none_counts_nothing_as_torch(momentum):
    """torch.nn skips a None num_batches_tracked; with momentum=None its factor is then 0."""
    ours, theirs, x = _pair(momentum=momentum)
    ours.num_batches_tracked = None
    theirs.num_batches_tracked = None
    _same(ours, theirs, x)


@pytest.mark.parametrize("count", [np.zeros((), bool), np.zeros(1, np.int64),
                                   np.broadcast_to(np.zeros((), np.int64), ())],
                         ids=["bool", "1-d", "read-only"])
def test_a_count_that_cannot_be_counted_is_refused_before_the_statistics(count):
    ours, _, x = _pair()
    ours.num_batches_tracked = count
    mean = ours.running_mean.copy()
    with pytest.raises(TypeError, match=r"^BatchNorm2d: num_batches_tracked must be a "
                                        r"writable 0-d integer array or None"):
        ours(x)
    np.testing.assert_array_equal(ours.running_mean, mean)


def test_reset_parameters_between_forward_and_backward_is_detected():
    """The backward would differentiate with the new weight: refused, as torch.nn refuses
    a saved tensor modified in place."""
    ours, _, x = _pair()
    ours.weight.data[...] = [2.0, 3.0, 4.0]
    ours(x)
    ours.reset_parameters()
    with pytest.raises(SavedTensorModifiedError):
        ours.backward(np.ones_like(x))


def test_num_features_takes_numpy_ints_and_refuses_other_types():
    assert cf.BatchNorm2d(np.int64(3)).num_features == 3
    with pytest.raises(TypeError, match=r"^BatchNorm2d: num_features must be a positive int, "
                                        r"got float 3.0"):
        cf.BatchNorm2d(3.0)
    with pytest.raises(ValueError, match=r"^BatchNorm1d: num_features must be a positive int"):
        cf.BatchNorm1d(0)
