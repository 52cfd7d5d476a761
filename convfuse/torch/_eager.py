"""When a layer may skip the custom-op dispatcher (Note [two call paths]).

Note [two call paths]
A torch.library custom op with autograd costs tens of microseconds of host time before its
body runs (default filling, redispatch, the autograd wrapper): more than a small
convolution's arithmetic, and on a GPU host time per call is what a step at small and
medium batch sizes waits on. So in plain eager mode a layer's call is one
torch.autograd.Function (`apply` costs a few microseconds) whose forward and backward run
the very bodies the custom ops run, with the same setup_context and backward formula: the
same numbers bit for bit, the same errors, one autograd node per call, saved-tensor version
checks, needs_input_grad and create_graph behaving as the custom op's do.

The custom ops stay what every tracer sees: under torch.compile / export (dynamo sets
torch.compiler.is_compiling()), torch.jit tracing, a torch function or dispatch mode (fake
tensors, make_fx, FlopCounter, ...), a torch.func transform (vmap, grad, jvp: functorch's
interpreter stack is not empty), or any argument that is a tensor subclass or a functorch
wrapper, or an input on the meta device, the layers call torch.ops.convfuse.* as before,
so whatever intercepts operators sees the operators it knows. torch.func.functional_call
alone swaps parameters for plain tensors and keeps the eager path.

Autocast: the custom ops' Autocast kernels cast before autograd sees the op (Note
[autocast]); the eager path applies the same cast (`_autocast.cast_args`) before the
Function, so autograd records the same casts.

Note [torch.func transforms]
The custom ops cannot be differentiated by torch.func: an op whose gradient comes from
`register_autograd` (or a torch.autograd.Function without setup_context, BatchNorm's)
makes torch.func.grad, vjp and jacrev raise torch's "must override the setup_context
staticmethod", and under torch.func.jvp and jacfwd it returns a zero tangent without a word
(torch 2.11 to 2.13; a forward-mode rule cannot be registered on a custom op). So, wherever
a functorch transform is active or a forward-AD dual level is open (the eager body under
no_grad would return no tangent at all, so the layers then leave the eager path):
- a Conv or ConvTranspose call under a Grad or Jvp transform or with a dual level open goes
  through a torch.autograd.Function torch.func can transform (Note [a fused convolution
  under torch.func] in _functorch.py; `differentiating` says when): grad, vjp, jacrev, jvp,
  jacfwd, vmap(grad) per-sample gradients and dual tensors give torch.nn's derivatives;
  second-order transforms are refused there with a TransformError; under vmap alone it
  runs the custom op (torch's per-sample fallback);
- a batch norm runs torch.nn's own computation (F.batch_norm, then the residual add and
  the activation as torch ops: `under_torch_func`): torch.func transforms it as it
  transforms torch.nn's, with torch.nn's numbers, running-statistics updates and errors.
  Its fused Function writes the running statistics and has no torch.func rules; under a
  transform, fusion buys little against torch.func's own overheads.
"""

from __future__ import annotations

import torch
from torch import nn

_PLAIN = (torch.Tensor, nn.Parameter)
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
# Bound once: attribute lookups through torch's modules cost more than the calls.
_compiling = torch.compiler.is_compiling
_tracing = torch._C._get_tracing_state
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_interpreters = torch._C._functorch.peek_interpreter_stack
_fwad = torch.autograd.forward_ad


def _dual_level() -> int:
    """The open forward-AD dual level, -1 where none is (torch keeps it in a module global;
    should it move, forward AD goes unnoticed here rather than breaking every call)."""
    return getattr(_fwad, "_current_level", -1)


def takes_eager_path(*tensors: torch.Tensor | None) -> bool:
    """Whether a layer's call may run its autograd.Function instead of the custom op
    (Note [two call paths])."""
    if (_compiling() or _tracing() is not None or _dispatch_modes()
            or _function_modes() or _interpreters() is not None
            or getattr(_fwad, "_current_level", -1) >= 0):  # _dual_level(), inlined
        return False
    for t in tensors:  # a loop, not all(<generator>): it runs at every call
        if t is not None and (type(t) not in _PLAIN or _wrapped(t)):
            return False
    # meta tensors (shape inference on a model built on torch.device("meta")): the custom
    # ops' fake kernels give the outputs; the first argument says (the others' devices
    # must be its own, which the checks enforce)
    first = tensors[0] if tensors else None
    return first is None or not first.is_meta


def autodiff_levels() -> list[int]:
    """The levels of the torch.func autodiff transforms (Grad, Jvp) on functorch's stack
    now; none under dynamo, whose trace handles functorch itself and cannot make this
    query."""
    if _compiling() or _interpreters() is None:
        return []
    return [i.level() for i in torch._C._functorch.get_interpreter_stack() or ()
            if i.key() in AUTODIFF]


def differentiating() -> bool:
    """Whether a fused convolution must take its torch.func Function (Note [a fused
    convolution under torch.func] in _functorch.py): a Grad or Jvp transform is active, or
    a forward-AD dual level is open."""
    return bool(autodiff_levels()) or (not _compiling() and _dual_level() >= 0)


def under_torch_func() -> bool:
    """Whether a batch norm runs torch's own ops (Note [torch.func transforms]): any
    functorch transform is active (vmap included) or a forward-AD dual level is open; not
    under dynamo."""
    return not _compiling() and (_interpreters() is not None or _dual_level() >= 0)


AUTODIFF = frozenset((torch._C._functorch.TransformType.Grad,
                      torch._C._functorch.TransformType.Jvp))


def call_path(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> int:
    """A fused layer's path for these arguments: CUSTOM_OP where a tracer or transform must
    see the custom op, else GRAPH where autograd records the call (`needs_graph`), else
    BODY (Note [two call paths]); one call instead of two at every layer call."""
    if not takes_eager_path(x, weight, bias, residual):
        return CUSTOM_OP
    return GRAPH if needs_graph(x, weight, bias, residual) else BODY


CUSTOM_OP, GRAPH, BODY = 0, 1, 2


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records this call: grad mode on and some input requiring grad.
    Otherwise the eager path runs the body alone, as a custom op's autograd wrapper does
    under no_grad."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # noqa: SIM110 (as above)
        if t is not None and t.requires_grad:
            return True
    return False
