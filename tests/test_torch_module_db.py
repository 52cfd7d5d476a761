"""PyTorch's own module catalogue on convfuse.torch against torch.nn (issue 19).

The cases are torch's: `module_db` (torch/testing/_internal/common_modules.py, the
`module_inputs_torch_nn_*` functions) for Conv1d/2d/3d and BatchNorm1d/2d/3d, and the conv
cases of common_nn.py (`module_tests` and `new_module_tests`: padding modes, groups,
depthwise, dilation, 'same'/'valid', empty batches). Each runs on convfuse.torch and on
torch.nn with the same constructor arguments, the same state dict and the same inputs, on
the CPU in float32 and float64, with variants: channels_last inputs and modules,
non-contiguous and transposed inputs, no_grad, inference_mode, frozen weights, a second
call with another shape, several BatchNorm steps then eval, and in-place ops on the output.
Outputs, the input's and every parameter's gradient, the running statistics and the
output's memory format must agree (float64 to 1e-10). What torch.nn refuses, convfuse must
refuse too. ConvTranspose has its own issue; complex dtypes are refused with a TypeError.
"""

from __future__ import annotations

import contextlib
import sys
import types
import unittest
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

try:  # torch's testing package imports expecttest only for its TestCase base class
    import expecttest  # noqa: F401
except ImportError:
    _stub = types.ModuleType("expecttest")
    _stub.TestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules["expecttest"] = _stub

from torch.testing._internal import common_nn  # noqa: E402
from torch.testing._internal.common_modules import module_db  # noqa: E402

import convfuse.torch as ct  # noqa: E402

OURS = {nn.Conv1d: ct.Conv1d, nn.Conv2d: ct.Conv2d, nn.Conv3d: ct.Conv3d,
        nn.BatchNorm1d: ct.BatchNorm1d, nn.BatchNorm2d: ct.BatchNorm2d,
        nn.BatchNorm3d: ct.BatchNorm3d}
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: {"rtol": 2e-4, "atol": 2e-5}, torch.float64: {"rtol": 1e-10, "atol": 1e-12}}
MEMORY_FORMAT = {4: torch.channels_last, 5: torch.channels_last_3d}


def _module_db_cases() -> list[tuple[str, object, tuple, dict, tuple[int, ...]]]:
    """(id, torch class, constructor args, kwargs, input shape) from module_db."""
    cases = []
    for info in module_db:
        if info.module_cls not in OURS:
            continue
        for mi in info.module_inputs_func(info, device="cpu", dtype=torch.float64,
                                          requires_grad=True, training=True):
            (x,) = mi.forward_input.args
            assert not mi.forward_input.kwargs
            cases.append((f"db-{info.name}-{mi.desc or 'default'}-{len(cases)}",
                          info.module_cls, tuple(mi.constructor_input.args),
                          dict(mi.constructor_input.kwargs), tuple(x.shape)))
    return cases


def _common_nn_cases() -> list[tuple[str, object, tuple, dict, tuple[int, ...]]]:
    """The conv cases of common_nn: constructor args, or torch.nn modules built by a
    constructor whose arguments are read back from the module."""
    cases = []
    for test in common_nn.module_tests + common_nn.get_new_module_tests():
        name = test.get("module_name") or test.get("fullname", "").split("_")[0]
        cls = getattr(nn, name, None)
        if cls not in OURS or "input_size" not in test:
            continue
        if "constructor_args" in test:
            args = tuple(test["constructor_args"])
        else:
            m = test["constructor"]()
            if type(m) not in OURS:
                continue
            args = (m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                    m.dilation, m.groups, m.bias is not None, m.padding_mode)
        desc = test.get("desc") or test.get("fullname") or "default"
        cases.append((f"nn-{name}-{desc}-{len(cases)}", cls, args, {},
                      tuple(test["input_size"])))
    return cases


CASES = _module_db_cases() + _common_nn_cases()


def _pair(cls, args, kwargs, dtype, memory_format=None):
    """convfuse's layer and torch.nn's, same arguments and state dict (and, for the
    channels_last variant, both modules converted as `model.to(memory_format=...)` does)."""
    torch.manual_seed(0)
    theirs = cls(*args, **kwargs).to(dtype)
    ours = OURS[cls](*args, **kwargs).to(dtype)
    ours.load_state_dict(theirs.state_dict())
    if memory_format is not None:
        for m in (ours, theirs):
            m.to(memory_format=memory_format)
    return ours, theirs


def _formats(t):
    flags = [t.is_contiguous()]
    if t.dim() in MEMORY_FORMAT:
        flags.append(t.is_contiguous(memory_format=MEMORY_FORMAT[t.dim()]))
    return flags


def _transform(kind):
    """How a variant lays out the input (differentiable, from a leaf of plain layout)."""
    if kind == "channels_last":
        return lambda t: t.to(memory_format=MEMORY_FORMAT[t.dim()]) if t.dim() in (4, 5) \
            else t.movedim(1, -1).contiguous().movedim(-1, 1) if t.dim() == 3 else t
    if kind == "noncontiguous":
        return lambda t: torch.cat([t, t], -1)[..., ::2]
    if kind == "transposed":  # channels-last strides at any rank: (N, L, C) for 1-d
        return lambda t: t.movedim(1, -1).contiguous().movedim(-1, 1) if t.dim() > 2 else t
    return lambda t: t


def _step(ours, theirs, shape, dtype, *, kind="plain", mode="grad", frozen=False,
          inplace=False):
    """One forward (and backward) of both with the same input; compares everything."""
    tol = TOL[dtype]
    data = torch.randn(shape, dtype=dtype)
    make = _transform(kind)
    leaves = [data.clone().requires_grad_(mode == "grad") for _ in range(2)]
    ctx = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
           "inference_mode": torch.inference_mode}[mode]
    outs, errors = [], []
    for m, leaf in zip((ours, theirs), leaves):
        try:
            with ctx(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's padding='same' copy warning
                y = m(make(leaf))
                if inplace:
                    y = y.mul_(1.5).relu_()  # ReLU(inplace=True) after a scale, in place
            outs.append(y)
            errors.append(None)
        except (ValueError, TypeError, RuntimeError) as exc:
            outs.append(None)
            errors.append(exc)
    if errors[1] is not None:  # what torch.nn refuses, convfuse refuses too
        assert errors[0] is not None, f"torch.nn refused ({errors[1]}), convfuse did not"
        return
    assert errors[0] is None, f"convfuse refused what torch.nn runs: {errors[0]!r}"
    y, y_ref = outs
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert _formats(y) == _formats(y_ref), (y.stride(), y_ref.stride())
    torch.testing.assert_close(y, y_ref, **tol)
    for (name, b), b_ref in zip(ours.named_buffers(), theirs.buffers()):
        torch.testing.assert_close(b, b_ref, **tol, msg=name)
    if mode != "grad":
        return
    dy = torch.randn_like(y_ref)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad, **tol)
    for (name, p), p_ref in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (p_ref.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, p_ref.grad, **tol, msg=name)
            assert frozen is False
    ours.zero_grad()
    theirs.zero_grad()


def _other_shape(shape, cls):
    """The same rank, one more sample (unless empty) and one more along the last dim."""
    batched = len(shape) == {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5}.get(cls, len(shape))
    s = list(shape)
    if batched and s[0] > 0:
        s[0] += 1
    if len(s) > 2 or not batched:
        s[-1] += 1
    return tuple(s)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: torch's thread pool only adds contention on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _kinds(shape, dtype, conv):
    """The input layouts worth running for this shape (each distinct); the float32 pass
    runs the two that change convfuse's layout, float64 all of them."""
    kinds = ["plain"]
    if len(shape) in (4, 5) or (conv and len(shape) == 3):
        kinds.append("channels_last")
    if dtype == torch.float64:
        kinds.append("noncontiguous")
        if len(shape) > 2:
            kinds.append("transposed")
    return kinds


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_catalogue_case_with_variants(case, dtype):
    _, cls, args, kwargs, shape = case
    is_bn = cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    train_steps = 3 if is_bn else 1
    for kind in _kinds(shape, dtype, not is_bn):
        # the modules too, as model.to(memory_format=...) converts them (conv weights)
        rank = 0 if is_bn else {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5}[cls]
        fmt = MEMORY_FORMAT.get(rank) if kind == "channels_last" else None
        ours, theirs = _pair(cls, args, kwargs, dtype, fmt)
        for step in range(train_steps):  # several BatchNorm steps, then eval
            _step(ours, theirs, shape, dtype, kind=kind, inplace=step == 1)
        ours.eval()
        theirs.eval()
        _step(ours, theirs, shape, dtype, kind=kind)
    # no_grad and inference_mode, training and eval; frozen weights; another shape
    ours, theirs = _pair(cls, args, kwargs, dtype)
    for training in (True, False):
        ours.train(training)
        theirs.train(training)
        _step(ours, theirs, shape, dtype, mode="no_grad")
        _step(ours, theirs, shape, dtype, mode="inference_mode")
    ours.train()
    theirs.train()
    ours.requires_grad_(False)
    theirs.requires_grad_(False)
    _step(ours, theirs, shape, dtype, frozen=True, inplace=True)
    ours.requires_grad_(True)
    theirs.requires_grad_(True)
    _step(ours, theirs, _other_shape(shape, cls), dtype)
    _step(ours, theirs, shape, dtype)


def test_the_catalogue_is_there():
    """The catalogue holds what this file is about (so an empty parametrisation fails)."""
    kinds = {c[1] for c in CASES}
    assert kinds == set(OURS)
    assert len(CASES) >= 60
    assert any(c[3].get("padding") == "same" or "same" in c[0] for c in CASES)
    assert any("reflect" in c[2] for c in CASES if len(c[2]) > 8)
    assert any(c[4][0] == 0 for c in CASES)  # empty batches


@pytest.mark.parametrize("cls", [nn.Conv2d, nn.BatchNorm2d])
def test_complex_dtypes_are_refused_with_a_typed_error(cls):
    args = (2, 2, 3) if cls is nn.Conv2d else (2,)
    with pytest.raises(TypeError, match=f"{cls.__name__}: dtype torch.complex64"):
        OURS[cls](*args, dtype=torch.complex64)
    layer = OURS[cls](*args)
    x = torch.randn(2, 2, 5, 5, dtype=torch.complex64)
    with pytest.raises(TypeError, match=cls.__name__):
        layer(x)
