"""torch.compile(model, backend="convfuse") on a GPU: the fused chains run convfuse's cuDNN
ops inside Inductor's graph (and inside CUDA graphs with mode="reduce-overhead"), and a
ResNet-18 training step equals torch.nn's in float64 on the CPU. Written without a GPU:
none of these has run yet."""

from __future__ import annotations

import contextlib
import copy

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402
from tests._zoo import import_torchvision  # noqa: E402
from tests.gpu._torch_gpu import exact_cuda, poison  # noqa: E402


@pytest.fixture(autouse=True)
def _cuda_torch():
    with exact_cuda(reset_dynamo=True):
        yield


def _resnet():
    tv = import_torchvision()
    torch.manual_seed(0)
    return tv.models.resnet18(num_classes=4)


def _step(model, x, opt):
    opt.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    opt.step()
    return y.detach().clone()


def _convfuse_kernels(prof):
    names = {e.key for e in prof.key_averages()}
    return {n for n in names if n.startswith("convfuse::")}, \
        {n for n in names if n in ("aten::cudnn_convolution", "aten::cudnn_batch_norm",
                                   "aten::convolution", "aten::native_batch_norm")}


@pytest.mark.timeout(240)  # an Inductor compile on a cold cache: tens of seconds
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_resnet18_training_steps_match_float64_cpu(mode):
    model = _resnet().cuda()
    ref = copy.deepcopy(model).double().cpu()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    # the backend object: what backend="convfuse" names, independent of the install
    compiled = torch.compile(model, backend=ct.backend(), mode=mode, fullgraph=True)
    x = torch.randn(4, 3, 32, 32, device="cuda")
    # reduce-overhead must really capture: graph trees otherwise skip silently and run eager
    graphs = (torch._inductor.config.patch({"triton.cudagraph_or_error": True})
              if mode == "reduce-overhead" else contextlib.nullcontext())
    with graphs:
        _steps(compiled, ref, model, x, opt, opt_ref, profile=mode is None)


def _steps(compiled, ref, model, x, opt, opt_ref, profile):
    for i in range(3):  # CUDA graphs record on the first calls and replay after
        poison(256 << 20)
        # profiled without CUDA graphs only: CUPTI during a stream capture is a known
        # source of trouble of its own, which would read as convfuse's
        with torch.profiler.profile() if profile else contextlib.nullcontext() as prof:
            y = _step(compiled, x, opt)
        y_ref = _step(ref, x.double().cpu(), opt_ref)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y.double().cpu(), y_ref, rtol=2e-3, atol=2e-3)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach().double().cpu(), q.detach(), rtol=2e-3,
                                       atol=2e-3, msg=f"step {i}: {name}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b.double().cpu(), c.double(), rtol=2e-3, atol=2e-3,
                                       msg=f"step {i}: {name}")
        # step 1: step 0 is where dynamo traces, and its fake-tensor trace shows up in the
        # profiler as aten::convolution and batch norm; under reduce-overhead step 1 is the
        # CUDA-graph recording (its ops run), step 2 a replay (none run)
        if i == 1 and profile:
            ours, torchs = _convfuse_kernels(prof)
            assert {"convfuse::conv_bias_act", "convfuse::batchnorm_training",
                    "convfuse::conv_bias_act_backward",
                    "convfuse::batchnorm_backward"} <= ours
            assert not torchs, torchs  # no torch convolution or batch norm ran


def test_explain_on_the_gpu_fuses_every_tail():
    model = _resnet().cuda()
    report = ct.explain(model, torch.randn(2, 3, 32, 32, device="cuda"))
    assert sum(r.pattern == "batch_norm+add+relu" for r in report.fused) == 8
    assert report.left == []


@pytest.mark.timeout(240)  # an Inductor compile on a cold cache: tens of seconds
def test_channels_last_and_autocast_with_inductor():
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
                                torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1),
                                torch.nn.SiLU()).cuda().to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, 16, 16, device="cuda").to(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend=ct.backend(), fullgraph=True)
    with torch.autocast("cuda", dtype=torch.float16):
        poison(256 << 20)
        y = compiled(x)
        y_ref = ref(x)
    assert y.dtype == y_ref.dtype == torch.float16
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
