"""Central finite differences: the oracle for every backward in the test suite."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def numeric_grad(
    loss: Callable[[], float], arr: np.ndarray, eps: float = 1e-6, max_entries: int = 40,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """d loss / d arr at up to `max_entries` positions; returns (flat indices, gradients).

    `loss` reads `arr` afresh at each call; entries are perturbed in place and restored.
    """
    rng = rng or np.random.default_rng(0)
    flat = arr.reshape(-1)
    n = flat.size
    idx = np.arange(n) if n <= max_entries else rng.choice(n, max_entries, replace=False)
    grads = np.empty(len(idx))
    for j, i in enumerate(idx):
        keep = flat[i]
        flat[i] = keep + eps
        up = loss()
        flat[i] = keep - eps
        down = loss()
        flat[i] = keep
        grads[j] = (up - down) / (2 * eps)
    return idx, grads


def assert_grad_close(
    analytic: np.ndarray, loss: Callable[[], float], arr: np.ndarray, rtol: float = 1e-6,
    atol: float = 1e-8, **kwargs,
) -> None:
    idx, numeric = numeric_grad(loss, arr, **kwargs)
    np.testing.assert_allclose(analytic.reshape(-1)[idx], numeric, rtol=rtol, atol=atol)
