"""What the example scripts' tests share: loading a script as a module, and the check that a
bad option is refused up front."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The options every example checks the same way (train_digits.py's shared checks): each
# script's tests run these, and their own.
COMMON_BAD_OPTIONS = [
    (["--epochs", "0"], "argument --epochs: must be positive, got 0"),
    (["--batch-size", "0"], "argument --batch-size: must be positive, got 0"),
    (["--batch-size", "5000"], "--batch-size 5000 is larger than the 1437 training images"),
    (["--lr", "-1"], "argument --lr: must be positive and finite, got -1"),
    (["--seed", "-1"], "argument --seed: must be from 0 to 4294967295, got -1"),
]


def ids(options: list[tuple[list[str], str]]) -> list[str]:
    return [" ".join(argv) for argv, _ in options]


def cli_refuses_a_zero_batch(path: Path, env: dict[str, str]) -> None:
    """The script run as a command refuses --batch-size 0 as argparse would: exit status
    2, the option named, nothing on stdout."""
    proc = subprocess.run([sys.executable, str(path), "--batch-size", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "error: argument --batch-size: must be positive, got 0" in proc.stderr
    assert proc.stdout == ""


def load_example(path: Path) -> Any:
    """The example script at `path` as a module (its main() callable with an argv)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(main: Any, argv: list[str], capsys: Any, tmp_path: Path | None = None) -> str:
    """`main(argv)` refused as argparse refuses a malformed option: exit status 2 and
    nothing on stdout (nothing was built or trained); returns what it said on stderr. With
    `tmp_path`: "{tmp}" in argv names it, a --plot into it is added where argv has none,
    and nothing may be written there."""
    if tmp_path is not None:
        argv = [a.format(tmp=tmp_path) for a in argv]
        if "--plot" not in argv:
            argv += ["--plot", str(tmp_path / "c.png")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    if tmp_path is not None:
        assert list(tmp_path.iterdir()) == []  # no directory made, no plot
    return err
