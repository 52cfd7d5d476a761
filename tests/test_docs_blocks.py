"""Every ```python block of README.md and docs/*.md runs, as written, on the CPU.

Each block runs on its own (a fresh interpreter, the repository on sys.path, a scratch
working directory), so every block must be self-contained: documentation cannot drift
from the API. A block that needs a GPU is marked by an HTML comment on the line before its
fence:

    <!-- gpu-only: why it cannot run on the CPU -->
    ```python

and is reported as skipped with that reason when no GPU is usable (and run when one is).
New sections and new docs/*.md files are picked up automatically.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_GPU_ONLY = re.compile(r"<!--\s*gpu-only\s*:?\s*(.*?)\s*-->\s*$")


def _blocks(paths: list[Path] | None = None) -> list:
    out = []
    if paths is None:
        paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in paths:
        text = path.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            gpu = _GPU_ONLY.search(before)
            reason = (gpu.group(1) or "marked gpu-only") if gpu else None
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
            out.append(pytest.param(rel, line, m.group(1), reason, id=f"{rel}:{line}"))
    return out


BLOCKS = _blocks()


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 2  # README's training loop and single layer at least


def test_blocks_are_found_with_their_lines_and_gpu_markers(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("# t\n\n```python\nprint(1)\n```\n\n<!-- gpu-only: needs cuDNN -->\n"
                   "```python\nprint(2)\n```\n```bash\nls\n```\n<!-- gpu-only -->\n\n"
                   "```python\nprint(3)\n```\n")
    found = [p.values for p in _blocks([doc])]
    assert [(line, code, why) for _, line, code, why in found] == [
        (3, "print(1)\n", None), (8, "print(2)\n", "needs cuDNN"),
        (16, "print(3)\n", "marked gpu-only")]


@pytest.mark.parametrize("doc,line,code,gpu_reason", BLOCKS)
def test_doc_block_runs(doc, line, code, gpu_reason, tmp_path):
    if gpu_reason is not None:
        from convfuse.backend import gpu_unavailable_reason

        why = gpu_unavailable_reason()
        if why is not None:
            pytest.skip(f"{doc}:{line} is gpu-only ({gpu_reason}); {why}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{doc}:{line} failed:\n{proc.stdout}\n{proc.stderr}"
