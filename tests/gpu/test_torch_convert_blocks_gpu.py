"""convert() of torchvision's ResNet-18 and MobileNetV2 on a GPU (Notes [residual blocks] and
[inverted residual blocks] in convfuse/torch/_convert_blocks.py): ResNet's 8 block tails
run as cuDNN batch norms that take the identity and the ReLU, MobileNetV2's 10 skips as
batch norms that take the block's input, and a training step in float32 agrees with the
float64 reference (torch.nn on the CPU). The caching allocator is poisoned with NaN first.
Written without a GPU: it has not run yet."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests._zoo import import_torchvision  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402


def _fused_step(monkeypatch, name, residual_calls, calls_in_all):
    """One training step of torchvision's `name` converted, in float32 on the GPU, against
    torch.nn's in float64 on the CPU; the cuDNN batch norms that ran, by (activation,
    residual given), are checked against `residual_calls` and their count."""
    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.torch as ct

    with exact_cuda():
        tv = import_torchvision()
        torch.manual_seed(0)
        kwargs = {"dropout": 0.0} if name.startswith("mobilenet") else {}
        ref = getattr(tv.models, name)(num_classes=10, **kwargs).double()
        model = ct.convert(copy.deepcopy(ref).float()).cuda()
        calls: list = []
        real = cudnn_bn.batchnorm_forward_training

        def spy(*args, **kwargs):
            calls.append((args[-2], args[-1] is not None))  # activation, residual given
            return real(*args, **kwargs)

        monkeypatch.setattr(cudnn_bn, "batchnorm_forward_training", spy)
        x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
        poison()
        xm = x.float().cuda().requires_grad_()
        y = model(xm)
        y.square().sum().backward()
        torch.cuda.synchronize()
        for call, count in residual_calls.items():
            assert calls.count(call) == count, call  # every fused tail, one call each
        assert sum(residual for _, residual in calls) == sum(residual_calls.values())
        assert len(calls) == calls_in_all  # every batch norm of the net ran cuDNN's
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        yr.square().sum().backward()
        scale = yr.abs().max().item()
        assert (y.double().cpu() - yr).abs().max().item() <= 1e-3 * scale
        gscale = xr.grad.abs().max().item()
        assert (xm.grad.double().cpu() - xr.grad).abs().max().item() <= 1e-2 * gscale
        for (pname, pr), pm in zip(ref.named_parameters(), model.parameters()):
            gs = max(pr.grad.abs().max().item(), 1e-6)
            assert (pm.grad.double().cpu() - pr.grad).abs().max().item() <= 1e-2 * gs, pname
        for (bname, br), bm in zip(ref.named_buffers(), model.buffers()):
            if br.is_floating_point():
                assert torch.allclose(bm.double().cpu(), br, rtol=1e-3, atol=1e-4), bname


def test_converted_resnet18_fuses_its_block_tails_on_cuda(monkeypatch):
    _fused_step(monkeypatch, "resnet18", {("relu", True): 8}, 20)


def test_converted_mobilenet_v2_fuses_its_skips_on_cuda(monkeypatch):
    _fused_step(monkeypatch, "mobilenet_v2", {("identity", True): 10}, 52)


def test_converted_resnet18_runs_cudnns_fused_batch_norms_under_autocast(monkeypatch):
    """The one configuration cuDNN fuses batch norm with the add and the ReLU for (Note
    [BatchNorm in cuDNN]): packed NHWC float16, C % 4 == 0. A converted ResNet-18 in
    channels_last under autocast float16 runs every batch norm followed by a ReLU as
    ForwardTrainingEx (the 8 block tails taking the identity too; convert() leaves the
    stem's ReLU to ResNet.forward), and its backward as
    BackwardEx with the reserve space of its own forward; the step is finite and close to
    torch.nn's float64 one."""
    import convfuse.torch as ct
    from convfuse._binding import cudnn

    lib = cudnn()
    ex: dict[str, list] = {"fwd": [], "bwd": []}
    for key, name, ops_at in (("fwd", "batchNormalizationForwardTrainingEx", 2),
                              ("bwd", "batchNormalizationBackwardEx", 2)):
        real = getattr(lib, name)

        def spy(*a, _real=real, _key=key, _at=ops_at):
            ex[_key].append(a[_at])
            return _real(*a)

        monkeypatch.setattr(lib, name, spy)
    with exact_cuda():
        tv = import_torchvision()
        torch.manual_seed(0)
        ref = tv.models.resnet18(num_classes=10).double()
        model = ct.convert(copy.deepcopy(ref).float()).cuda()
        model = model.to(memory_format=torch.channels_last)
        x = torch.randn(4, 3, 64, 64, dtype=torch.float64)
        poison()
        xm = x.float().cuda().to(memory_format=torch.channels_last).requires_grad_()
        with torch.autocast("cuda", dtype=torch.float16):
            y = model(xm)
        y.float().square().sum().backward()
        torch.cuda.synchronize()
    add, act = lib.CUDNN_BATCHNORM_OPS_BN_ADD_ACTIVATION, lib.CUDNN_BATCHNORM_OPS_BN_ACTIVATION
    # each block's first batch norm takes the ReLU, the 8 tails the add too; the stem's
    # (its ReLU is ResNet.forward's own call) and the 3 downsample ones run the plain call
    assert sorted(ex["fwd"]) == sorted([act] * 8 + [add] * 8), ex["fwd"]
    assert sorted(ex["bwd"]) == sorted(ex["fwd"])
    assert torch.isfinite(y).all() and torch.isfinite(xm.grad).all()
    yr = ref(x)
    scale = yr.abs().max().item()
    assert (y.double().cpu() - yr).abs().max().item() <= 5e-2 * scale
