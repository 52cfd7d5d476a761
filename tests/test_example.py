"""The example trains for real on the digits dataset and reaches a useful accuracy."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_digits", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_run_reaches_90_percent(tmp_path, capsys):
    example = load_example()
    accuracy = example.main(["--epochs", "4", "--device", "cpu", "--plot", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert accuracy >= 0.9
    assert out.strip().splitlines()[-1] == f"test accuracy: {accuracy:.4f}"
    assert (tmp_path / "c.png").stat().st_size > 1000
    assert "epoch  4: loss" in out


def test_cli_falls_back_to_cpu_with_a_notice(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", "1", "--batch-size", "64", "--graph",
         "--plot", str(tmp_path / "c.png")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    if "notice:" in proc.stdout:
        assert "falling back to the CPU reference engine" in proc.stdout
        assert "--graph needs a GPU" in proc.stdout
    assert lines[-1].startswith("test accuracy: 0.")
    assert "[####" in proc.stderr  # the progress bar


def test_cli_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--epochs", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--epochs" in proc.stderr


def test_default_run_reaches_95_percent(tmp_path):
    """The README's main job, as a user runs it on the CPU (the issue's bar: >= 0.95)."""
    example = load_example()
    assert example.main(["--device", "cpu", "--plot", str(tmp_path / "c.png")]) >= 0.95


def test_a_gpu_with_a_broken_install_falls_back_with_the_fix(monkeypatch, capsys):
    """The device choice asks convfuse.selfcheck.gpu_unusable_reason, not only whether a
    GPU is there: a machine with a GPU but, say, no compiled binding trains on the CPU and
    says why and how to fix it, and --device cuda stops with that sentence."""
    example = load_example()
    broken = ("the GPU install is broken: the compiled binding convfuse._cudnn is missing; "
              "fix: pip install --no-build-isolation -e .")
    monkeypatch.setattr(example, "gpu_unusable_reason", lambda: broken)
    assert example.pick_device(None) == "cpu"
    assert capsys.readouterr().out == (f"notice: {broken}; falling back to the CPU reference "
                                       "engine (NumPy).\n")
    with pytest.raises(SystemExit, match="--device cuda: the GPU install is broken"):
        example.pick_device("cuda")
    assert example.pick_device("cpu") == "cpu"
    monkeypatch.setattr(example, "gpu_unusable_reason", lambda: None)
    assert example.pick_device(None) == "cuda"
