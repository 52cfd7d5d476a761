"""PyTorch's own catalogue entries for ConvTranspose1d/2d/3d on convfuse.torch against
torch.nn: `module_db`'s module_inputs_torch_nn_ConvNd(transposed=True) (batched and
unbatched) and common_nn's ConvTranspose tests, read from torch itself, with the variants
of the drop-in issue (channels_last input and module, non-contiguous, no_grad,
inference_mode, frozen weights, an in-place op on the output), in float32 and float64.
Outputs, memory formats and every gradient must agree; complex dtypes are refused with a
TypeError. (tests/test_torch_conv_transpose.py has the same cases written out.)"""

from __future__ import annotations

import sys
import types
import unittest

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
from tests.test_torch_conv_transpose import TOL, VARIANTS, _run  # noqa: E402

OURS = {nn.ConvTranspose1d: ct.ConvTranspose1d, nn.ConvTranspose2d: ct.ConvTranspose2d,
        nn.ConvTranspose3d: ct.ConvTranspose3d}


def _cases():
    out = []
    for info in module_db:
        if info.module_cls not in OURS:
            continue
        for mi in info.module_inputs_func(info, device="cpu", dtype=torch.float64,
                                          requires_grad=False, training=True):
            (x,) = mi.forward_input.args
            out.append((f"db-{info.name}-{mi.desc or 'default'}-{len(out)}", info.module_cls,
                        tuple(mi.constructor_input.args), dict(mi.constructor_input.kwargs),
                        tuple(x.shape)))
    for test in common_nn.module_tests + common_nn.get_new_module_tests():
        name = test.get("module_name") or test.get("fullname", "").split("_")[0]
        cls = getattr(nn, name, None)
        if cls not in OURS or "input_size" not in test:
            continue
        if "constructor_args" in test:
            args = tuple(test["constructor_args"])
        else:
            m = test["constructor"]()
            args = (m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                    m.output_padding, m.groups, m.bias is not None, m.dilation,
                    m.padding_mode)
        out.append((f"nn-{name}-{test.get('desc') or test.get('fullname')}-{len(out)}", cls,
                    args, {}, tuple(test["input_size"])))
    return out


CASES = _cases()


def test_the_catalogue_is_there():
    kinds = {c[1] for c in CASES}
    assert kinds == set(OURS) and len(CASES) >= 16


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("variant", [*VARIANTS, "channels_last_module"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_catalogue_case_matches_torch_nn(case, variant, dtype):
    _, cls, args, kwargs, shape = case
    torch.manual_seed(0)
    ref = cls(*args, **kwargs).to(dtype)
    ours = OURS[cls](*args, **kwargs).to(dtype)
    ours.load_state_dict(ref.state_dict())
    rank = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}[cls]
    if variant == "channels_last_module" and rank > 1:
        fmt = torch.channels_last if rank == 2 else torch.channels_last_3d
        ref, ours = ref.to(memory_format=fmt), ours.to(memory_format=fmt)
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype)
    y_ref, dx_ref, g_ref = _run(ref, x, variant)
    y, dx, g = _run(ours, x, variant)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert y.is_contiguous() == y_ref.is_contiguous()
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    if dx_ref is not None:
        torch.testing.assert_close(dx, dx_ref, **TOL[dtype])
    assert len(g) == len(g_ref)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("cls", list(OURS))
def test_complex_dtypes_are_refused_with_a_typed_error(cls):
    with pytest.raises(TypeError, match=f"{cls.__name__}: dtype torch.complex64"):
        OURS[cls](2, 2, 3, dtype=torch.complex64)
