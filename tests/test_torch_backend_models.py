"""torch.compile(backend=convfuse) on the model zoos, built without weights at tiny sizes:
no torch convolution or batch norm is left in the graph, and a training step (outputs,
input and parameter gradients, running statistics, SGD step) matches torch.nn in float64.
inner="eager" here: the unit tests run aot_eager, and Dynamo's tracing is what costs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests._backend_helpers import assert_matches_torch, torch_ops_left  # noqa: E402
from tests._zoo import import_monai, import_timm, import_torchvision  # noqa: E402


def _check(model, x, rtol=1e-6):
    records, graphs = assert_matches_torch(model, x, rtol=rtol, inner="eager")
    assert torch_ops_left(graphs) == []
    assert len(graphs) == 1  # fullgraph
    return records


def _count(records, pattern):
    return sum(1 for r in records if r.fused and r.pattern == pattern)


def test_resnet18_fuses_every_residual_tail():
    """The done criterion: all 8 BasicBlock tails `bn2 -> += identity -> relu` fused, and no
    torch convolution or batch norm left."""
    tv = import_torchvision()
    torch.manual_seed(0)
    records = _check(tv.models.resnet18(num_classes=4), torch.randn(2, 3, 32, 32))
    assert _count(records, "batch_norm+add+relu") == 8
    assert _count(records, "conv2d") == 20 and _count(records, "batch_norm+relu") == 9
    assert _count(records, "batch_norm") == 3  # the downsample branches: each a residual


def test_mobilenet_v2_relu6_and_linear_bottleneck():
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.MobileNetV2(num_classes=4, width_mult=0.25, inverted_residual_setting=[
        [1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]])
    records = _check(model, torch.randn(2, 3, 32, 32))
    assert _count(records, "batch_norm+relu6") >= 8
    assert _count(records, "batch_norm+add") == 3  # x + bn(conv(...)), the residual first


def test_timm_efficientnet_batchnormact_silu():
    """timm's BatchNormAct2d has its own forward (F.batch_norm, then its act): fused as the
    graph shows it."""
    timm = import_timm()
    torch.manual_seed(0)
    records = _check(timm.create_model("test_efficientnet", num_classes=4),
                     torch.randn(2, 3, 32, 32))
    assert _count(records, "batch_norm+silu") >= 6
    assert _count(records, "conv2d+silu") >= 1 and _count(records, "conv2d+sigmoid") >= 1


def test_small_densenet_preactivation():
    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8,
                               bn_size=2, num_classes=4)
    records = _check(model, torch.randn(2, 3, 32, 32))
    assert _count(records, "batch_norm+relu") >= 9


def test_video_resnet_3d():
    tv = import_torchvision()
    video = tv.models.video.resnet
    torch.manual_seed(0)
    model = video.VideoResNet(video.BasicBlock, [video.Conv3DSimple] * 4, [1, 1, 1, 1],
                              video.BasicStem, num_classes=4)  # r3d_18 with 1 block a stage
    records = _check(model, torch.randn(2, 3, 2, 8, 8))
    assert _count(records, "batch_norm+add+relu") == 4


def test_monai_unet_transposed_convolutions():
    monai = import_monai()
    torch.manual_seed(0)
    model = monai.networks.nets.UNet(spatial_dims=2, in_channels=1, out_channels=2,
                                     channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                                     act="relu", norm="batch")
    records = _check(model, torch.randn(2, 1, 16, 16))
    assert any(r.pattern.startswith("conv_transpose2d") for r in records)
    assert any("+add" in r.pattern for r in records)  # the residual units
