"""The bridge's bound calls on CUDA (Note [bound calls] in convfuse/ops/cudnn/bound.py;
for batch norm, Note [bound batch-norm calls] in bound_batchnorm.py there).

A signature's first CUDA call runs convfuse.ops through `op` as always; right after it,
the bridge asks the engine for that call bound to the signature (`arm`) and keeps it on
the signature's Prepared, keyed by op, activation, residual and ExecContext (a stream's
calls do not unbind another's; a batch-norm backward's residual is whether the residual's
gradient is asked for, which may change between calls of one signature). Later calls
hand it the tensors' addresses and PyTorch's stream (`call`, `forward`, `backward`): no
DeviceArray per tensor, no op dispatch, no plan lookup. Only on the pointer path (Note
[the torch pointer path]), and only while `op` itself would call the op's validated
entry (validated_engine: the signature validated, convfuse.ops' function not replaced)
and that entry is not replaced either. When the bound call declines (None/False: the
engine would decide differently now, or cuDNN failed) it is dropped, the caller runs
`op`, and the next call binds again.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ops import validated
from . import _arrays
from ._signature import _DIRECT, Prepared, validated_engine

#: The ops the engine binds (Note [bound calls]): other callers skip this module's steps.
BINDS = frozenset(("conv_bias_act", "conv_backward_filter", "conv_backward_data",
                   "conv_backward_bias", "conv_transpose_bias_act",
                   "conv_transpose_backward_filter", "conv_transpose_backward_data",
                   "batchnorm_forward_training", "batchnorm_forward_inference",
                   "batchnorm_backward"))


def on_pointer_path(t: torch.Tensor) -> bool:
    """Whether a call with `t` crosses to the engine as pointers (a CUDA tensor, pointer
    path), where bound calls apply."""
    return t.is_cuda and _arrays.CUDA_PATH == "pointer"


def context(t: torch.Tensor) -> Any:
    """The ExecContext the engine's call for `t` runs in (PyTorch's current stream of its
    device), as to_array gives it."""
    return _arrays.torch_context(t.get_device())


def _runs_bound(prep: Prepared, name: str) -> bool:
    """Whether `op` would call <name>'s validated entry directly, and that entry is the
    one defined (a spy on either level sees every call, as Note [per-signature
    decisions] promises)."""
    return (validated_engine(prep, "cuda", name) is not None
            and getattr(validated, name) is _VALIDATED[name])


def call(prep: Prepared, key: tuple[str, Any, bool, Any], ctx: Any, *args: Any) -> Any:
    """The bound call kept under `key` ((op name, activation, residual, ExecContext)) run
    with `args`, or None where the caller runs `op` (then `arm`): nothing bound, `op`
    would not call the engine directly, or the bound call declined (dropped then)."""
    bound = prep.bound.get(key)
    if not bound or not _runs_bound(prep, key[0]):
        return None
    out = bound(ctx, *args)
    if out is None or out is False:
        prep.bound.pop(key, None)
        return None
    return out


def forward(prep: Prepared, name: str, activation: str, ctx: Any, x: torch.Tensor,
            w: torch.Tensor, b: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor | None:
    """A convolution's y by its bound call from physical() tensors, or None where the
    caller runs `op` (then `arm`)."""
    y = call(prep, (name, activation, residual is not None, ctx), ctx, x.data_ptr(),
             w.data_ptr(), 0 if b is None else b.data_ptr(),
             0 if residual is None else residual.data_ptr())
    if y is None:
        return None
    out: torch.Tensor = y.owner  # TorchContext.empty's tensor
    return out


def backward(prep: Prepared, name: str, ctx: Any, *pointers: int) -> bool:
    """Whether a convolution gradient's bound call ran with these addresses (inputs, then
    the output it writes with beta = 0); False where the caller runs `op` (then `arm`)."""
    return call(prep, (name, None, False, ctx), ctx, *pointers) is not None


def arm(prep: Prepared, name: str, activation: str | None, ctx: Any, dtype: torch.dtype,
        bias: bool = False, residual: bool = False) -> None:
    """After `op` ran <name> for `prep`'s signature on CUDA: keep its bound call under
    (name, activation, residual, ctx), or the engine's answer that there is none (for good,
    or until the flags or the plan change: ops/cudnn/bound.py's Declined)."""
    key = (name, activation, residual, ctx)
    have = prep.bound.get(key)
    if have is not None:  # a bound call (it declines itself), never, or a Declined
        stale = getattr(have, "stale", None)
        if stale is None or not stale():
            return
    eng = validated_engine(prep, "cuda", name)
    if eng is None or getattr(validated, name) is not _VALIDATED[name]:
        return
    bound = validated.bound_call(eng, name, prep.geom, _arrays._NUMPY_DTYPES[dtype], ctx,
                                 activation or "identity", bias, residual)
    if bound is None:  # not yet (ask again after a later engine call): a stale Declined goes
        prep.bound.pop(key, None)
    else:
        if len(prep.bound) >= _MAX_BOUND:  # streams made and dropped in a loop
            prep.bound.clear()
        prep.bound[key] = bound


_MAX_BOUND = 32
# The validated entries as defined, before any test could replace one.
_VALIDATED = {name: getattr(validated, name) for name in _DIRECT}
