"""Every ```python block of docs/PYTORCH.md runs as written (CPU, each in its own process,
since one of them joins a process group)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "PYTORCH.md").read_text(), re.S)


def test_the_doc_has_both_sections_and_snippets():
    text = (ROOT / "docs" / "PYTORCH.md").read_text()
    assert "## Using convfuse from PyTorch" in text and "## Multi-GPU" in text
    assert len(BLOCKS) == 8 and "```bash\ntorchrun" in text


# A block that joins a process group must leave no gloo thread behind once it destroys the
# group: a thread left over can abort the process at exit (Note [process-group teardown] in
# examples/train_ddp.py), which a single run shows only now and then.
_NO_GLOO_LEFT = """
import sys
sys.path.insert(0, "examples")
from train_ddp import gloo_threads
assert gloo_threads() in (0, None), f"gloo threads left: {gloo_threads()}"
"""


# torchvision's wheel beside torch's CPU wheel fails its import (tests/_zoo.py says why and
# how it is made importable for its models); a block that imports it gets that done first.
_TORCHVISION = """
from tests._zoo import import_torchvision
import_torchvision()
"""


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs(index):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo")
    code = BLOCKS[index]
    if "init_process_group" in code:
        code += _NO_GLOO_LEFT
    if "import torchvision" in code:  # make the block's import work on torch's CPU wheel
        code = _TORCHVISION + code
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    if "FusedBasicBlock" in code:  # the block ran its torchvision part, not its fallback
        assert "FusedBasicBlock relu relu" in done.stdout, done.stdout[-3000:]
        assert "FusedInvertedResidual identity" in done.stdout, done.stdout[-3000:]
