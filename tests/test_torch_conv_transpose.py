"""convfuse.torch.ConvTranspose1d/2d/3d against torch.nn.ConvTranspose*d on the CPU, with
the same constructor arguments (positional, torch.nn's order), the same state dict and the
same inputs: PyTorch's catalogue cases (common_nn's ConvTranspose entries and module_db's
module_inputs_torch_nn_ConvNd(transposed=True), written out here because module_db needs
`expecttest`), in float32 and float64, with variants (channels_last, non-contiguous input,
no_grad, inference_mode, frozen weights, repeated calls with other shapes, unbatched
inputs, output_size=, an in-place op on the output, also of a channels_last input: outputs
are ordinary tensors, not views); gradcheck; convert(); torch.compile."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

import convfuse.ops.reference.conv as ref_conv  # noqa: E402
import convfuse.torch as ct  # noqa: E402
from convfuse.torch import convert  # noqa: E402

NN = {1: torch.nn.ConvTranspose1d, 2: torch.nn.ConvTranspose2d, 3: torch.nn.ConvTranspose3d}
CT = {1: ct.ConvTranspose1d, 2: ct.ConvTranspose2d, 3: ct.ConvTranspose3d}

#: (rank, constructor args, constructor kwargs, input shape)
CATALOGUE = [
    # common_nn
    (1, (3, 4), dict(kernel_size=3, stride=(3,), padding=1, output_padding=(1,)), (1, 3, 7)),
    (1, (3, 4, 3, 2, 1, 1, 1, False), {}, (1, 3, 6)),
    (1, (3, 4, 3, 2, 1, 1, 1, True, 2), {}, (1, 3, 6)),
    (1, (4, 6, 3), dict(stride=(3,), padding=1, output_padding=(1,), groups=2), (2, 4, 7)),
    (2, (3, 4, 3, (3, 2), 1, (1, 1)), {}, (1, 3, 7, 6)),
    (2, (3, 4, 3, (2, 3), 1, (1, 1), 1, False, (2, 2)), {}, (1, 3, 6, 7)),
    (2, (3, 4, 3, (2, 3), 1, (1, 1), 1, False), {}, (1, 3, 6, 7)),
    (2, (2, 4, (2, 3)), dict(groups=2), (1, 2, 4, 5)),
    (3, (2, 3, (2, 3, 2)), {}, (1, 2, 4, 5, 4)),
    (3, (2, 3, (2, 3, 2), 1, 0, 0, 1, True, (2, 2, 2)), {}, (1, 2, 4, 5, 4)),
    # module_db: C_in 4, C_out 5, kernel 3, batched and unbatched
    *[(n, (4, 5, 3), {}, shape) for n in (1, 2, 3)
      for shape in ((2, 4, *range(3, 3 + n)), (4, *range(3, 3 + n)))],
    # output_padding >= stride (allowed by a larger dilation)
    (2, (4, 6, 3, 1, 1, 1, 2, True, 2), {}, (2, 4, 5, 4)),
]
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _pair(rank, args, kwargs, dtype, activation=None):
    torch.manual_seed(0)
    ref = NN[rank](*args, **kwargs, dtype=dtype)
    ours = CT[rank](*args, **kwargs, dtype=dtype, activation=activation)
    assert ours.state_dict().keys() == ref.state_dict().keys()
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _run(module, x, variant, output_size=None):
    """Forward (and backward when autograd records): (output, input grad, param grads)."""
    x = x.detach().clone()
    if variant.startswith("channels_last") and x.dim() in (4, 5):
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    if variant == "non_contiguous":
        x = torch.cat([x, x], dim=-1)[..., ::2]
    if variant in ("no_grad", "inference_mode"):
        ctx = torch.no_grad() if variant == "no_grad" else torch.inference_mode()
        with ctx:
            return module(x, output_size) if output_size else module(x), None, []
    if variant == "frozen":
        for p in module.parameters():
            p.requires_grad_(False)
    x.requires_grad_()
    y = module(x, output_size) if output_size else module(x)
    if variant.endswith("inplace"):
        y = y.mul_(2).add_(1)
    torch.manual_seed(1)
    y.backward(torch.randn(y.shape, dtype=y.dtype))  # logical order, whatever the strides
    return y, x.grad, [p.grad for p in module.parameters() if p.requires_grad]


VARIANTS = ["plain", "channels_last", "non_contiguous", "no_grad", "inference_mode", "frozen",
            "inplace", "channels_last_inplace"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CATALOGUE, ids=lambda c: f"{c[0]}d-{c[1]}-{c[3]}")
def test_catalogue_case_matches_torch_nn(case, variant, dtype):
    rank, args, kwargs, shape = case
    ref, ours = _pair(rank, args, kwargs, dtype)
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype)
    y_ref, dx_ref, g_ref = _run(ref, x, variant)
    y, dx, g = _run(ours, x, variant)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    if dx_ref is not None:
        torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    assert len(g) == len(g_ref)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL[dtype])


def test_repeated_calls_with_other_shapes_and_output_size():
    ref, ours = _pair(2, (3, 4, 3, 2, 1), {}, torch.float64)
    for shape, size in (((2, 3, 5, 5), None), ((1, 3, 4, 7), [8, 14]), ((3, 4, 6), [8, 11]),
                        ((2, 3, 5, 5), [2, 4, 10, 9])):
        x = torch.randn(shape, dtype=torch.float64)
        y_ref, dx_ref, g_ref = _run(ref, x, "plain", size)
        y, dx, g = _run(ours, x, "plain", size)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="ConvTranspose2d: requested an output size"):
        ours(torch.randn(1, 3, 4, 4, dtype=torch.float64), [20, 20])


def test_output_size_tensors_are_read_at_each_call():
    """0-d integer tensors in output_size are keyed by value: filled in place between
    calls, the second call gets the new size, as torch.nn's, on a fresh layer too."""
    ref, ours = _pair(2, (3, 4, 3, 2, 1), {}, torch.float64)
    x = torch.randn(1, 3, 5, 5, dtype=torch.float64)
    h, w = torch.tensor(9), torch.tensor(9)
    for size in (9, 10):
        h.fill_(size)
        w.fill_(size)
        assert ours(x, [h, w]).shape == ref(x, [h, w]).shape == (1, 4, size, size)
        torch.testing.assert_close(ours(x, [h, w]), ref(x, [h, w]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("act", ["relu", "silu", "tanh", "gelu", "leaky_relu"])
def test_activation_and_residual_gradcheck(act):
    torch.manual_seed(0)
    m = ct.ConvTranspose2d(2, 4, 3, 2, 1, 1, 2, dtype=torch.float64, activation=act)
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    r = torch.randn(1, 4, 6, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w, b: m(x, residual=r), (x, r, m.weight, m.bias))
    nn_act = {"relu": torch.relu, "silu": torch.nn.functional.silu, "tanh": torch.tanh,
              "gelu": torch.nn.functional.gelu,
              "leaky_relu": torch.nn.functional.leaky_relu}[act]
    ref = torch.nn.ConvTranspose2d(2, 4, 3, 2, 1, 1, 2, dtype=torch.float64)
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x, residual=r), nn_act(ref(x) + r))


def test_constructor_errors_mirror_torch_nn():
    for kwargs, pattern in ((dict(padding_mode="reflect"), 'Only "zeros" padding mode'),
                            (dict(groups=2), "in_channels must be divisible by groups")):
        with pytest.raises(ValueError, match=pattern):
            torch.nn.ConvTranspose2d(3, 4, 3, **kwargs)
        with pytest.raises(ValueError, match=pattern):
            ct.ConvTranspose2d(3, 4, 3, **kwargs)
    with pytest.raises(TypeError):  # activation is keyword-only
        ct.ConvTranspose2d(3, 4, 3, 1, 0, 0, 1, True, 1, "zeros", None, None, "relu")
    with pytest.raises(TypeError, match=r"ConvTranspose2d: dtype torch\.int64"):
        ct.ConvTranspose2d(3, 4, 3, dtype=torch.int64)
    m = ct.ConvTranspose2d(3, 4, 3, stride=1, output_padding=1)
    with pytest.raises(ValueError, match="output_padding must be smaller than either"):
        m(torch.randn(1, 3, 4, 4))


@pytest.mark.parametrize("rank, args, kwargs", [
    (1, (2, 4, 3), {}),
    (2, (2, 4, 3), dict(stride=2, padding=1, output_padding=1, dilation=2, groups=2,
                        bias=False)),
    (2, (3, 6, (2, 3)), dict(stride=(1, 2), output_padding=(0, 1))),
    (3, (2, 2, 1), dict(padding=(0, 1, 0), dilation=(1, 1, 3), groups=2)),
])
def test_repr_is_torch_nns_plus_the_activation(rank, args, kwargs):
    """torch.nn's text, field for field and in its order (dilation before output_padding),
    then the activation."""
    text = repr(NN[rank](*args, **kwargs))
    assert repr(CT[rank](*args, **kwargs)) == text[:-1] + ", activation='identity')"
    assert repr(CT[rank](*args, **kwargs, activation="relu")).endswith(
        ", activation='relu')")


def test_more_constructor_refusals_name_the_layer_and_argument():
    with pytest.raises(ValueError, match=r"^ConvTranspose2d: out_channels must be divisible by "
                                         r"groups$"):
        ct.ConvTranspose2d(4, 6, 3, groups=4)
    # torch.nn takes these and fails (or misbehaves) only later; convfuse refuses at once
    with pytest.raises(ValueError, match=r"^ConvTranspose2d: padding must be an int or 2 "
                                         r"ints, got 'same'$"):
        ct.ConvTranspose2d(1, 1, 3, padding="same")
    with pytest.raises(ValueError, match=r"^ConvTranspose1d: padding and output_padding must "
                                         r"be >= 0, got \(-1,\), \(0,\)$"):
        ct.ConvTranspose1d(1, 1, 3, padding=-1)
    with pytest.raises(ValueError, match=r"^ConvTranspose3d: unknown activation 'mish': "
                                         r"expected None or one of identity, relu,"):
        ct.ConvTranspose3d(1, 1, 3, activation="mish")


@pytest.mark.parametrize("unbatched", [False, True])
def test_an_empty_output_is_refused_as_torch_nn_refuses_it(unbatched):
    """torch.nn raises RuntimeError ("Output size is too small"); convfuse's InputShapeError
    is that and a ValueError, before anything runs."""
    shape = (1, 4, 4) if unbatched else (1, 1, 4, 4)
    x = torch.randn(shape)
    with pytest.raises(RuntimeError, match="too small"):
        torch.nn.ConvTranspose2d(1, 1, 3, padding=5)(x)
    m = ct.ConvTranspose2d(1, 1, 3, padding=5)
    out = "(1, -4, -4)" if unbatched else "(1, 1, -4, -4)"
    for kind in (RuntimeError, ValueError):
        with pytest.raises(kind, match=rf"^ConvTranspose2d: the output would be empty: input "
                                       rf"{re.escape(str(shape))} gives {re.escape(out)}$"):
            m(x)


def test_residual_refusals():
    m = ct.ConvTranspose2d(2, 3, 3, stride=2)
    x = torch.randn(1, 2, 4, 4)  # output (1, 3, 9, 9)
    with pytest.raises(TypeError, match=r"^ConvTranspose2d: residual must be a torch\.Tensor or "
                                        r"None, got ndarray$"):
        m(x, residual=torch.zeros(1, 3, 9, 9).numpy())
    with pytest.raises(ValueError, match=r"^ConvTranspose2d: residual has shape \(1, 3, 8, 8\)"
                                         r", the output has shape \(1, 3, 9, 9\)$"):
        m(x, residual=torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match=r"^ConvTranspose2d: residual has shape \(3, 8, 8\), "
                                         r"the output has shape \(3, 9, 9\)$"):
        m(x[0], residual=torch.zeros(3, 8, 8))
    with pytest.raises(TypeError, match=r"^ConvTranspose2d: residual is torch\.float64 on cpu, "
                                        r"the input torch\.float32 on cpu$"):
        m(x, residual=torch.zeros(1, 3, 9, 9, dtype=torch.float64))


@pytest.mark.parametrize("act", ["identity", "relu"])
def test_unbatched_input_with_a_residual_matches_torch_nn(act):
    ref, ours = _pair(2, (2, 3, 3), dict(stride=2, padding=1, output_padding=1),
                      torch.float64, act)
    nn_act = torch.relu if act == "relu" else (lambda t: t)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 8, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    y = ours(x, residual=r)
    assert y.shape == (3, 8, 10)
    x2, r2 = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    y2 = nn_act(ref(x2) + r2)
    torch.testing.assert_close(y, y2, **TOL[torch.float64])
    dy = torch.randn(3, 8, 10, generator=gen, dtype=torch.float64)
    y.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, **TOL[torch.float64])
    torch.testing.assert_close(r.grad, r2.grad, **TOL[torch.float64])
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL[torch.float64])


def test_initialisation_draw_for_draw():
    torch.manual_seed(5)
    a = torch.nn.ConvTranspose3d(4, 6, 2, groups=2)
    torch.manual_seed(5)
    b = ct.ConvTranspose3d(4, 6, 2, groups=2)
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=0)
    torch.testing.assert_close(a.bias, b.bias, rtol=0, atol=0)


class UNet(torch.nn.Module):
    """A small U-Net: Conv-BN-ReLU down, ConvTranspose(-ReLU) up, a concatenated skip."""

    def __init__(self):
        super().__init__()
        self.down = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        self.pool = torch.nn.MaxPool2d(2)
        self.mid = torch.nn.Sequential(
            torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.up = torch.nn.Sequential(torch.nn.ConvTranspose2d(8, 4, 2, stride=2),
                                      torch.nn.ReLU())
        self.out = torch.nn.Conv2d(8, 1, 1)

    def forward(self, x):
        d = self.down(x)
        u = self.up(self.mid(self.pool(d)))
        return self.out(torch.cat([u, d], dim=1))


def test_convert_unet_equals_the_unconverted_model():
    torch.manual_seed(0)
    ref = UNet().double()
    conv = UNet().double()
    conv.load_state_dict(ref.state_dict())
    convert(conv)
    assert isinstance(conv.up[0], ct.ConvTranspose2d) and conv.up[0].activation == "relu"
    assert isinstance(conv.up[1], torch.nn.Identity)
    assert conv.up[0].weight is not ref.up[0].weight
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    for mode in ("train", "eval", "channels_last", "no_grad"):
        for m in (ref, conv):
            m.train(mode != "eval")
            m.zero_grad()
        xi = x.to(memory_format=torch.channels_last) if mode == "channels_last" else x
        if mode == "no_grad":
            with torch.no_grad():
                torch.testing.assert_close(conv(xi), ref(xi), rtol=1e-12, atol=1e-12)
            continue
        y_ref, y = ref(xi), conv(xi)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        y_ref.square().sum().backward()
        y.square().sum().backward()
        for (name, a), b in zip(conv.named_parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)
        for a, b in zip(conv.buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_convert_keeps_parameters_and_folds_the_activation():
    seq = torch.nn.Sequential(torch.nn.ConvTranspose1d(3, 2, 4, 2, 1), torch.nn.SiLU(),
                              torch.nn.ConvTranspose3d(2, 2, 2))
    w = seq[0].weight
    convert(seq)
    assert isinstance(seq[0], ct.ConvTranspose1d) and seq[0].activation == "silu"
    assert seq[0].weight is w and isinstance(seq[1], torch.nn.Identity)
    single = convert(torch.nn.ConvTranspose2d(2, 2, 3))
    assert isinstance(single, ct.ConvTranspose2d)


@pytest.mark.slow  # inductor compiles C++ (about 30 s here)
def test_compile_fullgraph_matches_eager(monkeypatch):
    from convfuse.ops.reference import conv_transpose as ref_t

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        ct.ConvTranspose2d(3, 4, 2, 2, activation="relu"),
        ct.ConvTranspose2d(4, 2, 3, 2, 1, 1, activation="silu"))
    calls = {"fwd": 0, "bwd_filter": 0}
    fwd, bwd = ref_t.conv_transpose_bias_act, ref_t.conv_transpose_backward_filter

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(ref_t, "conv_transpose_bias_act", count("fwd", fwd))
    monkeypatch.setattr(ref_t, "conv_transpose_backward_filter", count("bwd_filter", bwd))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 3, 4, 4)
    y = compiled(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert calls == {"fwd": 2, "bwd_filter": 2}
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert ref_conv is not None


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_empty_batch_gives_empty_outputs_and_zero_gradients(act, channels_last):
    ref, ours = _pair(2, (4, 6, 3, 2, 1, 1, 2), {}, torch.float64, activation=act)
    x = torch.randn(0, 4, 5, 5, dtype=torch.float64)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    y_ref, dx_ref, g_ref = _run(ref, x, "plain")
    y, dx, g = _run(ours, x, "plain")
    assert y.shape == y_ref.shape == (0, 6, 10, 10) and dx.shape == dx_ref.shape
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # zeros


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_cpu_autocast_bfloat16_as_torch_nn(rank):
    ref, ours = _pair(rank, (4, 6, 3, 2, 1, 1), {}, torch.float32, activation=None)
    x = torch.randn(2, 4, *[5, 4, 3][:rank])
    outs = []
    for m in (ref, ours):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        y.float().square().sum().backward()
        outs.append((y, xi.grad, m.weight.grad, m.bias.grad))
    (y_ref, *g_ref), (y, *g) = outs
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()))


@pytest.mark.parametrize("act", ["identity", "relu", "sigmoid", "tanh", "elu", "relu6",
                                 "leaky_relu", "silu", "gelu"])
@pytest.mark.parametrize("residual", [False, True])
def test_double_backward_gradgradcheck(act, residual):
    """Note [transposed convolution double backward]: gradgradcheck in float64 with every
    activation, with and without a residual, through bias, weight, input and residual."""
    torch.manual_seed(0)
    m = ct.ConvTranspose2d(2, 4, 3, 2, 1, 1, 2, dtype=torch.float64, activation=act)
    x = torch.randn(1, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    r = torch.randn(1, 4, 4, 4, dtype=torch.float64, requires_grad=True)
    inputs = (x, m.weight, m.bias) + ((r,) if residual else ())

    def f(x, w, b, r=None):
        return m(x, residual=r)

    assert torch.autograd.gradgradcheck(f, inputs)


def test_gradient_penalty_matches_torch_nn():
    """A WGAN-GP style penalty: the input gradient's norm, differentiated again."""
    ref, ours = _pair(2, (3, 4, 3, 2, 1, 1), {}, torch.float64, activation="tanh")
    results = []
    for m, act in ((ref, torch.tanh), (ours, lambda t: t)):
        x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator()
                        .manual_seed(0)).requires_grad_()
        y = act(m(x))
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        penalty = (g.flatten(1).norm(dim=1) - 1).square().mean()
        penalty.backward()
        results.append((penalty.detach(), m.weight.grad.clone(), m.bias.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("rank,args", [
    (1, (2, 3, 3, 1, 2, 1, 1, True, 2)),  # output_padding 1 >= stride 1 (< dilation 2)
    (2, (2, 4, 3, (1, 2), 2, (1, 1), 2, True, (2, 2))),  # the same along H only
])
def test_double_backward_with_output_padding_at_the_stride(rank, args, channels_last):
    """Note [transposed convolution double backward]: where G's output is larger than the
    transposed one (output_padding >= stride), the second derivatives (weight gradient of
    an input-gradient penalty, and gradgradcheck) still match torch.nn's in float64."""
    ref, ours = _pair(rank, args, {}, torch.float64, activation="tanh")
    x = torch.randn(2, 2, *[4, 3][:rank], dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))
    if channels_last and rank == 2:
        x = x.to(memory_format=torch.channels_last)
    results = []
    for m, act in ((ref, torch.tanh), (ours, lambda t: t)):
        xi = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(act(m(xi)).square().sum(), xi, create_graph=True)
        (g.square().sum() + g.sum()).backward()
        results.append((g.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    xs = x[:1].clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, w: ours(x), (xs, ours.weight))


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_first_order_backward_runs_the_fused_op(monkeypatch, act):
    """Without create_graph, backward is the one fused backward op (db and dz from the
    activation-backward + bias-gradient op), not the differentiable composition."""
    from convfuse import ops

    calls = []
    real = ops.conv_transpose_activation_backward_bias
    monkeypatch.setattr(ops, "conv_transpose_activation_backward_bias",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    m = ct.ConvTranspose2d(2, 4, 3, 2, dtype=torch.float64, activation=act)
    m(torch.randn(1, 2, 3, 3, dtype=torch.float64)).sum().backward()
    assert calls == [1]


def _format(t):
    if t.is_contiguous():
        return "contiguous"
    for fmt in (torch.channels_last, torch.channels_last_3d):
        if t.dim() == (4 if fmt == torch.channels_last else 5) and t.is_contiguous(
                memory_format=fmt):
            return "channels_last"
    return "other"


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("which", ["input", "module"])
def test_output_memory_format_is_torch_nns(rank, dtype, which):
    """Channels-last in, channels-last out (input or module), except where torch.nn's CPU
    path returns contiguous (float64 3-d, and 1-d with a transposed (N, L, C) input); the
    output is an ordinary tensor that .view() works on when contiguous."""
    ref, ours = _pair(rank, (4, 6, 3, 2), {}, dtype)
    x = torch.randn(2, 4, *[5, 4, 3][:rank], dtype=dtype)
    if rank == 1:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # an (N, L, C) tensor
    else:
        fmt = torch.channels_last if rank == 2 else torch.channels_last_3d
        if which == "input":
            x = x.to(memory_format=fmt)
        else:
            ref, ours = ref.to(memory_format=fmt), ours.to(memory_format=fmt)
    y_ref, y = ref(x), ours(x)
    assert _format(y) == _format(y_ref)
    assert not y._is_view()
    torch.testing.assert_close(y, y_ref, **(TOL.get(dtype) or dict(rtol=2e-2, atol=2e-2)))
    if _format(y) == "contiguous":
        assert y.view(2, -1).shape[1] == y[0].numel()


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("which", ["input", "module", "both"])
def test_output_memory_format_with_one_input_channel_is_torch_nns(rank, which):
    """A one-channel tensor is contiguous in both formats; the layout is torch's own
    backend's choice (as for Conv), not a guess from the strides."""
    ref, ours = _pair(rank, (1, 3, 1, 1), {}, torch.float32)
    fmt = torch.channels_last if rank == 2 else torch.channels_last_3d
    x = torch.randn(2, 1, *[5, 4, 3][:rank])
    if which in ("input", "both"):
        x = x.to(memory_format=fmt)
    if which in ("module", "both"):
        ref, ours = ref.to(memory_format=fmt), ours.to(memory_format=fmt)
    y_ref, y = ref(x), ours(x)
    assert _format(y) == _format(y_ref)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])


@pytest.mark.slow  # inductor compiles C++
def test_converted_unet_under_compile_equals_the_unconverted_model():
    torch.manual_seed(0)
    ref = UNet()
    conv = UNet()
    conv.load_state_dict(ref.state_dict())
    convert(conv)
    torch._dynamo.reset()
    compiled = torch.compile(conv, fullgraph=True)
    x = torch.randn(4, 1, 8, 8)
    y_ref, y = ref(x), compiled(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    for (name, a), b in zip(conv.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(conv.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_empty_spatial_input_and_float_output_sizes_are_refused_as_torch_nn():
    x = torch.randn(1, 2, 0, 4)
    with pytest.raises(RuntimeError):
        torch.nn.ConvTranspose2d(2, 3, 3)(x)
    with pytest.raises(RuntimeError, match=r"^ConvTranspose2d: input shape \(1, 2, 0, 4\) has "
                                           r"an empty spatial dimension$"):
        ct.ConvTranspose2d(2, 3, 3)(x)
    x = torch.randn(1, 2, 4, 4)
    with pytest.raises(TypeError):
        torch.nn.ConvTranspose2d(2, 3, 3, stride=2)(x, output_size=[10.0, 10.0])
    with pytest.raises(TypeError, match=r"^ConvTranspose2d: output_size must hold ints, got "
                                        r"\[10\.0, 10\.0\]$"):
        ct.ConvTranspose2d(2, 3, 3, stride=2)(x, output_size=[10.0, 10.0])
    for sizes in (torch.tensor([10, 10]), torch.Size([10, 10]), [torch.tensor(10)] * 2):
        assert ct.ConvTranspose2d(2, 3, 3, stride=2)(x, output_size=sizes).shape == \
            (1, 3, 10, 10)
