"""Shared by the tests/test_benchmarks*.py files: where benchmarks/ and its script are, and
the script's `bench` package, imported with benchmarks/ put on sys.path (which also lets a
test import fused_vs_unfused)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "fused_vs_unfused.py"
sys.path.insert(0, str(BENCH))

from bench import biasgrad, cases, checks, engine, peaks, roofline, timing  # noqa: E402

__all__ = ["BENCH", "SCRIPT", "biasgrad", "cases", "checks", "engine", "peaks", "roofline",
           "timing"]
