"""`torch.compile(model, backend="convfuse")` by name: the `torch_dynamo_backends` entry
point (pyproject.toml) names the compiler function itself, and an installed convfuse is
found by a fresh interpreter that never imported it. The default inner backend is
Inductor: this is the one CPU test that compiles C++ (tiny model)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_entry_point_is_the_compiler_function():
    import importlib
    import inspect

    import tomllib

    from convfuse.torch.dynamo import convfuse

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = meta["project"]["entry-points"]["torch_dynamo_backends"]["convfuse"]
    module, _, name = value.partition(":")
    fn = getattr(importlib.import_module(module), name)
    assert fn is convfuse  # the compiler function itself, not a factory
    assert list(inspect.signature(fn).parameters)[:2] == ["gm", "example_inputs"]


_SCRIPT = textwrap.dedent("""
    import copy, sys
    import torch
    assert "convfuse" not in sys.modules
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.BatchNorm2d(3),
                                torch.nn.ReLU())
    ref = copy.deepcopy(model)
    x = torch.randn(2, 2, 5, 5)
    compiled = torch.compile(model, backend="convfuse", fullgraph=True)
    with torch.profiler.profile() as prof:
        y = compiled(x)
        y.square().sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert "convfuse.torch.dynamo.backend" in sys.modules
    assert "convfuse::conv_bias_act" in names and "convfuse::batchnorm_training" in names, \\
        sorted(n for n in names if "convfuse" in n)
    yr = ref(x)
    yr.square().sum().backward()
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var)
    print("ok")
""")


@pytest.mark.slow  # Inductor compiles C++ (20-40 s here)
def test_compile_by_name_in_a_fresh_interpreter():
    points = importlib.metadata.entry_points(group="torch_dynamo_backends", name="convfuse")
    if not points:
        pytest.skip("the installed convfuse has no torch_dynamo_backends entry point (an "
                    "editable install older than it); CI installs this checkout")
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                         timeout=600, cwd=ROOT / "tests")
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")
