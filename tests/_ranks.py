"""Start a test file as WORLD gloo ranks on this machine and wait for them: the launcher the
data-parallel tests share (each rank runs the file as a script with its own arguments)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(script: str, args_of_rank: Sequence[Sequence[str]], timeout_s: float) -> None:
    """Run `python script *args` once per entry of `args_of_rank` (rank r's arguments),
    one thread each, on the loopback; fail naming the rank and its output's end when one
    exits non-zero; kill every rank still running after `timeout_s`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    procs = [subprocess.Popen([sys.executable, script, *args], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for args in args_of_rank]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r][-3000:]}"
