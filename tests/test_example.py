"""The example trains for real on the digits dataset and reaches a useful accuracy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._example_helpers import COMMON_BAD_OPTIONS, ids, refused
from tests._example_helpers import load_example as load_example_at

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_digits.py"


def load_example():
    return load_example_at(EXAMPLE)


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
    assert proc.returncode == 2, proc.stderr
    assert "error: argument --epochs: must be positive, got 0" in proc.stderr
    assert proc.stdout == ""  # refused before anything was loaded or trained


# Every bad option is refused up front, as argparse refuses a malformed one: exit status 2 and
# a message naming the option, before any training (and before the plot could fail after it).
BAD_OPTIONS = [
    *COMMON_BAD_OPTIONS,
    (["--epochs", "-2"], "argument --epochs: must be positive, got -2"),
    (["--batch-size", "-32"], "argument --batch-size: must be positive, got -32"),
    (["--lr", "0"], "argument --lr: must be positive and finite, got 0"),
    (["--lr", "nan"], "argument --lr: must be positive and finite, got nan"),
    (["--seed", "4294967296"], "argument --seed: must be from 0 to 4294967295"),
    (["--plot", "{tmp}/missing/c.png"], "--plot {tmp}/missing/c.png: directory {tmp}/missing "
                                        "does not exist"),
    (["--plot", "{tmp}"], "--plot {tmp}: is a directory"),
    (["--plot", "{tmp}/c.xyz"], "--plot {tmp}/c.xyz: matplotlib cannot write .xyz"),
    # listed by matplotlib, but it needs LaTeX: it failed after training
    (["--plot", "{tmp}/c.pgf"], "--plot {tmp}/c.pgf: matplotlib cannot write .pgf"),
    (["--plot", "{tmp}/curves"], "--plot {tmp}/curves: matplotlib cannot write a file with no "
                                 "suffix"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS, ids=ids(BAD_OPTIONS))
def test_bad_options_are_refused_before_training(argv, message, tmp_path, capsys):
    err = refused(load_example().main, ["--device", "cpu", *argv], capsys, tmp_path)
    assert f"error: {message.format(tmp=tmp_path)}" in err


def test_batch_size_up_to_the_whole_training_set_trains(tmp_path, capsys):
    """An epoch trains on full batches only (a CUDA graph replays static shapes), so the
    largest batch is the whole training set: one step per epoch. One more is refused above."""
    example = load_example()
    example.main(["--epochs", "1", "--batch-size", "1437", "--device", "cpu",
                  "--plot", str(tmp_path / "c.png")])
    out, err = capsys.readouterr()
    assert "batch 1437, 1 epochs" in out and "epoch  1: loss" in out
    assert "] 1/1" in err  # one step
    assert (tmp_path / "c.png").exists()


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
