"""PoolPlan: cuDNN's pooling descriptor and the x/y tensor descriptors of one pooling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._binding import cudnn
from ..config import Flags
from ..config import get as get_flags
from ..dtypes import name as dtype_name
from ..errors import CudnnError
from . import descriptors as d
from .conv import current_device


def _lifted_window(pgeom: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(window, pads, strides); 1-D pools get a unit height (Note [1-D convolutions as 2-D])."""
    k, p, s = tuple(pgeom.kernel_size), tuple(pgeom.padding), tuple(pgeom.stride)
    if len(k) == 1:
        return (1, *k), (0, *p), (1, *s)
    return k, p, s


def pooling_mode_name(mode: str, deterministic: bool) -> str:
    """avg counts padding in the divisor (PyTorch's count_include_pad=True default)."""
    if mode == "max":
        return "CUDNN_POOLING_MAX_DETERMINISTIC" if deterministic else "CUDNN_POOLING_MAX"
    if mode == "avg":
        return "CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING"
    raise ValueError(f"pooling mode must be 'max' or 'avg', got {mode!r}")


@dataclass(frozen=True)
class PoolPlanKey:
    device: int
    dtype: str
    geometry: Any  # a PoolGeometry (frozen, hashable)
    deterministic: bool

    @classmethod
    def create(cls, pgeom: Any, dtype: Any, flags: Flags | None = None,
               device: int | None = None) -> PoolPlanKey:
        from ..pool_geometry import PoolGeometry

        if not isinstance(pgeom, PoolGeometry):
            raise TypeError(f"pgeom must be a PoolGeometry, got {type(pgeom).__name__}")
        f = flags if flags is not None else get_flags()
        return cls(current_device() if device is None else int(device), dtype_name(dtype),
                   pgeom, f.deterministic)


class PoolPlan:
    def __init__(self, key: PoolPlanKey) -> None:
        self.key = key
        self.lib = lib = cudnn()
        g = key.geometry
        window, pads, strides = _lifted_window(g)
        for what, dims in (("x", g.input_shape_cf), ("y", g.output_shape_cf)):
            d.check_elements(what, dims, self.describe)
        try:
            self.x_desc = d.tensor_descriptor(lib, key.dtype, g.input_shape_cf, g.channels_last)
            self.y_desc = d.tensor_descriptor(lib, key.dtype, g.output_shape_cf, g.channels_last)
            self.pool_desc = lib.PoolingDescriptor()
            # NaNs propagate, as NumPy's max and mean (the reference engine) propagate them.
            self.pool_desc.setNd(getattr(lib, pooling_mode_name(g.mode, key.deterministic)),
                                 lib.CUDNN_PROPAGATE_NAN, list(window), list(pads), list(strides))
            got = tuple(lib.getPoolingNdForwardOutputDim(self.pool_desc, self.x_desc))
        except CudnnError as err:
            raise err.with_context(f"building a pooling plan for {self.describe()}") from None
        want = d.lift(g.output_shape_cf)
        if got != want:
            raise RuntimeError(
                f"internal error: cuDNN computes pooling output dims {list(got)} but convfuse "
                f"computes {list(want)} for {self.describe()}"
            )

    def describe(self) -> str:
        return f"{self.key.geometry.describe()} dtype={self.key.dtype}"
