"""Shared by the plan test files (test_plan*.py): the binding, a fresh plan cache around
every test, a convolution geometry maker, an oracle for cuDNN's dims and strides, and
stand-in perf records."""

from __future__ import annotations

import numpy as np
import pytest

from convfuse._binding import cudnn
from convfuse.geometry import ConvGeometry
from convfuse.plan import clear_plan_cache

lib = cudnn()


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_plan_cache()
    yield
    clear_plan_cache()


def make_geom(rank, channels_last, groups, stride=1, padding=0, dilation=1, batch=2):
    spatial = (9, 8, 7)[:rank]
    kernel = (3, 2, 3)[:rank]
    c, k = 4, 6
    x = (batch, c, *spatial)
    w = (k, c // groups, *kernel)
    if channels_last:
        x, w = (x[0], *x[2:], x[1]), (w[0], *w[2:], w[1])
    return ConvGeometry.create(x, w, stride, padding, dilation, groups,
                               "NHWC" if channels_last else "NCHW")


def cudnn_view(shape, channels_last):
    """Independent oracle for dims and element strides: what a C-contiguous NumPy array
    of `shape` looks like in cuDNN's (N, C, *spatial) order, 1-D lifted to 2-D."""
    a = np.empty(shape, np.int8)
    if len(shape) == 3:  # Note [1-D convolutions as 2-D]: a unit height
        a = a.reshape(shape[0], 1, *shape[1:]) if channels_last else a.reshape(*shape[:2], 1, -1)
    if channels_last:
        a = np.moveaxis(a, -1, 1)
    return list(a.shape), [s // a.itemsize for s in a.strides]


def perf(algo, memory=0, status=None, det=True, math="CUDNN_DEFAULT_MATH", time=1.0):
    return lib.AlgoPerf(algo, lib.CUDNN_STATUS_SUCCESS if status is None else status, time,
                        memory, lib.CUDNN_DETERMINISTIC if det else lib.CUDNN_NON_DETERMINISTIC,
                        getattr(lib, math))
