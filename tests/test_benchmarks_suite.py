"""The test-suite goal's before/after (benchmarks/bench/suite.py): the two trees it builds
from this clone, and how it times and reads one pytest run."""

from __future__ import annotations

import subprocess

import pytest

from tests._benchmarks_helpers import BENCH, suite

ROOT = BENCH.parent


def _has_baseline() -> bool:
    proc = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e",
                           f"{suite.BASELINE}^{{commit}}"], capture_output=True)
    return proc.returncode == 0


@pytest.mark.skipif(not _has_baseline(), reason=f"this clone lacks {suite.BASELINE}")
def test_prepare_builds_the_baseline_tree_and_this_checkout_with_its_tests(tmp_path):
    old, new = suite.prepare(ROOT, tmp_path)
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only",
                             suite.BASELINE, "tests"], capture_output=True, text=True,
                            check=True).stdout.split()
    assert sorted(str(p.relative_to(old)) for p in (old / "tests").rglob("*")
                  if p.is_file()) == sorted(listed)
    assert sorted(p.name for p in (new / "tests").rglob("*") if p.is_file()) == sorted(
        p.name for p in (old / "tests").rglob("*") if p.is_file())
    # this checkout's code, as it is now, beside the baseline's own
    assert (new / "benchmarks/bench/suite.py").read_bytes() == (
        ROOT / "benchmarks/bench/suite.py").read_bytes()
    assert not (old / "benchmarks/bench/suite.py").exists()
    for ext in suite._extensions(ROOT):
        assert (old / "convfuse" / ext.name).is_file() and (new / "convfuse" / ext.name).is_file()


def test_run_tests_times_the_trees_own_package_and_names_failures(tmp_path):
    (tmp_path / "convfuse").mkdir()
    (tmp_path / "convfuse" / "__init__.py").write_text("WHERE = 'tree'\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import convfuse\n\n\ndef test_own():\n    assert convfuse.WHERE == 'tree'\n\n\n"
        "def test_broken():\n    assert False\n")
    run = suite.run_tests(tmp_path)
    assert run["wall_s"] > 0 and run["returncode"] == 1
    assert run["failed"] == ["tests/test_x.py::test_broken"]
    assert "1 failed, 1 passed" in run["summary"]
