"""convfuse.torch layers under torch.utils.checkpoint and saved-tensor hooks, against
torch.nn in float64: a batch norm's input is freed with the checkpoint's other saved
tensors (it was kept on ctx), and a recompute that differs from the first forward (a
spectral norm's power iteration) gives torch.nn's gradients (Note [what a batch norm
keeps] in convfuse/torch/_bn_plan.py)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import convfuse.torch as ct  # noqa: E402

F64 = torch.float64


def _block():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1)).to(F64)


def test_a_checkpointed_batch_norm_keeps_no_input_alive():
    model = ct.convert(_block())
    assert isinstance(model[1], ct.BatchNorm2d)
    seen = {}
    model[1].register_forward_hook(
        lambda m, i, o: seen.__setitem__("x", weakref.ref(i[0].untyped_storage())))
    x = torch.randn(2, 8, 8, 8, dtype=F64, requires_grad=True)
    y = checkpoint(model, x, use_reentrant=False)
    gc.collect()
    assert seen["x"]() is None  # torch.nn's is freed too
    y.sum().backward()
    assert x.grad is not None


def test_saved_tensor_hooks_see_the_batch_norms_tensors():
    """An offloading hook packs every saved tensor: the backward must use what it unpacks."""
    model = ct.BatchNorm2d(4).to(F64)
    ref = nn.BatchNorm2d(4).to(F64)
    x = torch.randn(3, 4, 5, 5, dtype=F64, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    assert (3, 4, 5, 5) in packed and (4,) in packed  # x and the statistics
    y.square().sum().backward()
    xr = x.detach().clone().requires_grad_()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)


def test_a_recompute_that_differs_gives_torchs_gradients():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3),
                        nn.BatchNorm2d(4)).to(F64)
    for i in (0, 2):  # the power iteration runs again at the recompute
        ref[i] = nn.utils.parametrizations.spectral_norm(ref[i])
    ours = copy.deepcopy(ref)  # the same power-iteration state
    ours[1], ours[3] = ct.convert(ours[1]), ct.convert(ours[3])
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    grads = []
    for m in (ref, ours):
        xx = x.clone().requires_grad_()
        checkpoint(m, xx, use_reentrant=False).square().sum().backward()
        grads.append((xx.grad, m[0].parametrizations.weight.original.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
