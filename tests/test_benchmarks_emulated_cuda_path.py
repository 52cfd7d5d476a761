"""benchmarks/emulated_cuda_path.py: every row runs its layer on the fake CUDA device (so
the CUDA branch of the bridge and the cuDNN engine is what ran), records a figure per
round, and leaves no fake behind. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cupy")

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location(
        "emulated_cuda_path", ROOT / "benchmarks" / "emulated_cuda_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_row_runs_the_cuda_branch_and_the_fake_is_gone(monkeypatch, tmp_path):
    from convfuse import backend
    from convfuse.ops.cudnn import conv as cudnn_conv

    if backend.gpu_available():
        pytest.skip("fakes the device; the host-overhead section times a real one")

    mod = _module()
    calls = []
    real = cudnn_conv.conv_bias_act
    monkeypatch.setattr(cudnn_conv, "conv_bias_act",
                        lambda *a, **k: calls.append(type(a[0]).__name__) or real(*a, **k))
    out = tmp_path / "emulated.json"
    assert mod.main(["--quick", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rows"]] == [
        "conv_forward_nograd", "conv_forward_backward", "batchnorm2d_train_fwd_bwd",
        "conv_transpose2d_fwd_bwd", "cupy_conv2d_forward", "cupy_conv2d_fwd_bwd"]
    for row in result["rows"]:
        assert 0 < row["min_us"] <= row["us_per_call"] <= row["max_us"], row
    assert "not a GPU figure" in result["what"]
    # the cuDNN engine: the bridge's calls on pointers, the CuPy layer's on CuPy arrays
    assert calls and set(calls) == {"DeviceArray", "ndarray"}
    assert not torch.ones(1).is_cuda and torch.ones(1).is_cpu  # the fake is undone
    assert torch.empty(2).device.type == "cpu"
