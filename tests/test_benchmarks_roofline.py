"""benchmarks/bench arithmetic: the FLOP and byte counts against values worked out on paper
for two layers, the roofline floor, and the datasheet peak table."""

from __future__ import annotations

import pytest

from convfuse.geometry import ConvGeometry
from tests._benchmarks_helpers import peaks, roofline

# -- FLOPs and bytes, against hand-computed values ----------------------------------------

def test_conv_counts_nchw_fp32_relu_bias():
    # x (2,3,5,5), w (4,3,3,3), pad 1 -> y (2,4,5,5): 200 outputs, 27 MACs each.
    g = ConvGeometry.create((2, 3, 5, 5), (4, 3, 3, 3), padding=1)
    fwd = roofline.conv_forward(g, "float32", "relu", bias=True)
    assert fwd.flops == 2 * 200 * 27 + 200 + 200 == 11_200
    assert fwd.bytes == 4 * (150 + 108 + 200 + 4) == 1_848
    bwd = roofline.conv_backward(g, "float32", "relu", bias=True, need_dx=True)
    # dx and dw: 10,800 each; relu backward and the bias sum: 200 each
    assert bwd.flops == 2 * 10_800 + 200 + 200 == 22_000
    # reads dy 200, y 200, x 150, w 108; writes dw 108, dx 150, db 4
    assert bwd.bytes == 4 * 920 == 3_680
    no_dx = roofline.conv_backward(g, "float32", "relu", bias=True, need_dx=False)
    assert (no_dx.flops, no_dx.bytes) == (11_200, 4 * 770)


def test_conv_counts_nhwc_fp16_depthwise_stride2_residual():
    # x (1,8,8,6) NHWC, depthwise w (6,3,3,1), stride 2, pad 1 -> y (1,4,4,6): 96 outputs,
    # 9 MACs each (one input channel per group).
    g = ConvGeometry.create((1, 8, 8, 6), (6, 3, 3, 1), stride=2, padding=1, groups=6,
                            layout="NHWC")
    assert g.output_shape == (1, 4, 4, 6)
    fwd = roofline.conv_forward(g, "float16", "relu", bias=True, residual=True)
    assert fwd.flops == 2 * 96 * 9 + 3 * 96 == 2_016
    assert fwd.bytes == 2 * (384 + 54 + 96 + 6 + 96) == 1_272
    ident = roofline.conv_forward(g, "float16", "identity", bias=False)
    assert (ident.flops, ident.bytes) == (1_728, 2 * (384 + 54 + 96))
    bwd = roofline.conv_backward(g, "float16", "identity", bias=True)
    # identity saves nothing: reads dy 96, x 384, w 54; writes dw 54, dx 384, db 6
    assert (bwd.flops, bwd.bytes) == (2 * 1_728 + 96, 2 * 978)


def test_bias_grad_adam_and_linear_counts():
    shape = (2, 3, 4, 5)  # 120 elements, 3 channels
    assert roofline.bias_grad(shape, 3, "float32", "identity") == roofline.Work(120, 4 * 123)
    assert roofline.bias_grad(shape, 3, "bfloat16", "relu") == roofline.Work(240, 2 * 363)
    assert roofline.adam(1_000_000) == roofline.Work(14_000_000, 28_000_000)
    assert roofline.linear_forward(8, 128, 10, "float32") == roofline.Work(
        2 * 8 * 128 * 10 + 80, 4 * (1024 + 1280 + 10 + 80))
    assert roofline.linear_backward(8, 128, 10, "float32") == roofline.Work(
        4 * 8 * 128 * 10 + 80, 4 * (80 + 2048 + 2560 + 10))


def test_floor_is_the_slower_of_compute_and_memory_and_sums_over_steps():
    w = roofline.Work(flops=1_000, bytes=10)
    assert w.floor_seconds(peak_flops=100.0, peak_bandwidth=100.0) == 10.0  # compute-bound
    assert w.floor_seconds(peak_flops=1e6, peak_bandwidth=1.0) == 10.0  # memory-bound
    m = roofline.Work(flops=1, bytes=50)
    assert roofline.floor_seconds([w, m], 100.0, 10.0) == pytest.approx(10.0 + 5.0)
    assert roofline.total([w, m]) == roofline.Work(1_001, 60)


# -- peak table ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, bandwidth, fp32, tf32, fp16", [
    ("NVIDIA A100-SXM4-80GB", 2.039, 19.5, 156, 312),
    ("NVIDIA A100-SXM4-40GB", 1.555, 19.5, 156, 312),
    ("NVIDIA A100 80GB PCIe", 1.935, 19.5, 156, 312),
    ("NVIDIA A100-PCIE-40GB", 1.555, 19.5, 156, 312),
    ("NVIDIA H100 80GB HBM3", 3.35, 67, 494.5, 989.5),
    ("NVIDIA H100 PCIe", 2.0, 51, 378, 756),
    ("NVIDIA H200", 4.8, 67, 494.5, 989.5),
])
def test_datasheet_peaks_by_device_name(name, bandwidth, fp32, tf32, fp16):
    p = peaks.datasheet_entry(name).peaks(name)
    assert not p.measured and "datasheet" in p.source
    assert p.bandwidth == pytest.approx(bandwidth * 1e12)
    assert p.flops == pytest.approx({"fp32": fp32 * 1e12, "tf32": tf32 * 1e12,
                                     "fp16": fp16 * 1e12, "bf16": fp16 * 1e12})


@pytest.mark.parametrize("name", ["NVIDIA H200 NVL", "NVIDIA GH200 480GB", "NVIDIA H100 NVL",
                                  "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"])
def test_unknown_devices_fall_back_to_measurement(name):
    assert peaks.datasheet_entry(name) is None


def test_h100_floor_of_the_v100_bias_case():
    # dy 128x64x74x74 fp32, identity: 44,859,392 elements read + 64 written, 4 bytes each
    p = peaks.datasheet_entry("NVIDIA H100 80GB HBM3").peaks("H100")
    work = roofline.bias_grad((128, 64, 74, 74), 64, "float32", "identity")
    assert work.bytes == 4 * (128 * 64 * 74 * 74 + 64)
    assert p.floor(work, "fp32") == pytest.approx(work.bytes / 3.35e12)  # ~53.6 us



def test_a_gpu_in_the_datasheet_is_not_measured_when_no_section_has_a_floor(monkeypatch):
    """host-overhead alone reads no peak: the datasheet's are recorded, and the copy and
    GEMM runs (seconds of the acceptance run's capped host part) are not made."""
    from types import SimpleNamespace

    def measured(*_):
        raise AssertionError("measured a peak no section reads")

    monkeypatch.setattr(peaks, "measured_gpu", measured)
    engine = SimpleNamespace(is_gpu=True, info={"name": "NVIDIA H100 80GB HBM3"})
    used, info = peaks.resolve(engine, True, measure=False)
    assert used.source.startswith("H100 SXM5") and not used.measured
    assert info["measured"] is None and info["datasheet"] == used.to_json()
    with pytest.raises(AssertionError, match="no section reads"):
        peaks.resolve(engine, True)
