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

from tests._example_helpers import COMMON_BAD_OPTIONS, ids, refused
from tests._example_helpers import load_example as load_example_at

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT))


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


def load_example():
    return load_example_at(EXAMPLE)


# Refused up front, as argparse refuses a malformed option: exit status 2, the option named,
# before the process group exists (so under torchrun no rank waits for the others). These
# used to fail late: --batch-size 0 with ZeroDivisionError, --epochs 0 by printing
# "test accuracy: 0.0000" without evaluating, a batch larger than the training set in
# Mean.compute() with nothing added.
@pytest.mark.parametrize(("argv", "message"), COMMON_BAD_OPTIONS, ids=ids(COMMON_BAD_OPTIONS))
def test_bad_options_are_refused_before_the_process_group(argv, message, monkeypatch, capsys):
    import torch.distributed as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    example = load_example()
    assert f"error: {message}" in refused(example.main, ["--device", "cpu", *argv], capsys)
    assert not dist.is_initialized()


def test_a_global_batch_the_ranks_cannot_share_is_refused(monkeypatch, capsys):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node=2 sets it
    example = load_example()
    with pytest.raises(SystemExit) as exit_:
        example.main(["--device", "cpu", "--batch-size", "63"])
    assert exit_.value.code == 2
    assert "error: --batch-size 63 must be divisible by the world size 2" in \
        capsys.readouterr().err
    assert not dist.is_initialized()


def test_device_cuda_without_a_usable_gpu_stops_with_the_reason(monkeypatch):
    """As train_digits.py does: the reason in one line, before any process group."""
    import torch.distributed as dist

    example = load_example()
    monkeypatch.setattr(example, "gpu_unusable_reason",
                        lambda: "no usable CUDA device or driver was found")
    with pytest.raises(SystemExit, match=r"^--device cuda: no usable CUDA device or driver"):
        example.main(["--device", "cuda", "--epochs", "1"])
    assert not dist.is_initialized()


def test_device_cuda_cli_on_a_machine_without_a_gpu():
    from convfuse.selfcheck import gpu_unusable_reason

    reason = gpu_unusable_reason()
    if reason is None:
        pytest.skip("a GPU is usable here: --device cuda trains")
    done = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cuda"], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == f"--device cuda: {reason}\n"  # no traceback
    assert done.stdout == ""
