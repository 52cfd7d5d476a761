"""benchmarks/bench/resnet.py on the CPU: the ResNet-18 step runs against PyTorch with the
same weights, the conv timer sees every convolution op and restores them, and run()
reports every form's steps/s, the ratio to PyTorch and the fraction outside convolutions."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import convfuse as cf
from convfuse import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench import resnet

pytest.importorskip("torch")


def test_cpu_case_reports_every_number(monkeypatch):
    rec = resnet._cpu_case(batch=4, size=32, classes=3, repeats=2, steps=1)
    assert rec["first_loss"]["match"], rec["first_loss"]
    forms = rec["forms"]
    assert set(forms) == {"convfuse_eager", "pytorch_eager"}
    eager = forms["convfuse_eager"]
    assert 0 < eager["steps_per_s"]["min"] <= eager["steps_per_s"]["median"] \
        <= eager["steps_per_s"]["max"]
    assert eager["ratio_to_pytorch"]["median"] > 0 and "ratio_to_pytorch" not in \
        forms["pytorch_eager"]
    prof = rec["convfuse_eager_profile"]
    assert 0 < prof["conv_s_per_step"] < prof["step_s_per_step"]
    assert 0 < prof["outside_conv_fraction"] < 1
    text = resnet.table({"engine": "CPU", "cases": [rec, {"error": "ValueError: x"}]})
    assert "N4 3x32x32 -> 3 classes float32 NCHW" in text and "pytorch_eager" in text
    assert "of the step outside convolutions" in text and "(failed)" in text


def test_conv_timer_counts_each_conv_op_and_restores_them():
    before = {name: getattr(ops, name) for name in resnet.CONV_OPS}
    model = cf.Sequential(cf.Conv2d(1, 2, 3, device="cpu"), cf.Flatten(),
                          cf.Linear(2, 2, device="cpu"))
    x = np.ones((1, 1, 3, 3), np.float32)
    with resnet._conv_timer(gpu=False) as conv:
        y = model(x)
        model.backward(np.ones_like(y))
    assert conv[0] > 0
    for name, fn in before.items():
        assert getattr(ops, name) is fn


def test_run_without_gpu_is_labelled_cpu(monkeypatch):
    seen = {}

    def fake_case(batch, size, classes, repeats, steps):
        seen.update(batch=batch, size=size, classes=classes)
        return {"forms": {}}

    monkeypatch.setattr(resnet.cf, "gpu_available", lambda: False)
    monkeypatch.setattr(resnet, "_cpu_case", fake_case)
    out = resnet.run(quick=True)
    assert out["engine"] == "CPU reference engine (NumPy)" and "say nothing about cuDNN" \
        in out["notice"]
    assert seen == {"batch": 4, "size": 32, "classes": 10}
    assert "1 thread" in out["cpu_threads"]

    def broken(*a):
        raise RuntimeError("boom")

    monkeypatch.setattr(resnet, "_cpu_case", broken)
    assert resnet.run(quick=False)["cases"] == [{"error": "RuntimeError: boom"}]
