"""The type checker configured in pyproject.toml ([tool.mypy]) reports nothing over the
whole package, at the configured Python and at the oldest one convfuse supports (3.10).

At 3.10 mypy reports one false positive, which is allowed and nothing else: a starred
item in a *parenthesised* subscript tuple, x[(a, *b)], which Python 3.10 accepts (only the
unparenthesised x[a, *b] is new in 3.11; tests/test_py310_syntax.py checks that with 3.10's
grammar). See the comment in pyproject.toml.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_py310_syntax import unparenthesized_starred_subscripts

ROOT = Path(__file__).resolve().parents[1]
STAR_UNPACK = "Star unpack syntax: requires Python 3.11 or newer"


def _mypy(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy", reason="mypy is in the `test` extra: pip install -e '.[test]'")
    return subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_mypy_is_clean_over_the_whole_package():
    proc = _mypy()
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_at_python_310_reports_only_its_parenthesised_star_false_positive():
    proc = _mypy("--python-version", "3.10")
    reports = [line for line in proc.stdout.splitlines() if ": error: " in line]
    others = [line for line in reports if STAR_UNPACK not in line]
    assert others == [] and (reports or proc.returncode == 0), proc.stdout + proc.stderr
    # Each allowed report sits on a subscript whose starred tuple is parenthesised.
    for line in reports:
        path, lineno = re.match(r"(.+?):(\d+):", line).groups()
        bare = unparenthesized_starred_subscripts((ROOT / path).read_text())
        assert int(lineno) not in bare, line
