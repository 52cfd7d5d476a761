"""Launchers for the activation kernels of convfuse/kernels/activation.cu (CuPy arrays or
the pointer path's DeviceArrays, Note [the pointer path] in ops/cudnn/device.py).

The cuDNN engine calls these for every activation cuDNN's fused call cannot apply, and for
the fused activation-backward + bias-gradient path (Note [fused activation-backward + bias
gradient] in activation.cu). Everything is validated here, before any launch; launches go
to the stream of the arrays' ExecContext (CuPy's current one for CuPy arrays), with no
host sync, so a step using them can be captured in a CUDA graph. Scratch memory (the bias
gradient's partial sums, cuDNN's workspace) goes back to the current allocator when a call
returns, which a graph still reads at each replay: capture with convfuse.graph.capture,
whose private pool lives as long as the graph, or, capturing a CuPy stream directly, under
`cupy.cuda.using_allocator(pool.malloc)` with such a pool kept alive with the graph.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import kernels
from ..activations import normalize
from ..backend import array_module
from ..dtypes import canonical, compute_dtype
from ..dtypes import name as dtype_name
from ..errors import DeviceMismatchError
from ..geometry import ConvGeometry
from .cudnn.device import context_of, cupy_context

#: Codes the kernels switch on; activation.cu's ACT_* defines mirror them.
ACTIVATION_CODES: dict[str, int] = {
    "identity": 0, "relu": 1, "sigmoid": 2, "tanh": 3, "elu": 4,
    "relu6": 5, "leaky_relu": 6, "silu": 7, "gelu": 8,
}

#: Threads per block; activation.cu's BIAS_BLOCK sizes shared memory by the same number.
BIAS_BLOCK = 256
ELEMENTWISE_BLOCK = 256
#: Cap on parts per channel (or column tile): bias_finish then reads at most 32 partials
#: per lane, and a single small channel still spreads over ~4 blocks per SM of a large GPU.
MAX_PARTS = 1024
#: Widest column tile of the rows kernel (columns one block owns).
MAX_TILE = 64
#: NCHW tensors with fewer spatial elements per channel than this use the rows kernel,
#: whose loads stay coalesced however short the per-channel runs are.
MIN_CHANNEL_RUN = 32

_SUFFIXES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


def activation_code(activation: str | None) -> int:
    """The kernel code of an activation name (aliases accepted; ValueError otherwise)."""
    return ACTIVATION_CODES[normalize(activation)]


def kernel_suffix(dtype: Any) -> str:
    """'f32', 'f64', 'f16' or 'bf16': the dtype part of a kernel's name."""
    return _SUFFIXES[dtype_name(dtype)]


@dataclass(frozen=True)
class BiasLaunch:
    """How activation_backward_bias launches its kernels for one output shape.

    kernel: "channel" (block per channel part) or "rows" (block per column tile and row
    part); int_args: the kernel's integer arguments after the three tensors. Partial sums
    are laid out [parts][cols], with `group` adjacent columns per channel.
    """

    kernel: str
    grid: tuple[int, ...]
    block: int
    int_args: tuple[int, ...]
    channels: int
    parts: int
    cols: int
    group: int

    @property
    def needs_finish(self) -> bool:
        """False when each block's sum is already a whole channel's (written to db)."""
        return self.parts > 1 or self.group > 1

    @property
    def partial_size(self) -> int:
        return self.parts * self.cols if self.needs_finish else 0

    @property
    def finish_grid(self) -> tuple[int]:
        warps_per_block = BIAS_BLOCK // 32
        return (max(1, min(-(-self.channels // warps_per_block), 4096)),)


def plan_bias_grad(shape: tuple[int, ...], channels_last: bool, sm_count: int) -> BiasLaunch:
    """Choose kernel, tiling and parts so that about 8 blocks per SM have work.

    Each block still gets at least 8 elements per thread (splitting finer costs more in
    partial sums than it gains), and the split depends only on the shape and SM count, so
    a given device always sums in the same order.
    """
    n, k = shape[0], (shape[-1] if channels_last else shape[1])
    spatial = math.prod(shape[1:-1] if channels_last else shape[2:])
    target = max(1, sm_count) * 8
    if not channels_last and spatial >= MIN_CHANNEL_RUN:
        length = n * spatial
        cap = min(MAX_PARTS, max(1, length // (BIAS_BLOCK * 8)))
        parts = max(1, min(-(-target // k), cap))
        return BiasLaunch("channel", (k * parts,), BIAS_BLOCK, (n, k, spatial, parts),
                          channels=k, parts=parts, cols=k, group=1)
    rows, cols, group = (n * spatial, k, 1) if channels_last else (n, k * spatial, spatial)
    tile = cols if cols <= MAX_TILE else -(-cols // -(-cols // MAX_TILE))
    row_groups = BIAS_BLOCK // tile
    tiles = -(-cols // tile)
    cap = min(MAX_PARTS, max(1, rows // (row_groups * 8)))
    parts = max(1, min(-(-target // tiles), cap))
    return BiasLaunch("rows", (tiles, parts), row_groups * tile, (rows, cols, tile),
                      channels=k, parts=parts, cols=cols, group=group)


# ---- validation (runs on any array type, so the CPU suite exercises it) ----

def _check_array(name: str, a: Any) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be a CuPy array, got {type(a).__name__}")
    try:
        canonical(a.dtype)
    except ValueError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (shape {tuple(a.shape)})")


def _check_like(name: str, a: Any, ref_name: str, ref: Any) -> None:
    _check_array(name, a)
    if tuple(a.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(a.shape)}, but {ref_name} has shape {tuple(ref.shape)}"
        )
    if a.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {a.dtype}, but {ref_name} has dtype {ref.dtype}")


def _check_saved(saved: Any, act: str, dy: Any) -> None:
    if saved is None:
        if act != "identity":
            raise ValueError(
                f"activation {act!r} needs the saved tensor for its backward "
                "(see convfuse.activations.saves), got None"
            )
        return
    _check_like("saved", saved, "dy", dy)


def _require_cupy(what: str, *arrays: Any) -> None:
    if array_module(*arrays) is np:
        raise TypeError(
            f"{what} launches a CUDA kernel and takes CuPy arrays, got NumPy arrays; "
            f"convfuse.ops.{what} runs NumPy arrays on the reference engine"
        )


# ---- public launchers ----

def activation_forward(z: Any, activation: str, out: Any) -> Any:
    """out = act(z) elementwise; out may be z itself. Returns out."""
    code = activation_code(activation)
    _check_array("z", z)
    _check_like("out", out, "z", z)
    _require_cupy("activation_forward", z, out)
    _launch_elementwise("act_forward", (z, out), code)  # pragma: gpu
    return out  # pragma: gpu


def activation_backward(dy: Any, saved: Any, activation: str, out: Any) -> Any:
    """out = dz from dy and the saved output (or pre-activation for elu/silu/gelu). Returns out."""
    act = normalize(activation)
    _check_array("dy", dy)
    _check_saved(saved, act, dy)
    _check_like("out", out, "dy", dy)
    _require_cupy("activation_backward", dy, saved, out)
    # identity never reads the saved tensor, so dy stands in for it
    sv = dy if saved is None else saved  # pragma: gpu
    _launch_elementwise("act_backward", (dy, sv, out), ACTIVATION_CODES[act])  # pragma: gpu
    return out  # pragma: gpu


def bias_act_forward(y: Any, bias: Any, residual: Any, residual_scale: float, activation: str,
                     geom: ConvGeometry) -> Any:
    """y = act(y + bias + residual_scale * residual) in place, one pass (Note [bias +
    activation pass] in activation.cu); bias (shape (K,)) and residual may be None."""
    code = activation_code(activation)
    if not isinstance(geom, ConvGeometry):
        raise TypeError(f"geom must be a convfuse.geometry.ConvGeometry, got {type(geom).__name__}")
    _check_array("y", y)
    if tuple(y.shape) != geom.output_shape:
        raise ValueError(f"y has shape {tuple(y.shape)}, but the convolution's output has "
                         f"shape {geom.output_shape} ({geom.layout})")
    if bias is not None:
        _check_array("bias", bias)
        if tuple(bias.shape) != geom.bias_shape or bias.dtype != y.dtype:
            raise ValueError(f"bias has shape {tuple(bias.shape)} and dtype {bias.dtype}, "
                             f"expected {geom.bias_shape} and {y.dtype}")
    if residual is not None:
        _check_like("residual", residual, "y", y)
    if not math.isfinite(residual_scale):
        raise ValueError(f"residual_scale must be finite, got {residual_scale}")
    _require_cupy("bias_act_forward", y, bias, residual)
    _launch_bias_act(y, bias, residual, float(residual_scale), code, geom)  # pragma: gpu
    return y  # pragma: gpu


def activation_backward_bias(
    dy: Any, saved: Any, activation: str, geom: ConvGeometry, dz_out: Any, db_out: Any,
    beta: float = 0.0,
) -> tuple[Any, Any]:
    """dz_out = activation backward; db_out = per-channel sum of dz + beta * db_out.

    One pass over dy and saved; deterministic (see activation.cu). With beta == 0 db_out
    is not read. geom is the geometry of the convolution whose output dy is the gradient of.
    For identity, dz_out may be None: then only the bias gradient is computed (dz is dy).
    """
    act = normalize(activation)
    if not isinstance(geom, ConvGeometry):
        raise TypeError(f"geom must be a convfuse.geometry.ConvGeometry, got {type(geom).__name__}")
    _check_array("dy", dy)
    if tuple(dy.shape) != geom.output_shape:
        raise ValueError(
            f"dy has shape {tuple(dy.shape)}, but the convolution's output has shape "
            f"{geom.output_shape} ({geom.layout})"
        )
    _check_saved(saved, act, dy)
    if dz_out is None and act != "identity":
        raise ValueError(f"dz_out may be None only for identity, not {act!r}")
    if dz_out is not None:
        _check_like("dz_out", dz_out, "dy", dy)
    _check_array("db_out", db_out)
    if tuple(db_out.shape) != geom.bias_shape:
        raise ValueError(
            f"db_out has shape {tuple(db_out.shape)}, expected {geom.bias_shape} "
            f"(out_channels={geom.out_channels})"
        )
    if db_out.dtype != dy.dtype:
        raise TypeError(f"db_out has dtype {db_out.dtype}, but dy has dtype {dy.dtype}")
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.integer, np.floating)):
        raise TypeError(f"beta must be a real number, got {type(beta).__name__}")
    if not math.isfinite(beta):
        raise ValueError(f"beta must be finite, got {beta}")
    _require_cupy("activation_backward_bias", dy, saved, dz_out, db_out)
    _launch_bias(dy, saved, ACTIVATION_CODES[act], geom, dz_out, db_out, float(beta))  # pragma: gpu
    return dz_out, db_out  # pragma: gpu


# ---- GPU-only launching ----
#
# Note [kernel arguments are pointers]
# Each launch passes its arrays as device addresses (Python ints, 0 for NULL) and its
# stream as the call's ExecContext's (Note [the pointer path] in ops/cudnn/device.py), so
# CuPy arrays and DeviceArrays launch alike and no CuPy array is made. CuPy 14.2 packs a
# Python int kernel argument as a CScalar of numpy int64, or uint64 from 2**63 up
# (cupy/cuda/function.pyx `_pointer` -> cupy/_core/_scalar.pyx `CScalar.__init__` ->
# `numpy_dtype_from_pyscalar`): 8 bytes either way, the size of a `T*` parameter, and
# device addresses lie far below 2**63. (A CuPy ndarray argument would go through
# `get_pointer()`, the same 8-byte address; a numpy.uint64 is a uint64 CScalar.) The
# stream goes as `stream=`, which Function.__call__ reads as `stream.ptr` (`_get_stream`).

@functools.cache
def _sm_count(device_id: int) -> int:  # pragma: gpu
    import cupy

    runtime = cupy.cuda.runtime
    return int(runtime.deviceGetAttribute(runtime.cudaDevAttrMultiProcessorCount, device_id))


def _function(name: str, device_id: int) -> Any:  # pragma: gpu
    """activation.cu's kernel `name` on `device_id` (current at the first call), looked up
    once per device (kernels.function_on)."""
    return kernels.function_on("activation", name, device_id)


def _ptr(a: Any) -> int:
    """An array's device address as a kernel argument, 0 (NULL) for None (Note [kernel
    arguments are pointers])."""
    return 0 if a is None else int(a.data.ptr)


def _device_of_all(*arrays: Any) -> int:
    devices = {a.device.id for a in arrays if a is not None}
    if len(devices) > 1:
        raise DeviceMismatchError(f"arrays live on different GPUs {sorted(devices)}")
    return int(arrays[0].device.id)


def _launch(arrays: tuple[Any, ...], launch: Callable[[Any], None]) -> None:  # pragma: gpu
    """launch(ctx) with the arrays' ExecContext, their device current: a CuPy array on
    another device than the current one launches under that device with its current
    stream, as CuPy would; the pointer path's caller made its device current."""
    device = _device_of_all(*arrays)
    ctx = context_of(arrays[0])
    if ctx.device == device:
        launch(ctx)
        return
    import cupy

    with cupy.cuda.Device(device):
        launch(cupy_context())


def _launch_elementwise(kernel: str, tensors: tuple[Any, ...], code: int) -> None:
    """Launch act_forward (z, y) or act_backward (dy, saved, dz) over all elements."""
    n = tensors[0].size
    if n == 0:
        return
    name = f"{kernel}_{kernel_suffix(tensors[0].dtype)}"
    ptrs = tuple(_ptr(t) for t in tensors)

    def launch(ctx: Any) -> None:
        blocks = max(1, min(-(-n // ELEMENTWISE_BLOCK), _sm_count(ctx.device) * 32))
        _function(name, ctx.device)((blocks,), (ELEMENTWISE_BLOCK,), (*ptrs, n, np.int32(code)),
                                    stream=ctx.stream)

    _launch(tensors, launch)


def _launch_bias_act(y: Any, bias: Any, res: Any, scale: float, code: int,
                     geom: ConvGeometry) -> None:
    n = y.size
    if n == 0:
        return
    spatial = n // (geom.output_shape[0] * geom.out_channels)
    inner = 1 if geom.channels_last else spatial
    name = f"bias_act_forward_{kernel_suffix(y.dtype)}"

    def launch(ctx: Any) -> None:
        blocks = max(1, min(-(-n // ELEMENTWISE_BLOCK), _sm_count(ctx.device) * 32))
        _function(name, ctx.device)(
            (blocks,), (ELEMENTWISE_BLOCK,),
            (_ptr(y), _ptr(bias), _ptr(res), n, geom.out_channels, inner, float(scale),
             np.int32(code)), stream=ctx.stream)

    _launch((y, bias, res), launch)


def _launch_bias(dy: Any, saved: Any, code: int, geom: ConvGeometry, dz_out: Any, db_out: Any,
                 beta: float) -> None:
    suffix = kernel_suffix(dy.dtype)
    sv = dy if saved is None else saved  # identity never reads it

    def launch(ctx: Any) -> None:
        plan = plan_bias_grad(geom.output_shape, geom.channels_last, _sm_count(ctx.device))
        # Scratch from the call's allocator: for CuPy arrays under convfuse.graph.capture
        # that is the captured step's private pool, which keeps it alive for every replay.
        itemsize = compute_dtype(dy.dtype).itemsize
        partial = ctx.allocate(plan.partial_size * itemsize) if plan.needs_finish else None
        partial_ptr = 0 if partial is None else int(partial.ptr)  # NULL: blocks write db
        _function(f"act_bias_{plan.kernel}_{suffix}", ctx.device)(
            plan.grid, (plan.block,),
            (_ptr(dy), _ptr(sv), _ptr(dz_out), *plan.int_args, partial_ptr, _ptr(db_out),
             float(beta), np.int32(code)), stream=ctx.stream)
        if plan.needs_finish:
            _function(f"act_bias_finish_{suffix}", ctx.device)(
                plan.finish_grid, (BIAS_BLOCK,),
                (partial_ptr, plan.parts, plan.channels, plan.group, _ptr(db_out),
                 float(beta)), stream=ctx.stream)

    _launch((dy, saved, dz_out, db_out), launch)


def kernel_names() -> list[str]:
    """Every kernel this module launches (the CPU suite checks each is in the cubin)."""
    names = []
    for suffix in _SUFFIXES.values():
        names += [f"act_forward_{suffix}", f"act_backward_{suffix}", f"bias_act_forward_{suffix}",
                  f"act_bias_channel_{suffix}", f"act_bias_rows_{suffix}",
                  f"act_bias_finish_{suffix}"]
    return names
