"""torch.export of converted models (their fused layers as convfuse::* ops): strict and
non-strict, with dynamic batch and spatial sizes; the exported program agrees with torch.nn
at other sizes, in training (statistics updated as torch.nn's) and evaluation, and survives
torch.export.save/load."""

from __future__ import annotations

import copy
import io

import pytest

torch = pytest.importorskip("torch")

import convfuse.torch as ct  # noqa: E402

F64 = torch.float64
Dim = torch.export.Dim


def _models():
    torch.manual_seed(0)
    return {
        "conv1d_reflect": (torch.nn.Sequential(
            torch.nn.Conv1d(3, 4, 3, padding=1, padding_mode="reflect"), torch.nn.ReLU()),
            (2, 3, 9), (5, 3, 12)),
        "conv2d_bn": (torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU()),
            (2, 3, 8, 8), (5, 3, 11, 9)),
        "conv_transpose2d": (torch.nn.Sequential(
            torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1), torch.nn.SiLU()),
            (2, 3, 6, 6), (3, 3, 7, 5)),
    }


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name", ["conv1d_reflect", "conv2d_bn", "conv_transpose2d"])
@pytest.mark.parametrize("training", [False, True])
def test_export_with_dynamic_sizes_matches_torch_nn(name, strict, training):
    plain, shape, other = _models()[name]
    plain = plain.to(F64).train(training)
    ours = ct.convert(copy.deepcopy(plain))
    x = torch.randn(shape, dtype=F64)
    dims = {0: Dim("n", min=2, max=64)}
    for i in range(2, len(shape)):
        dims[i] = Dim(f"s{i}", min=5, max=64)
    program = torch.export.export(ours, (x,), dynamic_shapes={"input": dims}, strict=strict)
    assert any("convfuse" in str(n.target) for n in program.graph.nodes)
    exported = program.module()
    y = torch.randn(other, dtype=F64)
    ref = copy.deepcopy(plain)
    torch.testing.assert_close(exported(y), ref(y), rtol=1e-12, atol=1e-12)
    if training and name == "conv2d_bn":  # the exported program updates its statistics
        state = exported.state_dict()
        for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            torch.testing.assert_close(state[key], ref.state_dict()[key], rtol=1e-12,
                                       atol=1e-12)
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    loaded = torch.export.load(buf).module()
    torch.testing.assert_close(loaded(y), copy.deepcopy(plain)(y), rtol=1e-12, atol=1e-12)
