"""The per-call path of convfuse.torch and convfuse.ops (issue #25): one post-validation
entry per op (convfuse.ops.validated) shared by the public ops and the bridge's cached
path, and the cheap checks the per-call path relies on agreeing with what they replace."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import convfuse.ops as cops  # noqa: E402
import convfuse.ops.validated as validated  # noqa: E402
import convfuse.torch as ct  # noqa: E402
from convfuse.geometry import ConvGeometry  # noqa: E402
from convfuse.ops.reference import batchnorm as ref_bn  # noqa: E402
from convfuse.ops.reference import conv as ref_conv  # noqa: E402
from convfuse.plan.batchnorm import BatchNormGeometry  # noqa: E402
from convfuse.torch import _arrays, _autocast, _eager  # noqa: E402

F64 = torch.float64


def _spy(mp: pytest.MonkeyPatch, names: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(validated, name)

        def spy(*a, _name=name, _real=real, **k):
            counts[_name] += 1
            return _real(*a, **k)

        mp.setattr(validated, name, spy)
    return counts


def test_public_ops_and_the_bridge_run_the_same_post_validation_entries():
    names = ["conv_bias_act", "conv_backward_filter", "conv_backward_data",
             "conv_backward_bias", "batchnorm_forward_training", "batchnorm_backward",
             "conv_transpose_bias_act", "conv_transpose_backward_data"]
    conv = ct.Conv2d(2, 3, 3, padding=1, dtype=F64)
    bn = ct.BatchNorm2d(3, dtype=F64)
    up = ct.ConvTranspose2d(3, 2, 3, stride=2, dtype=F64)
    x = torch.randn(2, 2, 5, 5, dtype=F64, requires_grad=True)
    with pytest.MonkeyPatch.context() as mp:
        counts = _spy(mp, names)
        g = ConvGeometry.create((1, 2, 4, 4), (3, 2, 3, 3), 1, 1, 1, 1)
        xa, wa = np.ones((1, 2, 4, 4)), np.ones((3, 2, 3, 3))
        cops.conv_bias_act(xa, wa, None, g)  # the public op after its checks
        assert counts["conv_bias_act"] == 1
        for call in (1, 2):  # validated by convfuse.ops the first time, direct the second
            up(bn(conv(x))).sum().backward()
            assert counts["conv_bias_act"] == 1 + call
            assert all(counts[n] == call for n in names if n != "conv_bias_act"), counts


def test_the_bridge_gives_the_public_ops_results():
    """The cached path (second call) agrees bit for bit with the first (checked) call."""
    torch.manual_seed(0)
    conv = ct.Conv2d(2, 3, 3, padding=1, activation="gelu", dtype=F64)
    bn = ct.BatchNorm2d(3, activation="relu", dtype=F64)
    x = torch.randn(2, 2, 5, 5, dtype=F64, requires_grad=True)
    runs = []
    for _ in range(2):
        bn.running_mean.zero_()
        bn.running_var.fill_(1)
        y = bn(conv(x))
        grads = torch.autograd.grad(y, [x, conv.weight, conv.bias, bn.weight, bn.bias],
                                    torch.ones_like(y))
        runs.append([y, bn.running_mean.clone(), bn.running_var.clone(), *grads])
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
    # the output against torch.nn's, in float64
    ref_conv_ = torch.nn.Conv2d(2, 3, 3, padding=1, dtype=F64)
    ref_conv_.load_state_dict(conv.state_dict())
    ref_bn_ = torch.nn.BatchNorm2d(3, dtype=F64)
    ref_bn_.load_state_dict(bn.state_dict())
    y = torch.relu(ref_bn_(torch.nn.functional.gelu(ref_conv_(x))))
    torch.testing.assert_close(runs[0][0], y)


def test_batchnorm_backward_accumulates_into_given_gradients():
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((4, 3, 2, 2)), rng.standard_normal((4, 3, 2, 2))
    w, b = rng.standard_normal(3), rng.standard_normal(3)
    _, saved = cops.batchnorm_forward_training(x, w, b, None, None)
    _, dw, db, _ = cops.batchnorm_backward(dy, x, w, b, saved)
    wg, bg = np.full(3, np.nan), np.full(3, np.nan)
    cops.batchnorm_backward(dy, x, w, b, saved, weight_grad=wg, bias_grad=bg)  # beta 0: NaN unread
    np.testing.assert_array_equal(wg, dw)
    cops.batchnorm_backward(dy, x, w, b, saved, weight_grad=wg, bias_grad=bg, param_beta=1.0)
    np.testing.assert_allclose(wg, 2 * dw, rtol=1e-15)
    np.testing.assert_allclose(bg, 2 * db, rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "layout"), [((3, 2, 4, 5), "NCHW"), ((3, 4, 5, 2), "NHWC"),
                                               ((5, 2), "NCHW"), ((2, 3, 7), "NCHW"),
                                               ((2, 3, 2, 2, 4), "NHWC")])
def test_batchnorm_reductions_are_numpys_bit_for_bit(shape, layout, dtype):
    g = BatchNormGeometry.create(shape, layout)
    a = np.random.default_rng(1).standard_normal(shape).astype(dtype) * 1e3
    ax = ref_bn._axes(g)
    assert np.array_equal(ref_bn._mean(a, ax), a.mean(axis=g.reduce_axes))
    assert np.array_equal(ref_bn._sum(a, ax), a.sum(axis=g.reduce_axes))
    assert ax.values == g.count


def test_batchnorm_mean_past_float32s_exact_counts_is_numpys_bit_for_bit():
    """2**24 + 3 values per channel: float32 cannot hold the count, so the mean keeps
    NumPy's own division (by the count as an intp, in float64) instead of dividing by a
    float32 count (Note [batch norm's scalars])."""
    n = 2 ** 24 + 3
    g = BatchNormGeometry.create((1, 1, n), "NCHW")
    ax = ref_bn._axes(g)
    assert not ax.counts[np.dtype(np.float32)][1] and ax.counts[np.dtype(np.float64)][1]
    a = (np.arange(n, dtype=np.float32) % 977) * np.float32(0.37)
    a = a.reshape(1, 1, n)
    assert np.array_equal(ref_bn._mean(a, ax), a.mean(axis=g.reduce_axes))


def test_batchnorm_scalars_are_read_only_and_shared():
    eps, f, keep = ref_bn._scalars(np.dtype(np.float32), 1e-5, 0.1)
    assert (eps.dtype, f.dtype, keep.dtype) == (np.float32,) * 3
    assert keep == np.float32(1) - np.float32(0.1)
    assert ref_bn._scalars(np.dtype(np.float32), 1e-5, 0.1)[2] is keep
    with pytest.raises(ValueError):
        keep[...] = 0


def test_tiny_convolution_leaves_its_weight_alone():
    g = ConvGeometry.create((1, 1, 4, 4), (2, 1, 3, 3), 1, 1, 1, 1)
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 1, 4, 4)), rng.standard_normal((2, 1, 3, 3))
    w0 = w.copy()
    y, _ = ref_conv.conv_bias_act(x, w, None, g, "relu")
    assert np.array_equal(w, w0)
    want = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w0),
                                                 padding=1)).numpy()
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_autocast_check_agrees_with_torch():
    assert _autocast.enabled("cpu") is False
    args = (torch.randn(2), torch.randn(2))
    assert _autocast.cast_args("cpu", args) is args
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _autocast.enabled("cpu") is True
        assert _autocast.enabled("cuda") is torch.is_autocast_enabled("cuda")
        assert [a.dtype for a in _autocast.cast_args("cpu", args)] == [torch.bfloat16] * 2
        with torch.autocast("cpu", enabled=False):
            assert _autocast.enabled("cpu") is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_to_array_is_the_tensors_memory(dtype, grad):
    t = torch.zeros(2, 3, dtype=dtype, requires_grad=grad)
    a = _arrays.to_array(t)
    a[1, 2] = 5
    assert t[1, 2].item() == 5 and t.requires_grad is grad


def test_eager_checks_refuse_what_they_refused_before():
    x = torch.randn(2)
    assert _eager.takes_eager_path(x, None, torch.nn.Parameter(torch.randn(2)))
    assert not _eager.takes_eager_path(x, torch.Tensor._make_subclass(_Sub, torch.randn(2)))
    assert not _eager.needs_graph(x, None)
    assert _eager.needs_graph(None, torch.randn(2, requires_grad=True))
    with torch.no_grad():
        assert not _eager.needs_graph(torch.randn(2, requires_grad=True))


class _Sub(torch.Tensor):
    pass
