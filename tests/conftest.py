"""Shared fixtures. GPU tests (marked `gpu`) skip with the reason no device is usable."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.backend import gpu_unavailable_reason


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)
