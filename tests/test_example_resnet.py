"""examples/train_resnet.py trains a small ResNet for real and reaches the issue's bar."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._example_helpers import COMMON_BAD_OPTIONS, cli_refuses_a_zero_batch, ids, refused
from tests._example_helpers import load_example as load_example_at

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_resnet.py"
# The checkout under test, even where another convfuse is installed in the environment.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def test_default_run_reaches_97_percent(tmp_path):
    """Default settings, as a user runs it (on the CPU engine here, with the notice)."""
    plot = tmp_path / "curves.png"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--graph", "--plot", str(plot)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    if "notice:" in out:
        assert "falling back to the CPU reference engine" in out
        assert "--graph needs a GPU" in out
    assert "[####" in proc.stderr  # the progress bar
    assert "epoch  8: loss" in out
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"test accuracy: (\d\.\d{4})", last)
    assert match, last
    accuracy = float(match.group(1))
    assert accuracy >= 0.97
    folded = re.search(r"no BatchNorm\): test accuracy (\d\.\d{4})", out)
    assert folded and abs(float(folded.group(1)) - accuracy) <= 1 / 360  # at most one image
    assert plot.stat().st_size > 1000


def test_cli_rejects_bad_arguments():
    cli_refuses_a_zero_batch(EXAMPLE, ENV)


def load_example():
    return load_example_at(EXAMPLE)


# The command line is train_digits.py's (tests/test_example.py checks every option); these
# check that train_resnet.py runs those checks too, before training.
BAD_OPTIONS = [
    *COMMON_BAD_OPTIONS,
    (["--plot", "{tmp}/missing/c.png"], "--plot {tmp}/missing/c.png: directory {tmp}/missing "
                                        "does not exist"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS, ids=ids(BAD_OPTIONS))
def test_bad_options_are_refused_before_training(argv, message, tmp_path, capsys):
    err = refused(load_example().main, ["--device", "cpu", *argv], capsys, tmp_path)
    assert f"error: {message.format(tmp=tmp_path)}" in err
