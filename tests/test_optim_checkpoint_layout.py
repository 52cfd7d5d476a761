"""An optimizer checkpoint holds each state buffer in the layout the model's checkpoint
holds its parameter (PyTorch's, channels-first), whatever the layer's storage order: a
model + optimizer checkpoint moves between NCHW and NHWC layers and training continues as
if uninterrupted. Oracles: the uninterrupted NCHW run, and torch.optim driven by
torch.nn.functional's float64 convolution gradients."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import convfuse as cf
from convfuse import Parameter
from convfuse.optim import SGD, Adam, AdamW

# Conv2d(3, 3, 3): storage and checkpoint shapes coincide ((3, 3, 3, 3) both), so a
# transposed buffer would load silently; Conv2d(3, 4, (3, 2)) differs in shape.
SPECS = [(3, 3, (3, 3)), (3, 4, (3, 2))]
MAKERS = {
    "sgd": lambda ps: SGD(ps, lr=0.05, momentum=0.9),
    "nesterov": lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda ps: Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw": lambda ps: AdamW(ps, lr=0.01),
}


def _model(layout):
    return cf.Sequential(*[cf.Conv2d(c, k, ks, padding=1, layout=layout, dtype="float64",
                                     device="cpu", seed=i)
                           for i, (c, k, ks) in enumerate(SPECS)])


def _data(rng, steps):
    xs = [rng.standard_normal((2, 3, 5, 4)) for _ in range(steps)]
    dys = [rng.standard_normal((2, 4, 5, 5)) for _ in range(steps)]
    return xs, dys


def _nhwc(a):
    return np.ascontiguousarray(a.transpose(0, 2, 3, 1))


def _train(model, opt, layout, xs, dys):
    for x, dy in zip(xs, dys):
        opt.zero_grad()
        if layout == "NHWC":
            model(_nhwc(x))
            model.backward(_nhwc(dy))
        else:
            model(x)
            model.backward(dy)
        opt.step()


def _checkpointed_run(first, second, kind, rng):
    """3 steps in layout `first`, checkpoint, 3 more in a fresh model + optimizer of layout
    `second`; returns the final state_dict and the checkpoint's optimizer state."""
    xs, dys = _data(rng, 6)
    a = _model(first)
    a.load_state_dict(_model("NCHW").state_dict())  # the same start in every layout
    opt_a = MAKERS[kind](a.parameters())
    _train(a, opt_a, first, xs[:3], dys[:3])
    model_sd, opt_sd = a.state_dict(), opt_a.state_dict()
    b = _model(second)
    opt_b = MAKERS[kind](b.parameters())
    b.load_state_dict(model_sd)
    opt_b.load_state_dict(opt_sd)
    _train(b, opt_b, second, xs[3:], dys[3:])
    return b.state_dict(), opt_sd


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize(("first", "second"), [("NHWC", "NCHW"), ("NCHW", "NHWC"),
                                               ("NHWC", "NHWC")])
def test_checkpoint_moves_between_layouts_and_training_continues(kind, first, second):
    reference, ref_opt = _checkpointed_run("NCHW", "NCHW", kind, np.random.default_rng(5))
    moved, moved_opt = _checkpointed_run(first, second, kind, np.random.default_rng(5))
    for key in reference:
        np.testing.assert_allclose(moved[key], reference[key], rtol=1e-12, atol=1e-13,
                                   err_msg=key)
    for i, entry in ref_opt["state"].items():
        for name, value in entry.items():
            np.testing.assert_allclose(moved_opt["state"][i][name], value, rtol=1e-12,
                                       atol=1e-13, err_msg=f"{i} {name}")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_nhwc_optimizer_state_is_torch_optims(kind):
    """The checkpoint's buffers are the ones torch.optim holds for the same training, in
    torch's (K, C, kh, kw) order."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    xs, dys = _data(rng, 3)
    model = _model("NHWC")
    start = model.state_dict()
    opt = MAKERS[kind](model.parameters())
    _train(model, opt, "NHWC", xs, dys)
    tw = {k: torch.tensor(v, requires_grad=True) for k, v in start.items()}
    names = list(start)
    ref = (torch.optim.SGD([tw[k] for k in names], lr=0.05, momentum=0.9) if kind == "sgd"
           else torch.optim.Adam([tw[k] for k in names], lr=0.01, weight_decay=0.01))
    for x, dy in zip(xs, dys):
        ref.zero_grad()
        h = torch.nn.functional.conv2d(torch.tensor(x), tw["0.weight"], tw["0.bias"], padding=1)
        y = torch.nn.functional.conv2d(h, tw["1.weight"], tw["1.bias"], padding=1)
        (y * torch.tensor(dy)).sum().backward()
        ref.step()
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in range(len(names)):
        for name, value in theirs[i].items():
            if name == "step":
                assert ours[i]["step"] == int(value)
                continue
            assert ours[i][name].shape == tuple(value.shape)
            np.testing.assert_allclose(ours[i][name], value.numpy(), rtol=1e-11, atol=1e-13)


def test_a_mismatched_buffer_names_the_checkpoint_layout():
    conv = cf.Conv2d(3, 4, (3, 2), layout="NHWC", dtype="float64", device="cpu")
    opt = SGD(conv.parameters(), lr=0.1, momentum=0.9)
    sd = opt.state_dict()
    assert sd["state"][0]["momentum_buffer"].shape == (4, 3, 3, 2)
    sd["state"][0]["momentum_buffer"] = np.zeros(conv.weight.shape)  # the storage order
    with pytest.raises(ValueError, match=r"^SGD: .*has shape \(4, 3, 2, 3\), the parameter's "
                                         r"checkpoint layout has \(4, 3, 3, 2\)"):
        opt.load_state_dict(sd)


def test_the_layout_travels_with_copies_and_assignments():
    """Pickle and deepcopy keep a weight's checkpoint layout; a Parameter assigned as a
    channels-last conv's weight takes it, and one assigned to a channels-first conv loses
    it."""
    conv = cf.Conv2d(3, 4, (3, 2), layout="NHWC", dtype="float64", device="cpu")
    opt = SGD(conv.parameters(), lr=0.1, momentum=0.9)
    conv.weight.grad[...] = np.arange(conv.weight.size).reshape(conv.weight.shape)
    opt.step()
    want = opt.state_dict()["state"][0]["momentum_buffer"]
    np.testing.assert_array_equal(want, conv.weight.grad.transpose(0, 3, 1, 2))
    for c, o in [copy.deepcopy((conv, opt)), pickle.loads(pickle.dumps((conv, opt)))]:
        assert c.weight.state_axes == (0, 3, 1, 2)
        assert o.state_dict()["state"][0]["momentum_buffer"].shape == (4, 3, 3, 2)
        np.testing.assert_array_equal(o.state_dict()["state"][0]["momentum_buffer"], want)
    w = Parameter(np.zeros((4, 3, 2, 3)))
    assert w.state_axes is None
    conv.weight = w
    assert w.state_axes == (0, 3, 1, 2)
    assert SGD([w], lr=0.1, momentum=0.9).state_dict()["state"][0][
        "momentum_buffer"].shape == (4, 3, 3, 2)
    plain = cf.Conv2d(3, 4, (3, 2), layout="NCHW", dtype="float64", device="cpu")
    moved = Parameter(np.zeros((4, 3, 3, 2)))
    moved.state_axes = (0, 3, 1, 2)
    plain.weight = moved
    assert moved.state_axes is None


def test_a_layer_pickled_before_state_axes_existed_learns_it_again():
    """A Parameter pickled by an older convfuse has no _state_axes slot, and unpickling a
    layer bypasses the weight's descriptor: the layer sets it when it is restored, so its
    optimizer state is saved in the checkpoint's layout, not in storage order."""
    conv = cf.Conv2d(3, 5, (3, 2), layout="NHWC", dtype="float64", device="cpu")
    del conv.weight._state_axes  # as an old pickle restores the Parameter
    assert conv.weight.state_axes is None
    for restored in (pickle.loads(pickle.dumps(conv)), copy.deepcopy(conv)):
        assert restored.weight.state_axes == (0, 3, 1, 2)
        opt = SGD(restored.parameters(), lr=0.1, momentum=0.9)
        opt.step()
        # the model's checkpoint order (5, 3, 3, 2), not the storage order (5, 3, 2, 3)
        assert opt.state_dict()["state"][0]["momentum_buffer"].shape == \
            restored.state_dict()["weight"].shape == (5, 3, 3, 2)


def test_state_axes_must_be_a_permutation_of_the_parameters_axes():
    p = Parameter(np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"^Parameter\.state_axes must be None or a "
                                         r"permutation of range\(2\), got \(0, 0\)"):
        p.state_axes = (0, 0)
    with pytest.raises(TypeError, match=r"^Parameter\.state_axes must be None or a tuple of int"):
        p.state_axes = [1, 0]
    assert p.state_axes is None
    p.state_axes = (1, 0)
    assert p.state_axes == (1, 0)
