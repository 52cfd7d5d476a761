"""Autocast (torch.autocast / mixed precision) for convfuse's custom ops.

Note [autocast]
Inside `torch.autocast(device_type, dtype)` torch.nn's convolutions run in the autocast
dtype: aten::conv1d/2d/3d, convolution, _convolution and cudnn_convolution are registered
for AutocastCPU and AutocastCUDA as lower-precision ops (their inputs cast to the context's
dtype; float64 and other devices' tensors left alone). torch's activations and its
batch_norm have no autocast rule on the CPU or CUDA (checked with
torch._C._dispatch_dump in torch 2.13 and 2.11: batch_norm is registered for AutocastMPS
only; conv_transpose1d/2d/3d are lower-precision like the convolutions), so a
batch norm runs in its input's dtype, with float32 parameters and statistics allowed
beside float16/bfloat16 data.

So convfuse's convolution ops get an Autocast kernel for "cpu" and "cuda" that casts their
floating tensor arguments the same way and runs the op with autocast excluded; a fused
bias, activation and residual run in that dtype too, as torch.nn's activation would run on
the convolution's output. The residual is an input of the fused op and is cast with the
others, as torch casts the additive input of its own fused ops (conv's bias, addmm's
input); an unfused `act(conv(x) + r)` with a float32 r would promote to float32 instead.
The batch-norm ops get none: the dispatcher's fallthrough hands them their inputs
unchanged, which is torch.nn's behaviour. Backward ops need none either: they see the
tensors the forward saved, already in the autocast dtype. The recorded backward
(create_graph=True, _double.py) runs its convolution ops, which have the Autocast kernel
as forwards, with autocast off, as torch's convolution_backward has no autocast rule.

torch.library.register_autocast fixes the cast dtype when it is registered; a context can
ask for float16 or bfloat16, so the kernel here reads torch.get_autocast_dtype at each call
instead (the casting rule is register_autocast's, and torch's own cached_cast's).
"""

from __future__ import annotations

from typing import Any

import torch

_LIB = torch.library.Library("convfuse", "IMPL")  # lives as long as the process
_DEVICE_TYPES = ("cpu", "cuda")
_any_autocast = torch._C._is_any_autocast_enabled


def _eligible(t: object, device_type: str) -> bool:
    return (isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.dtype != torch.float64 and t.device.type == device_type)


def casts(*tensors: torch.Tensor | None) -> bool:
    """Whether autocast is on for these tensors' device and would cast every one of them
    to the same dtype (so a dtype mismatch among them is what torch.nn accepts too)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return False
    dev = present[0].device.type
    return (dev in _DEVICE_TYPES and torch.is_autocast_enabled(dev)
            and all(_eligible(t, dev) for t in present))


def enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled(device_type), answered by one cheap check when autocast
    is off everywhere (the common case, asked at every call)."""
    return _any_autocast() and torch.is_autocast_enabled(device_type)


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if _eligible(value, device_type):
        return value.to(dtype)
    return value


def register_conv(op: Any) -> None:
    """Give the custom op `op` (a torch.library CustomOpDef) an Autocast kernel for the CPU
    and CUDA that casts like torch's convolutions (Note [autocast])."""
    name = op._name if hasattr(op, "_name") else str(op)
    overload = getattr(torch.ops.convfuse, name.split("::")[-1]).default
    for device_type in _DEVICE_TYPES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset: Any, *args: Any, _dev: str = device_type,
                   _excluded: Any = keyset) -> Any:
            dtype = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_excluded):
                return overload(*(_cast(a, _dev, dtype) for a in args))

        _LIB.impl(name.split("::")[-1], kernel, key, with_keyset=True)


def cast_args(device_type: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The Autocast kernel's cast of a convolution op's arguments, for a call that does not
    go through the dispatcher (Note [two call paths] in _eager.py): `args` unchanged
    outside autocast."""
    if not _any_autocast() or device_type not in _DEVICE_TYPES \
            or not torch.is_autocast_enabled(device_type):
        return args  # autocast off everywhere: one cheap check (`enabled`)
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(_cast(a, device_type, dtype) for a in args)
