"""Shared fixtures. GPU tests (marked `gpu`) skip with the reason no device is usable."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse.backend import gpu_unavailable_reason

#: A test whose own timeout marker allows more than this compiles on a cold cache
#: (Inductor, dynamo): tens of seconds.
COLD_COMPILE_S = 60


def cold_compiles_last(items: list) -> None:
    """Move the tests with a timeout marker above COLD_COMPILE_S to the end, the rest in
    order: a compile that outruns its timeout ends the pytest process (pytest-timeout's
    thread method), and in the GPU acceptance run's chunks (scripts/acceptance_plan.py)
    nothing may come after it, not even the quick tests of its own file."""
    def cold(item) -> bool:
        mark = item.get_closest_marker("timeout")
        return bool(mark and mark.args and float(mark.args[0]) > COLD_COMPILE_S)

    items[:] = sorted(items, key=cold)  # stable


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        cold_compiles_last(items)
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _register_hypothesis_profiles() -> None:
    """HYPOTHESIS_PROFILE=ci (the default: bounded and derandomized) or long (thousands of
    random examples); see docs/VERIFYING.md. Neither writes an example database into the
    checkout: a failure prints the seed blob (@reproduce_failure) instead."""
    import os

    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # hypothesis is a test extra; only the fuzz tests need it
        return
    common = {"deadline": None, "print_blob": True, "database": None,
              "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("ci", max_examples=300, derandomize=True, **common)
    settings.register_profile("long", max_examples=5000, **common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_register_hypothesis_profiles()
