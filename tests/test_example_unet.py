"""examples/train_unet.py trains a U-Net (ConvTranspose up-sampling, skips through
residual=) for real on the CPU and denoises: the test set's PSNR gain over the noisy
input is at least 3.5 dB with the default settings (about 4.0 dB here), and at least
3.0 dB for the torch.nn U-Net run through convert() for 8 epochs (about 3.5 dB)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--batch-size", "0"],
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode != 0 and "--batch-size" in proc.stderr
