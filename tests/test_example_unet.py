"""examples/train_unet.py trains a U-Net (ConvTranspose up-sampling, skips through
residual=) for real on the CPU and denoises: the test set's PSNR gain over the noisy
input is at least 3.5 dB with the default settings (about 4.0 dB here), and at least
3.0 dB for the torch.nn U-Net run through convert() for 8 epochs (about 3.5 dB)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._example_helpers import COMMON_BAD_OPTIONS, cli_refuses_a_zero_batch, ids, refused
from tests._example_helpers import load_example as load_example_at

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_unet.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _gain(args):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    match = re.fullmatch(r"PSNR gain: (-?\d+\.\d\d) dB", lines[-1])
    assert match, lines[-1]
    assert re.fullmatch(r"test PSNR: noisy \d+\.\d\d dB, denoised \d+\.\d\d dB", lines[-2])
    return float(match.group(1)), proc.stdout


def test_default_run_denoises_by_3_5_db():
    gain, out = _gain([])
    assert "epoch 20: train mse" in out
    assert gain >= 3.5


def test_converted_torch_unet_denoises_by_3_db():
    pytest.importorskip("torch")
    gain, out = _gain(["--torch", "--epochs", "8"])
    assert "epoch  8: train mse" in out
    assert gain >= 3.0


def test_cli_rejects_bad_arguments():
    cli_refuses_a_zero_batch(EXAMPLE, ENV)


def load_example():
    return load_example_at(EXAMPLE)


# Refused up front, as argparse refuses a malformed option: exit status 2, the option named,
# nothing trained. A batch larger than the training set would train on nothing (epochs use
# full batches only), which used to end in "Mean.compute(): nothing was added".
BAD_OPTIONS = [
    *COMMON_BAD_OPTIONS,
    (["--batch-size", "2000"], "--batch-size 2000 is larger than the 1437 training images"),
    (["--noise", "0"], "argument --noise: must be positive and finite, got 0"),
    (["--noise", "inf"], "argument --noise: must be positive and finite, got inf"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS, ids=ids(BAD_OPTIONS))
def test_bad_options_are_refused_before_training(argv, message, capsys):
    example = load_example()
    assert f"error: {message}" in refused(example.main, ["--device", "cpu", *argv], capsys)


def test_torch_flag_without_torch_is_refused(monkeypatch, capsys):
    example = load_example()
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_:
        example.main(["--torch", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "error: --torch needs PyTorch: pip install torch" in capsys.readouterr().err
