"""Repository hygiene that CI must keep true: the README's commands, lint, layout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_block(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"<!-- {marker} -->")
    end = text.index(f"<!-- /{marker} -->")
    block = text[start:end].split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip()


def test_ci_runs_the_readme_test_command_verbatim():
    command = readme_block("test-command")
    assert "pytest" in command and "--cov=convfuse" in command
    script = (ROOT / ".ci" / "run").read_text()
    assert "test-command" in script  # .ci/run reads the command from the README markers
    extracted = subprocess.run(
        ["bash", "-c", script.split("if [ -z")[0].split("cd \"$(dirname \"$0\")/..\"")[1]
         + '\nprintf "%s" "$cmd"'],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert extracted == command


def test_layout_the_design_asks_for():
    for name in ("setup.py", "pyproject.toml", "csrc", "convfuse", "tests", "benchmarks",
                 "README.md", ".ci/run", "examples/train_digits.py"):
        assert (ROOT / name).exists(), name


RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.skipif(not RUFF.exists() and shutil.which("ruff") is None,
                    reason="ruff is not installed (it comes with the test extra)")
def test_ruff_clean():
    ruff = str(RUFF) if RUFF.exists() else shutil.which("ruff")
    proc = subprocess.run([ruff, "check", "convfuse", "tests", "benchmarks", "examples",
                           "setup.py"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_training_loop_runs():
    """The README's training-loop snippet is real code: run it as written (CPU here)."""
    import re

    text = (ROOT / "README.md").read_text()
    snippet = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    proc = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loss = float(proc.stdout.strip().split()[-1])
    assert 0.0 < loss < 5.0  # a cross-entropy over 10 classes starts near ln(10) = 2.3
