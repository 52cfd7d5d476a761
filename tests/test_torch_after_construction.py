"""convfuse.torch layers whose attributes, parameters or buffers are changed after
construction (after a first call too), and exotic arguments, against torch.nn doing the
same in float64: torch.nn reads its state at every call, so a converted layer must too,
and refuse what it cannot run before anything changes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ct = pytest.importorskip("convfuse.torch")
nn = torch.nn

D = torch.float64


def _pair(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(torch.nn's module, its converted copy), float64, the same values."""
    ref = module.to(D)
    return ref, ct.convert(copy.deepcopy(ref))


def _grads(m: torch.nn.Module, x: torch.Tensor, **kw: object) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_(True)
    y = m(x, **kw)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=D).reshape(y.shape))
    grads = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
    return (y.detach(), x.grad, *grads)


def _same(a: tuple, b: tuple) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert (u is None) == (v is None)
        if u is not None:
            torch.testing.assert_close(u, v, rtol=1e-10, atol=1e-10)


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


# -- batch norm ----------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
def test_a_batchnorm_without_weight_gives_its_bias_a_gradient(training: bool) -> None:
    ref, bn = _pair(nn.BatchNorm2d(3))
    for m in (ref, bn):
        m.weight = None  # torch.nn takes it: the bias alone is applied
        nn.init.constant_(m.bias, 0.7)
        m.train(training)
    x = torch.randn(4, 3, 5, 5, dtype=D)
    got, want = _grads(bn, x), _grads(ref, x)
    assert got[-1] is not None and got[-1].abs().sum() > 0  # the bias's gradient
    _same(got, want)
    _same(tuple(_state(bn).values()), tuple(_state(ref).values()))


def test_a_converted_batchnorm_without_weight_trains_its_bias() -> None:
    ref = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()).to(D)
    ref[1].weight = None
    model = ct.convert(copy.deepcopy(ref))
    assert type(model[1]).__module__.startswith("convfuse")
    x = torch.randn(2, 2, 6, 6, dtype=D)
    _same(_grads(model, x), _grads(ref, x))


@pytest.mark.parametrize("change, error, match", [
    (lambda bn: setattr(bn, "momentum", 1.5), ValueError, r"momentum must lie in \[0, 1\]"),
    (lambda bn: setattr(bn, "momentum", float("nan")), ValueError, "momentum must lie"),
    (lambda bn: setattr(bn, "momentum", "x"), TypeError, "momentum must be a number or None"),
    (lambda bn: setattr(bn, "eps", float("inf")), ValueError, "eps must be a finite number"),
    (lambda bn: setattr(bn, "eps", "x"), ValueError, "eps must be a finite number"),
    (lambda bn: setattr(bn, "running_mean", torch.zeros(3, dtype=D)), ct.InputShapeError,
     r"running_mean has shape \(3,\), the input has 4 channels"),
    (lambda bn: setattr(bn, "weight", nn.Parameter(torch.ones(5, dtype=D))),
     ct.InputShapeError, "input has 4 channels, the layer expects 5"),
])
@pytest.mark.parametrize("first_call", [False, True])
def test_a_refused_batchnorm_call_changes_nothing(change, error, match,
                                                  first_call: bool) -> None:
    bn = ct.BatchNorm2d(4, dtype=D)
    x = torch.randn(2, 4, 3, 3, dtype=D)
    if first_call:  # the signature is known: the changed attribute must still be checked
        bn(x)
    change(bn)
    before = _state(bn)
    with pytest.raises(error, match=rf"^BatchNorm2d: .*{match}"):
        bn(x)
    after = _state(bn)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("which", ["input", "residual"])
def test_a_sparse_tensor_is_refused_before_the_count_moves(which: str) -> None:
    bn = ct.BatchNorm2d(4, dtype=D)
    x = torch.randn(2, 4, 3, 3, dtype=D)
    args = (x.to_sparse(), None) if which == "input" else (x, x.to_sparse())
    with pytest.raises(ct.InputTypeError, match=rf"^BatchNorm2d: {which} has layout "
                                                r"torch.sparse_coo"):
        bn(*args)
    assert int(bn.num_batches_tracked) == 0


@pytest.mark.parametrize("attr, start, end", [("momentum", 0.1, 0.9), ("eps", 1e-5, 10.0)])
def test_a_tensor_hyperparameter_changed_in_place_is_read_again(attr: str, start: float,
                                                                end: float) -> None:
    ref, bn = _pair(nn.BatchNorm2d(3))
    x = torch.randn(4, 3, 5, 5, dtype=D)
    value = torch.tensor(start, dtype=D)
    for m in (ref, bn):
        setattr(m, attr, value)  # one tensor, shared, as a schedule might hold it
    _same((bn(x),), (ref(x),))
    value.fill_(end)
    for training in (True, False):
        ref.train(training), bn.train(training)
        _same((bn(x),), (ref(x),))
        _same(tuple(_state(bn).values()), tuple(_state(ref).values()))


@pytest.mark.parametrize("affine, track", [(True, True), (False, False)])
def test_a_batchnorm_takes_its_channel_count_from_its_tensors(affine: bool,
                                                              track: bool) -> None:
    ref, bn = _pair(nn.BatchNorm2d(3, affine=affine, track_running_stats=track))
    if affine:  # surgery: five channels now, num_features stale (as torch.nn allows)
        for m in (ref, bn):
            m.weight = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=D))
            m.bias = nn.Parameter(torch.linspace(-1, 1, 5, dtype=D))
            m.running_mean = torch.zeros(5, dtype=D)
            m.running_var = torch.ones(5, dtype=D)
    # without per-channel tensors torch.nn takes any count
    x = torch.randn(4, 5, 3, 3, dtype=D)
    for training in (True, False):
        ref.train(training), bn.train(training)
        _same(_grads(bn, x), _grads(ref, x))
    with pytest.raises(ct.InputShapeError) if affine else _no_error():
        bn(torch.randn(4, 3, 3, 3, dtype=D))


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


# -- convolutions --------------------------------------------------------------------------

@pytest.mark.parametrize("make, attr, value", [
    (lambda: nn.Conv2d(4, 4, 3), "stride", np.int64(2)),
    (lambda: nn.Conv2d(4, 4, 3), "dilation", np.int64(2)),
    (lambda: nn.ConvTranspose2d(4, 4, 3), "stride", np.int64(2)),
    (lambda: nn.ConvTranspose2d(4, 4, 3, stride=2), "output_padding", (np.int64(1),) * 2),
    (lambda: nn.ConvTranspose2d(4, 4, 3), "padding", (np.int64(1),) * 2),
])
def test_a_numpy_integer_assigned_after_a_call_is_used(make, attr, value) -> None:
    ref, conv = _pair(make())
    x = torch.randn(1, 4, 6, 6, dtype=D)
    _same((conv(x),), (ref(x),))
    for m in (ref, conv):
        setattr(m, attr, value)  # torch.nn wants a tuple for the transposed padding
    _same(_grads(conv, x), _grads(ref, x))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_swapped_weight_sets_the_channel_counts(transposed: bool) -> None:
    # the grey-image adaptation: the RGB kernel summed over its input channels, in_channels
    # left at 3 (torch.nn reads the counts off the weight)
    layer = nn.ConvTranspose2d(3, 4, 3) if transposed else nn.Conv2d(3, 4, 3)
    ref, conv = _pair(layer)
    for m in (ref, conv):
        w = m.weight.detach()
        m.weight = nn.Parameter(w.sum(0, keepdim=True) if transposed
                                else w.sum(1, keepdim=True))
    x = torch.randn(2, 1, 5, 5, dtype=D)
    _same(_grads(conv, x), _grads(ref, x))
    with pytest.raises(ct.InputShapeError, match="input has 3 channels, the layer expects 1"):
        conv(torch.randn(2, 3, 5, 5, dtype=D))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_stale_bias_after_a_weight_swap_is_refused_naming_the_layer(transposed: bool) -> None:
    conv = ct.ConvTranspose2d(3, 4, 3) if transposed else ct.Conv2d(3, 4, 3)
    shape = (3, 6, 3, 3) if transposed else (6, 3, 3, 3)
    conv.weight = nn.Parameter(torch.randn(shape))  # six output channels, the bias four
    name = type(conv).__name__
    with pytest.raises(ct.InputShapeError, match=rf"^{name}: bias has shape \(4,\), the "
                                                 r"weight .* gives 6 output channels"):
        conv(torch.randn(1, 3, 5, 5))


def test_a_residual_follows_a_weight_with_other_output_channels() -> None:
    conv = ct.Conv2d(3, 4, 3, dtype=D)
    conv.weight = nn.Parameter(torch.randn(6, 3, 3, 3, dtype=D))
    conv.bias = nn.Parameter(torch.randn(6, dtype=D))
    x, r = torch.randn(2, 3, 5, 5, dtype=D), torch.randn(2, 6, 3, 3, dtype=D)
    want = torch.nn.functional.conv2d(x, conv.weight, conv.bias) + r
    torch.testing.assert_close(conv(x, residual=r), want)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_padding_changed_after_construction_in_a_padding_mode(mode: str) -> None:
    # torch.nn pads by _reversed_padding_repeated_twice in these modes, whatever `padding`
    # says now
    ref, conv = _pair(nn.Conv2d(2, 2, 3, padding=1, padding_mode=mode))
    x = torch.randn(1, 2, 6, 6, dtype=D)
    for m in (ref, conv):
        m.padding = (7, 7)
    _same(_grads(conv, x), _grads(ref, x))


# -- arguments convfuse cannot take: typed errors naming the layer -------------------------

@pytest.mark.parametrize("make", [lambda: ct.Conv2d(2, 2, 3), lambda: ct.ConvTranspose2d(2, 2, 3)])
def test_none_and_sparse_inputs_are_refused_naming_the_layer(make) -> None:
    layer = make()
    name = type(layer).__name__
    with pytest.raises(TypeError, match=rf"^{name}: input must be a torch.Tensor, got NoneType"):
        layer(None)
    x = torch.randn(1, 2, 5, 5)
    with pytest.raises(ct.InputTypeError, match=rf"^{name}: input has layout torch.sparse_coo"):
        layer(x.to_sparse())
    y = layer(x)
    with pytest.raises(ct.InputTypeError,
                       match=rf"^{name}: residual has layout torch.sparse_coo"):
        layer(x, residual=y.detach().to_sparse())


def test_a_bare_int_output_size_is_refused_naming_the_argument() -> None:
    up = ct.ConvTranspose2d(2, 2, 3, stride=2)
    with pytest.raises(TypeError, match=r"^ConvTranspose2d: output_size must be a sequence"):
        up(torch.randn(1, 2, 4, 4), output_size=9)


def test_a_transposed_padding_error_names_the_layer_once() -> None:
    up = ct.ConvTranspose2d(2, 2, 3, stride=2)
    up.output_padding = (1, 1, 1)
    with pytest.raises(ValueError, match=r"^ConvTranspose2d: output_padding must be") as info:
        up(torch.randn(1, 2, 4, 4))
    assert str(info.value).count("ConvTranspose2d:") == 1


@pytest.mark.parametrize("make, error, match", [
    (lambda: ct.Conv2d(1, 1, 3, padding=2**31), ct.InputShapeError, "beyond cuDNN's 32-bit"),
    (lambda: ct.Conv2d(1, 1, 3, padding=2**62), ct.InputShapeError, "beyond cuDNN's 32-bit"),
    (lambda: ct.Conv2d(1, 1, 3, stride=2**63), ValueError, r"must be >= 1 and < 2\*\*31"),
    (lambda: ct.ConvTranspose2d(1, 1, 3, stride=2**30), ct.InputShapeError,
     "beyond cuDNN's 32-bit"),
    (lambda: ct.ConvTranspose2d(1, 1, 3, stride=2**62), ValueError,
     r"must be >= 1 and < 2\*\*31"),
])
def test_a_geometry_beyond_32_bits_is_refused_before_any_allocation(make, error,
                                                                      match) -> None:
    layer = make()
    with pytest.raises(error, match=rf"^{type(layer).__name__}: .*{match}"):
        layer(torch.randn(1, 1, 4, 4))


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kernel", [1, 3])
def test_a_weight_gradient_has_the_weights_strides(transposed: bool, kernel: int) -> None:
    # model.to(memory_format=channels_last) gives a 1x1 kernel strides (C, 1, C, C); the
    # engine's gradient is (C, 1, 1, 1), the same memory. torch.nn keeps the parameter's, and
    # DDP's bucket views expect them (it warns and copies at every step otherwise)
    layer = nn.ConvTranspose2d(4, 8, kernel) if transposed else nn.Conv2d(4, 8, kernel)
    ref, conv = _pair(nn.Sequential(layer).to(memory_format=torch.channels_last))
    x = torch.randn(2, 4, 5, 5, dtype=D).contiguous(memory_format=torch.channels_last)
    _same(_grads(conv, x), _grads(ref, x))
    assert conv[0].weight.grad.stride() == ref[0].weight.grad.stride() == conv[0].weight.stride()


@pytest.mark.parametrize("make", [lambda: ct.Conv2d(3, 4, 3), lambda: ct.BatchNorm2d(3),
                                  lambda: ct.ConvTranspose2d(3, 4, 3)],
                         ids=["Conv2d", "BatchNorm2d", "ConvTranspose2d"])
def test_an_assigned_activation_is_checked_at_the_assignment(make):
    """A bad name assigned after construction is refused there, naming the layer (it was
    refused by the op at the next call, after a batch norm had counted that call; a list
    raised a bare unhashable TypeError); a good one takes effect at the next call."""
    m = make()
    name = type(m).__name__
    with pytest.raises(ValueError, match=rf"^{name}: unknown activation 'foo'"):
        m.activation = "foo"
    with pytest.raises(TypeError, match=rf"^{name}: activation must be a str or None, got "
                                        r"list \['relu'\]"):
        m.activation = ["relu"]
    with pytest.raises(TypeError, match=rf"^{name}: activation must be a str or None, got "
                                        r"ReLU"):
        m.activation = nn.ReLU()  # nn.Module's __setattr__ would register it as a child
    assert m.activation == "identity" and not dict(m.named_children())
    with pytest.raises(TypeError, match=rf"^{name}: activation must be a str or None"):
        type(m)(3, 4, 3, activation=nn.ReLU()) if name != "BatchNorm2d" else \
            type(m)(3, activation=nn.ReLU())
    m.activation = "ReLU"
    assert m.activation == "relu"
    x = torch.linspace(-2, 2, 2 * 3 * 5 * 5).reshape(2, 3, 5, 5)
    assert (m(x) >= 0).all()
    if name == "BatchNorm2d":
        assert int(m.num_batches_tracked) == 1
