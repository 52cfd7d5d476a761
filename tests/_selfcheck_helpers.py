"""Shared by the selfcheck test files: test_selfcheck_failures.py, test_selfcheck_install.py."""

from __future__ import annotations

import pytest

from convfuse.selfcheck import reference_checks


@pytest.fixture
def quick(monkeypatch):
    """Selfcheck without the reference-engine checks (for tests about other parts)."""
    monkeypatch.setattr(reference_checks, "REFERENCE_CHECKS", ())
