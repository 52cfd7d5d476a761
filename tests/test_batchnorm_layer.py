"""BatchNorm1d/2d/3d on the CPU against torch.nn.BatchNorm*d in float64: outputs, running
statistics and gradients over several train/eval steps, state_dict interchange, atomic
backward and typed errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convfuse as cf
from convfuse.errors import BackwardBeforeForwardError, DeviceMismatchError

TORCH = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}
OURS = {1: cf.BatchNorm1d, 2: cf.BatchNorm2d, 3: cf.BatchNorm3d}
SHAPES = {1: [(6, 4), (3, 4, 5)], 2: [(3, 4, 3, 5)], 3: [(2, 4, 2, 3, 2)]}
CASES = [(r, s) for r, shapes in SHAPES.items() for s in shapes]


def nhwc(a):
    return np.ascontiguousarray(np.moveaxis(a, 1, -1)) if a.ndim > 2 else a


def nchw(a):
    return np.moveaxis(a, -1, 1) if a.ndim > 2 else a


@pytest.mark.parametrize(("rank", "shape"), CASES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize(("momentum", "affine", "track"), [
    (0.1, True, True), (None, True, True), (0.3, False, True), (0.1, True, False)])
@pytest.mark.parametrize(("act", "residual"), [(None, False), ("relu", True), ("gelu", False)])
def test_layer_matches_torch_over_steps(rng, rank, shape, layout, momentum, affine, track, act,
                                        residual):
    ours = OURS[rank](shape[1], momentum=momentum, affine=affine, track_running_stats=track,
                      activation=act, layout=layout, dtype="float64")
    ref = TORCH[rank](shape[1], momentum=momentum, affine=affine, track_running_stats=track,
                      dtype=torch.float64)
    if affine:  # non-trivial parameters, the same in both
        w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
        ours.weight.data[...] = w
        ours.bias.data[...] = b
        with torch.no_grad():
            ref.weight.copy_(torch.tensor(w))
            ref.bias.copy_(torch.tensor(b))
    act_t = {None: lambda t: t, "relu": torch.relu, "gelu": torch.nn.functional.gelu}[act]
    L = nhwc if layout == "NHWC" else (lambda a: a)
    B = nchw if layout == "NHWC" else (lambda a: a)
    for step in range(4):
        training = step != 2
        ours.train(training)
        ref.train(training)
        x = rng.standard_normal(shape) * (step + 1) + step
        r = rng.standard_normal(shape) if residual else None
        dy = rng.standard_normal(shape)
        xt = torch.tensor(x, requires_grad=True)
        rt = torch.tensor(r, requires_grad=True) if residual else None
        yt = act_t(ref(xt) + rt if residual else ref(xt))
        yt.backward(torch.tensor(dy))
        xl = L(x)
        x_copy = xl.copy()
        y = ours(xl, residual=L(r)) if residual else ours(xl)
        np.testing.assert_allclose(B(y), yt.detach().numpy(), rtol=1e-10, atol=1e-12)
        got = ours.backward(L(dy))
        dx, dr = got if residual else (got, None)
        np.testing.assert_allclose(B(dx), xt.grad.numpy(), rtol=1e-8, atol=1e-10)
        if residual:
            np.testing.assert_allclose(B(dr), rt.grad.numpy(), rtol=1e-8, atol=1e-10)
        np.testing.assert_array_equal(xl, x_copy)
        if affine:  # accumulated across steps, as PyTorch's .grad
            np.testing.assert_allclose(ours.weight.grad, ref.weight.grad.numpy(), rtol=1e-8,
                                       atol=1e-10)
            np.testing.assert_allclose(ours.bias.grad, ref.bias.grad.numpy(), rtol=1e-8,
                                       atol=1e-10)
        if track:
            np.testing.assert_allclose(ours.running_mean, ref.running_mean.numpy(), rtol=1e-12)
            np.testing.assert_allclose(ours.running_var, ref.running_var.numpy(), rtol=1e-12)
            assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked)


def test_state_dict_interchanges_with_torch(rng):
    ref = torch.nn.BatchNorm2d(5)
    ref.train()
    for _ in range(3):
        ref(torch.tensor(rng.standard_normal((4, 5, 3, 3)), dtype=torch.float32))
    ours = cf.BatchNorm2d(5)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy())
    nbt = ours.state_dict()["num_batches_tracked"]
    assert nbt.dtype == np.int64 and nbt.shape == () and int(nbt) == 3
    # momentum=None continues the cumulative average from the loaded count.
    ref_cma, ours_cma = torch.nn.BatchNorm2d(5, momentum=None), cf.BatchNorm2d(5, momentum=None)
    ours_cma.load_state_dict(ref.state_dict())
    ref_cma.load_state_dict(ref.state_dict())
    x = rng.standard_normal((4, 5, 3, 3)).astype(np.float32)
    ours_cma(x)
    ref_cma(torch.tensor(x))
    # float32 sums in another order: a few ulps apart
    np.testing.assert_allclose(ours_cma.running_mean, ref_cma.running_mean.numpy(), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(ours_cma.running_var, ref_cma.running_var.numpy(), rtol=1e-5)
    assert list(cf.BatchNorm1d(3, affine=False, track_running_stats=False).state_dict()) == []


def test_rejected_dy_keeps_context_and_gradients(rng):
    bn = cf.BatchNorm2d(3, activation="relu")
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    bn(x, residual=x.copy())
    bn.weight.grad[...] = 0.25
    for bad in (np.ones((2, 3, 4, 5), np.float32), np.ones((2, 3, 4, 4), np.float64), [1.0]):
        with pytest.raises((ValueError, TypeError)):
            bn.backward(bad)
        assert (bn.weight.grad == 0.25).all() and (bn.bias.grad == 0).all()
    dx, dres = bn.backward(np.ones((2, 3, 4, 4), np.float32))
    assert dx.shape == x.shape and dres.shape == x.shape
    assert not (bn.bias.grad == 0).all()
    with pytest.raises(BackwardBeforeForwardError):
        bn.backward(np.ones_like(x))


def test_needs_input_grad_false_skips_dx(rng):
    bn = cf.BatchNorm1d(3)
    bn.needs_input_grad = False
    bn(rng.standard_normal((5, 3)).astype(np.float32))
    assert bn.backward(np.ones((5, 3), np.float32)) is None
    assert bn.bias.grad.tolist() == [5.0, 5.0, 5.0]


def test_half_layer_keeps_float32_parameters_and_statistics(rng):
    bn = cf.BatchNorm2d(4, dtype="float16", layout="NHWC")
    assert bn.weight.dtype == np.float32 and bn.running_var.dtype == np.float32
    y = bn(rng.standard_normal((2, 3, 3, 4)).astype(np.float16))
    assert y.dtype == np.float16
    names = [n for n, _ in bn.named_buffers()]
    assert names == ["running_mean", "running_var", "num_batches_tracked"]


@pytest.mark.parametrize(("build", "match"), [
    (lambda: cf.BatchNorm2d(0), "num_features must be a positive int"),
    (lambda: cf.BatchNorm2d(3, eps=-1), "eps must be"),
    (lambda: cf.BatchNorm2d(3, momentum=1.5), r"momentum must be in \[0.0, 1.0\]"),
    (lambda: cf.BatchNorm2d(3, momentum=float("nan")), "momentum must be"),
    (lambda: cf.BatchNorm2d(3, layout="NWC"), "layout must be"),
    (lambda: cf.BatchNorm2d(3, activation="softmax"), "unknown activation"),
    (lambda: cf.BatchNorm2d(3, dtype="int8"), "unsupported dtype"),
])
def test_constructor_rejects(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_call_rejects_bad_input(rng):
    bn = cf.BatchNorm2d(3)
    with pytest.raises(ValueError, match=r"BatchNorm2d expects a 4-d input"):
        bn(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"BatchNorm2d: expected 3 channels on axis 1"):
        bn(np.zeros((2, 4, 3, 3), np.float32))
    with pytest.raises(ValueError, match="has dtype float32 but its input has dtype float64"):
        bn(np.zeros((2, 3, 3, 3)))
    with pytest.raises(ValueError, match=r"input has dtype int32; cast the input "
                                         r"\(x.astype\('float32'\)\)$"):
        bn(np.zeros((2, 3, 3, 3), np.int32))  # no advice to build an int32 layer
    with pytest.raises(TypeError, match="BatchNorm2d: input must be a NumPy or CuPy array"):
        bn([[1.0]])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        bn(np.zeros((1, 3, 1, 1), np.float32))
    assert int(bn.num_batches_tracked) == 0  # no failed call counted a batch
    with pytest.raises(ValueError, match=r"BatchNorm1d expects a 2-d or 3-d input"):
        cf.BatchNorm1d(3)(np.zeros((2, 3, 4, 4), np.float32))
    with pytest.raises(TypeError, match="BatchNorm2d: residual must be a NumPy or CuPy array"):
        bn(np.zeros((2, 3, 3, 3), np.float32), residual="not an array")
    with pytest.raises(ValueError, match="BatchNorm2d: residual has shape"):
        bn(np.zeros((2, 3, 3, 3), np.float32), residual=np.zeros((2, 3, 3, 1), np.float32))
    with pytest.raises(DeviceMismatchError, match="BatchNorm2d is on 'cpu'"):
        bn(np.zeros((2, 3, 3, 3), np.float32), residual=_fake_cupy((2, 3, 3, 3)))


def _fake_cupy(shape):
    cp = pytest.importorskip("cupy")
    mem = cp.cuda.memory.UnownedMemory(1 << 40, 4 * int(np.prod(shape)), None, device_id=0)
    return cp.ndarray(shape, np.float32, memptr=cp.cuda.MemoryPointer(mem, 0))


def test_eval_with_batch_statistics_when_not_tracking(rng):
    bn = cf.BatchNorm1d(2, track_running_stats=False).eval()
    x = rng.standard_normal((8, 2)).astype(np.float32) * 3 + 1
    y = bn(x)
    np.testing.assert_allclose(y.mean(axis=0), 0, atol=1e-5)
    assert bn.running_mean is None and bn.num_batches_tracked is None


def test_in_a_sequential_resnet_style_block(rng):
    conv = cf.Conv2d(3, 3, 3, padding=1, bias=False, dtype="float64", seed=0)
    bn = cf.BatchNorm2d(3, activation="relu", dtype="float64")
    x = rng.standard_normal((2, 3, 5, 5))
    y = bn(conv(x), residual=x)
    assert (y >= 0).all() and y.shape == x.shape
    dz, dskip = bn.backward(np.ones_like(y))
    dx = conv.backward(dz) + dskip
    assert dx.shape == x.shape and np.isfinite(dx).all()


def test_assigning_num_batches_tracked_makes_the_host_count_stale():
    """Note [momentum=None without a host sync]: the GPU reads the count through a host
    mirror; assigning another array to the buffer drops it (re-read at the next step), the
    training step's own in-place `+= 1` keeps it in step."""

    bn = cf.BatchNorm2d(3, momentum=None, device="cpu")
    bn._host_count = 5  # as a GPU layer holds it after five steps
    bn.num_batches_tracked += 1  # in place: the same array
    assert bn._host_count == 5
    bn.num_batches_tracked = np.asarray(0, np.int64)
    assert bn._host_count is None
    # replays of a step captured with a float momentum count on the device alone: a later
    # switch of momentum re-reads the count
    bn.momentum, bn._host_count = 0.1, 5
    bn.momentum = None
    assert bn._host_count is None
    bn._host_count = 5
    bn.momentum = None  # assigned again (a schedule): the mirror holds, no sync per step
    assert bn._host_count == 5


@pytest.mark.parametrize("train", [True, False])
def test_backward_differentiates_the_forward_that_ran(rng, train):
    """activation and eps assigned between forward and backward take effect at the next
    forward: the backward is the forward's (as the conv layers' is)."""
    x, dy = rng.standard_normal((4, 3, 5, 5)), rng.standard_normal((4, 3, 5, 5))

    def grads(change):
        bn = cf.BatchNorm2d(3, activation="relu", dtype="float64", device="cpu")
        bn.train(train)
        bn.running_var[...] = 1.5
        bn(x)
        change(bn)
        return bn.backward(dy), bn.weight.grad.copy(), bn.bias.grad.copy()

    def swap(bn):
        bn.activation, bn.eps = "sigmoid", 0.5

    for a, b in zip(grads(swap), grads(lambda bn: None)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dropped", ["weight", "bias"])
def test_a_parameter_set_to_none_trains_as_torch_nn_with_its_identity(rng, dropped):
    """weight or bias set to None after construction: the forward computes without it (a
    weight of ones, a bias of zeros) and the backward trains the other, as torch.nn with
    that parameter fixed at its identity."""
    x = rng.standard_normal((4, 3, 5, 5))
    dy = rng.standard_normal((4, 3, 5, 5))
    ours = cf.BatchNorm2d(3, activation="relu", dtype="float64", device="cpu")
    gamma, beta = np.array([0.5, 1.0, 2.0]), np.array([0.1, -0.2, 0.3])
    ours.weight.data[...], ours.bias.data[...] = gamma, beta
    ref = torch.nn.BatchNorm2d(3, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(np.ones(3) if dropped == "weight" else gamma))
        ref.bias.copy_(torch.from_numpy(np.zeros(3) if dropped == "bias" else beta))
    setattr(ours, dropped, None)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.relu(ref(xt))
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(ours(x), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    dx = ours.backward(dy)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-10, atol=1e-12)
    kept = "bias" if dropped == "weight" else "weight"
    np.testing.assert_allclose(getattr(ours, kept).grad, getattr(ref, kept).grad.numpy(),
                               rtol=1e-10, atol=1e-12)


def test_a_state_dict_without_num_batches_tracked_loads_as_torch_nn_does():
    """torch.nn fills an absent num_batches_tracked (a state dict without version metadata:
    any dict of arrays) with the module's own; so does convfuse, under strict loading."""
    sd = {k: v for k, v in torch.nn.BatchNorm2d(3).state_dict().items()
          if k != "num_batches_tracked"}
    assert not torch.nn.BatchNorm2d(3).load_state_dict(sd).missing_keys
    ours = cf.BatchNorm2d(3, device="cpu")
    ours.num_batches_tracked[...] = 5
    assert ours.load_state_dict({k: v.numpy() for k, v in sd.items()}) == ([], [])
    assert int(ours.num_batches_tracked) == 5
    with pytest.raises(cf.StateDictError, match=r"missing key.*'running_var'"):
        ours.load_state_dict({k: v.numpy() for k, v in sd.items() if k != "running_var"})


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize(("activation", "saved_is_y"), [("relu", True), ("sigmoid", True),
                                                          ("silu", False), (None, False)])
def test_an_output_backward_reads_is_read_only(activation, saved_is_y, training):
    """As Conv's: where backward differentiates through the output y (relu, sigmoid), y is
    returned read-only on the CPU, so `y += 1` raises instead of corrupting dx; a y that
    backward never reads stays writable."""
    bn = cf.BatchNorm2d(3, activation=activation, dtype="float64")
    bn.train(training)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4))
    y = bn(x)
    assert y.flags.writeable is not saved_is_y
    if saved_is_y:
        with pytest.raises(ValueError, match="read-only"):
            y += 1.0


def test_activation_is_validated_naming_the_layer_at_construction_and_assignment():
    with pytest.raises(ValueError, match=r"^BatchNorm2d: unknown activation 'bogus'"):
        cf.BatchNorm2d(3, activation="bogus")
    # torch.nn's 6th positional argument is device, convfuse's is activation
    with pytest.raises(ValueError, match=r"^BatchNorm2d: activation 'cpu' is a device; pass "
                                         r"device='cpu' by keyword"):
        cf.BatchNorm2d(3, 1e-5, 0.1, True, True, "cpu")
    bn = cf.BatchNorm2d(3, activation="relu")
    with pytest.raises(ValueError, match=r"^BatchNorm2d: unknown activation 'bogus'"):
        bn.activation = "bogus"
    assert bn.activation == "relu"  # refused: unchanged
    bn.activation = "sigmoid"
    x = np.linspace(-2, 2, 2 * 3 * 2 * 2).reshape(2, 3, 2, 2)
    ref = cf.BatchNorm2d(3, dtype="float64", activation="sigmoid")
    bn64 = cf.BatchNorm2d(3, dtype="float64", activation="relu")
    bn64.activation = "sigmoid"
    np.testing.assert_array_equal(bn64(x), ref(x))


def test_a_batchnorm_pickled_with_a_plain_activation_attribute_still_loads():
    import pickle

    bn = cf.BatchNorm2d(3, activation="relu")
    d = bn.__dict__
    d["activation"] = d.pop("_activation")  # as an older convfuse pickled it
    assert pickle.loads(pickle.dumps(bn)).activation == "relu"


@pytest.mark.parametrize("conv_cls,name,shape", [(cf.Conv1d, "NWC", (2, 5, 3)),
                                                 (cf.Conv3d, "NDHWC", (2, 2, 3, 2, 3)),
                                                 (cf.Conv1d, "NCW", (2, 3, 5))])
def test_a_convolutions_layout_name_hands_on_to_the_batch_norm(conv_cls, name, shape, rng):
    """Conv1d(layout="NWC") -> BatchNorm1d(layout=conv.layout): the rank-specific names read
    as NHWC/NCHW, with the same numbers as the two-name spelling."""
    conv = conv_cls(3, 3, 1, layout=name, dtype="float64", device="cpu", seed=0)
    bn_cls = cf.BatchNorm1d if conv_cls is cf.Conv1d else cf.BatchNorm3d
    bn = bn_cls(3, layout=conv.layout, dtype="float64", device="cpu")
    two = bn_cls(3, layout="NCHW" if name.startswith("NC") else "NHWC", dtype="float64",
                 device="cpu")
    assert bn.layout == two.layout
    y = conv(rng.standard_normal(shape))
    np.testing.assert_array_equal(bn(y), two(y))


@pytest.mark.parametrize("training", [True, False])
def test_bias_false_is_a_scale_without_a_shift_as_torch_nn(training, rng):
    """torch.nn's BatchNorm (2.13) takes a keyword-only bias=False: a weight, no bias. The
    state dicts load into each other, and outputs, dx and the weight's gradient match."""
    ours = cf.BatchNorm2d(3, dtype="float64", device="cpu", activation="relu", bias=False)
    ref = torch.nn.BatchNorm2d(3, bias=False).double()
    assert list(ours.state_dict()) == list(ref.state_dict()) and ours.bias is None
    ref.weight.data = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float64)
    ref.running_mean.data += 0.3
    ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    ours.train(training)
    ref.train(training)
    x, dy = rng.standard_normal((4, 3, 5, 5)), rng.standard_normal((4, 3, 5, 5))
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.relu(ref(xt))
    yt.backward(torch.tensor(dy))
    np.testing.assert_allclose(ours(x), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ours.backward(dy), xt.grad.numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(ours.weight.grad, ref.weight.grad.numpy(), rtol=1e-11,
                               atol=1e-12)
    np.testing.assert_allclose(ours.running_mean, ref.running_mean.numpy(), rtol=1e-12)
    with pytest.raises(TypeError, match="BatchNorm2d: bias must be a bool"):
        cf.BatchNorm2d(3, bias="no")
    assert "affine=True, bias=False," in repr(ours)
    # reset_parameters resets the weight alone, as torch.nn's
    ours.weight.data[...] = 5
    ours.reset_parameters()
    ref.reset_parameters()
    np.testing.assert_array_equal(ours.weight.data, ref.weight.detach().numpy())
