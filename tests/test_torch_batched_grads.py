"""Batched backward through convfuse.torch layers (autograd.grad's is_grads_batched, a
vectorized jacobian, gradcheck's batched check): torch's legacy vmap hands the backward a
batched dy, which the engines cannot read; it takes the recorded path (torch's ops, which
vmap batches). Against torch.nn in float64."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import convfuse.torch as ct  # noqa: E402

F64 = torch.float64


def _pairs():
    conv = ct.Conv2d(3, 4, 3, activation="relu").to(F64)
    ref_conv = nn.Conv2d(3, 4, 3).to(F64)
    ref_conv.load_state_dict(conv.state_dict())
    up = ct.ConvTranspose2d(3, 4, 3).to(F64)
    ref_up = nn.ConvTranspose2d(3, 4, 3).to(F64)
    ref_up.load_state_dict(up.state_dict())
    bn = ct.BatchNorm2d(3).to(F64)
    return [(conv, nn.Sequential(ref_conv, nn.ReLU()), (1, 3, 5, 5)),
            (up, ref_up, (1, 3, 5, 5)), (bn, nn.BatchNorm2d(3).to(F64), (2, 3, 4, 4))]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["Conv2d", "ConvTranspose2d", "BatchNorm2d"])
@pytest.mark.parametrize("training", [True, False])
def test_is_grads_batched_as_torch(index, training):
    ours, ref, shape = _pairs()[index]
    ours.train(training)
    ref.train(training)
    torch.manual_seed(0)
    x = torch.randn(*shape, dtype=F64, requires_grad=True)
    y, y_ref = ours(x), ref(x)
    v = torch.randn(3, *y.shape, dtype=F64)
    got = torch.autograd.grad(y, x, v, is_grads_batched=True)[0]
    want = torch.autograd.grad(y_ref, x, v, is_grads_batched=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_vectorized_jacobian_and_batched_gradcheck():
    torch.manual_seed(0)
    conv = ct.Conv2d(3, 2, 3).to(F64)
    ref = nn.Conv2d(3, 2, 3).to(F64)
    ref.load_state_dict(conv.state_dict())
    x = torch.randn(1, 3, 5, 5, dtype=F64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(conv, x, vectorize=True)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(ref, x),
                               rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(conv, (x,), check_batched_grad=True)
