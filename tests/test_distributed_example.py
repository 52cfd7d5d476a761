"""examples/train_ddp.py under torchrun with 2 CPU processes (gloo over loopback), both APIs:
the ranks end with identical parameters, the net learns, and each rank's process group is
really gone at the end (its gloo threads joined), which is what makes the exit clean
(Note [process-group teardown] in the example): checked on every run, not left to the
thread scheduling that made `terminate called without an active exception` intermittent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("api", ["convfuse", "torch"])
def test_train_ddp_under_torchrun(api):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "examples/train_ddp.py", "--epochs", "3", "--api", api, "--device", "cpu"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert f"--api {api}: 2 rank(s) on cpu (gloo)" in out
    assert "parameters identical on all ranks: True" in out
    assert "terminate called" not in out, out[-3000:]
    if Path("/proc/self/task").is_dir():  # the example counts gloo's threads there
        for rank in range(2):
            assert f"rank {rank}: process group destroyed, gloo threads left: 0" in out, \
                out[-3000:]
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.8, out[-2000:]
