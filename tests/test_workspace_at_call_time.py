"""A workspace that cannot be allocated at call time moves the plan to the next ranked
algorithm (with a warning), as at choice time, instead of failing the call."""

from __future__ import annotations

import warnings

import pytest

import convfuse.ops as ops
from convfuse.plan import WorkspaceFallbackWarning, get_plan
from tests._ops_dispatch_helpers import GEOMS
from tests.test_ops_cudnn_wiring import gpu  # noqa: F401  (the fake-device fixture)


class ScarceWorkspace:
    """Stands in for ops.cudnn.handle.Workspace: the first `failures` allocations fail."""

    def __init__(self, failures: int):
        self.failures = failures
        self.sizes = []

    def __call__(self, nbytes, ctx=None):
        import cupy

        self.sizes.append(nbytes)
        if self.failures:
            self.failures -= 1
            raise cupy.cuda.memory.OutOfMemoryError(nbytes, 0, 0)
        return type("Ws", (), {"ptr": 0, "size": 0})()


@pytest.mark.parametrize("direction,call", [
    ("fwd", "convolutionForward"),
    ("bwd_data", "convolutionBackwardData"),
    ("bwd_filter", "convolutionBackwardFilter"),
])
def test_call_time_oom_moves_to_the_next_algorithm(gpu, monkeypatch, direction, call):  # noqa: F811
    from convfuse.ops.cudnn import ranked

    geom = GEOMS[3]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    dz = gpu.array(geom.output_shape, "float32")
    plan = get_plan(geom, "float32")
    first = plan.choice(direction, "H")
    scarce = ScarceWorkspace(failures=1)
    monkeypatch.setattr(ranked, "Workspace", scarce)
    run = {
        "fwd": lambda: ops.conv_forward(x, w, geom),
        "bwd_data": lambda: ops.conv_backward_data(dz, w, geom),
        "bwd_filter": lambda: ops.conv_backward_filter(x, dz, geom),
    }[direction]
    skipped = f"{direction} workspace could not be allocated now for algo {first.algo} "
    with pytest.warns(WorkspaceFallbackWarning, match=skipped):
        run()
    used = [args[7] for name, args in gpu.calls if name == call]
    assert used and used[-1] != first.algo  # the call ran, with the next ranked algorithm
    assert plan.choice(direction, "H").algo == used[-1]  # and the plan remembers it
    assert len(scarce.sizes) == 2


def test_call_time_oom_without_another_algorithm_raises(gpu, monkeypatch):  # noqa: F811
    from convfuse.ops.cudnn import ranked
    from convfuse.plan import WorkspaceUnavailableError

    geom = GEOMS[3]
    x, w = gpu.array(geom.input_shape, "float32"), gpu.array(geom.weight_shape, "float32")
    monkeypatch.setattr(ranked, "Workspace", ScarceWorkspace(failures=10))
    # A typed convfuse error naming the direction and the plan, not CuPy's raw one.
    # No warning on the way: the error names every algorithm tried.
    with warnings.catch_warnings(), pytest.raises(
            WorkspaceUnavailableError, match=r"fwd workspace .* algo 6 .* algo 0 .* no other"
    ) as info:
        warnings.simplefilter("error")
        ops.conv_forward(x, w, geom)
    # and a MemoryError, as the allocator's own error was: one `except MemoryError` serves
    assert isinstance(info.value, MemoryError)
