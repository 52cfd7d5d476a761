"""convert() of torchvision's ResNet-18 on a GPU (Note [residual blocks] in
convfuse/torch/_convert_blocks.py): the 8 block tails run as cuDNN batch norms that take the
identity and the ReLU, and a training step in float32 agrees with the float64 reference
(torch.nn on the CPU). The caching allocator is poisoned with NaN first. Written without a
GPU: it has not run yet."""

from __future__ import annotations

import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from tests._zoo import import_torchvision  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402


def test_converted_resnet18_fuses_its_block_tails_on_cuda(monkeypatch):
    import convfuse.ops.cudnn.batchnorm as cudnn_bn
    import convfuse.torch as ct

    with exact_cuda():
        tv = import_torchvision()
        torch.manual_seed(0)
        ref = tv.models.resnet18(num_classes=10).double()
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
        assert sorted(calls).count(("relu", True)) == 8  # every block's tail, one call
        assert len(calls) == 20  # every batch norm of the net ran cuDNN's
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        yr.square().sum().backward()
        scale = yr.abs().max().item()
        assert (y.double().cpu() - yr).abs().max().item() <= 1e-3 * scale
        gscale = xr.grad.abs().max().item()
        assert (xm.grad.double().cpu() - xr.grad).abs().max().item() <= 1e-2 * gscale
        for (name, pr), pm in zip(ref.named_parameters(), model.parameters()):
            gs = max(pr.grad.abs().max().item(), 1e-6)
            assert (pm.grad.double().cpu() - pr.grad).abs().max().item() <= 1e-2 * gs, name
        for (name, br), bm in zip(ref.named_buffers(), model.buffers()):
            if br.is_floating_point():
                assert torch.allclose(bm.double().cpu(), br, rtol=1e-3, atol=1e-4), name
