"""fold_batchnorm: the folded evaluation model equals the unfolded one, runs one fused conv
per convolution and no BatchNorm, leaves its input untouched, and refuses training mode."""

from __future__ import annotations

import numpy as np
import pytest

import convfuse as cf
from convfuse import ops
from convfuse.models import ResNet, resnet18
from convfuse.nn import fold_batchnorm
from convfuse.nn.batchnorm import _BatchNorm
from convfuse.nn.conv import _ConvNd

F64 = {"dtype": "float64", "device": "cpu"}


def randomize_bns(model, rng):
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            n = m.num_features
            if m.weight is not None:
                m.weight.data[...] = rng.uniform(0.5, 1.5, n)
                m.bias.data[...] = rng.standard_normal(n) * 0.2
            if m.running_mean is not None:
                m.running_mean[...] = rng.standard_normal(n) * 0.2
                m.running_var[...] = rng.uniform(0.3, 2.0, n)
    return model


def count_calls(monkeypatch, module, names):
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(module, name)

        def spy(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(module, name, spy)
    return counts


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_resnet18_folded_equals_eval_and_runs_one_call_per_conv(rng, layout, monkeypatch):
    model = randomize_bns(resnet18(num_classes=6, layout=layout, **F64, seed=0), rng).eval()
    before = model.state_dict()
    shape = (2, 3, 32, 32) if layout == "NCHW" else (2, 32, 32, 3)
    x = rng.standard_normal(shape)
    expect = model(x)
    folded = fold_batchnorm(model)
    assert isinstance(folded, ResNet) and not folded.training
    assert not any(isinstance(m, _BatchNorm) for m in folded.modules())
    convs = [m for m in folded.modules() if isinstance(m, _ConvNd)]
    assert len(convs) == 20 and all(c.bias is not None for c in convs)
    counts = count_calls(monkeypatch, ops, ["conv_bias_act", "batchnorm_forward_inference",
                                            "batchnorm_forward_training"])
    got = folded(x)
    np.testing.assert_allclose(got, expect, rtol=1e-10, atol=1e-12)
    assert counts == {"conv_bias_act": 21, "batchnorm_forward_inference": 0,  # + fc
                      "batchnorm_forward_training": 0}
    # The input model is untouched: same state, same mode, its BatchNorms still there.
    after = model.state_dict()
    assert list(after) == list(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    assert isinstance(model.bn1, cf.BatchNorm2d) and not model.training
    assert model.conv1.bias is None and model.bn1.activation == "relu"
    np.testing.assert_array_equal(model(x), expect)
    # ... and shares no array with the folded model.
    folded.fc.weight.data[...] = 0
    assert np.abs(model.fc.weight.data).sum() > 0


def test_folded_block_activation_and_residual_moved_onto_the_conv(rng):
    model = randomize_bns(ResNet((1, 1), (2, 3), num_classes=2, in_channels=1, stem="small",
                                 **F64, seed=1), rng).eval()
    folded = fold_batchnorm(model)
    block = folded.layer2[0]
    assert isinstance(block, cf.Residual)
    assert [type(m).__name__ for m in block.body] == ["Conv2d", "Conv2d"]
    assert block.body[0].activation == "relu" and block.body[1].activation == "relu"
    assert [type(m).__name__ for m in block.shortcut] == ["Conv2d"]
    assert block.shortcut[0].activation == "identity"
    x = rng.standard_normal((3, 1, 6, 6))
    np.testing.assert_allclose(folded(x), model(x), rtol=1e-11, atol=1e-12)
    # The folded model is still a model: its backward runs (gradients of the fused form).
    folded.needs_input_grad = True
    assert folded.backward(np.ones((3, 2))).shape == x.shape


def test_folding_formula_with_conv_bias_and_affine_off(rng):
    conv = cf.Conv2d(2, 3, 3, padding=1, bias=True, **F64, seed=2)
    norm = cf.BatchNorm2d(3, affine=False, eps=1e-3, **F64)
    norm.running_mean[...] = [0.5, -1.0, 2.0]
    norm.running_var[...] = [4.0, 0.25, 1.0]
    seq = cf.Sequential(conv, norm).eval()
    folded = fold_batchnorm(seq)
    (fconv,) = folded.layers
    s = 1 / np.sqrt(norm.running_var + 1e-3)
    np.testing.assert_allclose(fconv.weight.data, conv.weight.data * s[:, None, None, None])
    np.testing.assert_allclose(fconv.bias.data, (conv.bias.data - norm.running_mean) * s)
    x = rng.standard_normal((2, 2, 5, 5))
    np.testing.assert_allclose(folded(x), seq(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("which", ["bias=False", "weight=None"])
def test_a_batch_norm_with_one_affine_parameter_folds_it(rng, which):
    """A weight without a bias (bias=False, torch 2.13's) or a bias without a weight (one
    assigned None): the one there is folds in (the weight was dropped when the bias was
    missing, 2.0 off)."""
    conv = cf.Conv2d(2, 3, 3, padding=1, **F64, seed=2)
    norm = cf.BatchNorm2d(3, bias=which != "bias=False", **F64)
    if which == "weight=None":
        norm.bias.data[...] = [0.3, -0.2, 1.0]
        norm.weight = None
    else:
        norm.weight.data[...] = [0.5, 2.0, -1.0]
    norm.running_mean[...] = [0.5, -1.0, 2.0]
    norm.running_var[...] = [4.0, 0.25, 1.0]
    seq = cf.Sequential(conv, norm).eval()
    x = rng.standard_normal((2, 2, 5, 5))
    np.testing.assert_allclose(fold_batchnorm(seq)(x), seq(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_sequential_chains_fold_and_absorb_a_following_activation(rng, layout):
    kw = {"layout": layout, **F64}
    seq = cf.Sequential(
        cf.Conv2d(1, 4, 3, padding=1, bias=False, seed=3, **kw), cf.BatchNorm2d(4, **kw),
        cf.ReLU(),
        cf.Conv2d(4, 4, 3, padding=1, seed=4, **kw), cf.BatchNorm2d(4, activation="tanh", **kw),
        cf.MaxPool2d(2, layout=layout),
        cf.BatchNorm2d(4, **kw),                      # no conv before it: stays
        cf.Conv2d(4, 4, 1, activation="relu", seed=5, **kw), cf.BatchNorm2d(4, **kw),  # stays
        cf.Conv2d(4, 4, 1, seed=6, **kw),
        cf.BatchNorm2d(4, track_running_stats=False, **kw),  # batch statistics: stays
        cf.Flatten(), cf.Linear(16, 2, **F64, seed=7),
    )
    randomize_bns(seq, rng).eval()
    folded = fold_batchnorm(seq)
    kinds = [type(m).__name__ for m in folded.layers]
    assert kinds == ["Conv2d", "Conv2d", "MaxPool2d", "BatchNorm2d", "Conv2d", "BatchNorm2d",
                     "Conv2d", "BatchNorm2d", "Flatten", "Linear"]
    assert folded[0].activation == "relu" and folded[1].activation == "tanh"
    x = rng.standard_normal((3, 1, 4, 4) if layout == "NCHW" else (3, 4, 4, 1))
    np.testing.assert_allclose(folded(x), seq(x), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("rank,conv_layout", [(1, "NCW"), (1, "NWC"), (3, "NCDHW"),
                                               (3, "NHWC")])
def test_conv1d_and_conv3d_chains_fold(rng, rank, conv_layout):
    conv_cls = {1: cf.Conv1d, 3: cf.Conv3d}[rank]
    bn_cls = {1: cf.BatchNorm1d, 3: cf.BatchNorm3d}[rank]
    last = conv_layout in ("NWC", "NHWC")
    seq = randomize_bns(cf.Sequential(
        conv_cls(2, 3, 3, padding=1, bias=False, layout=conv_layout, seed=11, **F64),
        bn_cls(3, activation="relu", layout="NHWC" if last else "NCHW", **F64)), rng).eval()
    folded = fold_batchnorm(seq)
    assert [type(m) for m in folded.layers] == [conv_cls]
    spatial = (5,) * rank
    x = rng.standard_normal((2, *spatial, 2) if last else (2, 2, *spatial))
    np.testing.assert_allclose(folded(x), seq(x), rtol=1e-12, atol=1e-13)


def test_sequential_with_a_residual_passes_it_to_the_folded_conv(rng):
    seq = randomize_bns(cf.Sequential(cf.Conv2d(2, 2, 3, padding=1, seed=8, **F64),
                                      cf.BatchNorm2d(2, activation="relu", **F64)), rng).eval()
    folded = fold_batchnorm(seq)
    x, r = rng.standard_normal((2, 2, 4, 4)), rng.standard_normal((2, 2, 4, 4))
    np.testing.assert_allclose(folded(x, residual=r), seq(x, residual=r), rtol=1e-12,
                               atol=1e-13)


def test_residual_and_custom_modules_fold(rng):
    class Net(cf.Module):  # an unknown module: its children are folded in place
        def __init__(self):
            self.block = cf.Residual(
                cf.Sequential(cf.Conv2d(2, 2, 3, padding=1, bias=False, seed=9, **F64),
                              cf.BatchNorm2d(2, **F64)),
                shortcut=cf.Sequential(cf.Conv2d(2, 2, 1, bias=False, seed=10, **F64),
                                       cf.BatchNorm2d(2, **F64)),
                activation="relu")
            self.head = cf.BatchNorm2d(2, **F64)
            self.device = "cpu"

        def __call__(self, x):
            return self.head(self.block(x))

    net = randomize_bns(Net(), rng).eval()
    folded = fold_batchnorm(net)
    assert isinstance(folded, Net) and isinstance(folded.head, cf.BatchNorm2d)
    assert [type(m).__name__ for m in folded.block.body] == ["Conv2d"]
    assert folded.block.body[0].activation == "relu"
    x = rng.standard_normal((2, 2, 4, 4))
    np.testing.assert_allclose(folded(x), net(x), rtol=1e-12, atol=1e-13)
    assert isinstance(net.block.body[1], cf.BatchNorm2d)  # the original keeps its BatchNorm


def test_float32_fold_is_close(rng):
    model = randomize_bns(resnet18(num_classes=3, device="cpu", seed=4), rng).eval()
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    folded = fold_batchnorm(model)
    assert folded.conv1.weight.dtype == np.float32
    np.testing.assert_allclose(folded(x), model(x), rtol=1e-4, atol=1e-4)


def test_refuses_training_mode_and_non_layers():
    model = ResNet((1,), (2,), num_classes=2, stem="small", **F64, seed=0)
    with pytest.raises(ValueError, match=r"fold_batchnorm: the model is in training mode .*"
                                         r"call model\.eval\(\) first"):
        fold_batchnorm(model)
    model.eval()
    model.layer1[0].bn2.train()
    with pytest.raises(ValueError, match=r"'layer1\.0\.bn2'"):
        fold_batchnorm(model)
    with pytest.raises(TypeError, match="fold_batchnorm: model must be a convfuse layer"):
        fold_batchnorm({"conv": 1})


def test_forward_context_is_not_copied(rng):
    model = ResNet((1,), (2,), num_classes=2, stem="small", **F64, seed=0).eval()
    model(rng.standard_normal((1, 3, 4, 4)))
    folded = fold_batchnorm(model)
    assert all(getattr(m, "_ctx", None) is None for m in folded.modules())
    with pytest.raises(cf.BackwardBeforeForwardError):
        folded.backward(np.ones((1, 2)))
