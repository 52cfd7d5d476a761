"""PyTorch's cuDNN switches, followed by convfuse's calls on CUDA (Note [a framework's
switches] in convfuse/config.py): torch.nn's convolutions honour them, so the drop-in's do.

Read at each CUDA call of the bridge, and (as convfuse.config's source, registered when
this module loads) at each GPU op of convfuse's own API: a few C calls, no Python property;
handed to convfuse.config only when they changed:
- TF32 for cuDNN convolutions: torch.backends.cudnn.conv.fp32_precision, or where that is
  "none" its parents' (torch.backends.cudnn's, then torch.backends'), as ATen resolves it;
  the legacy torch.backends.cudnn.allow_tf32 sets the same precision. A torch without that
  API: the legacy flag itself.
- determinism: torch.backends.cudnn.deterministic or torch.use_deterministic_algorithms.
- autotuning: torch.backends.cudnn.benchmark.
"""

from __future__ import annotations

import torch

from .. import config

_precision = getattr(torch._C, "_get_fp32_precision_getter", None)
# conv's own setting, then the backend's, then the generic one: the first not "none" holds
_PRECISION_CHAIN = (("cuda", "conv"), ("cuda", "all"), ("generic", "all"))


def allow_tf32() -> bool:
    """Whether PyTorch lets its cuDNN convolutions use TF32 now."""
    if _precision is None:
        return bool(torch._C._get_cudnn_allow_tf32())
    for backend, op in _PRECISION_CHAIN:
        value = _precision(backend, op)
        if value != "none":
            return value == "tf32"
    return False


def current() -> tuple[bool, bool, bool]:
    """(allow_tf32, deterministic, benchmark) as PyTorch's cuDNN convolutions read them."""
    c = torch._C
    return (allow_tf32(),
            bool(c._get_cudnn_deterministic() or c._get_deterministic_algorithms()),
            bool(c._get_cudnn_benchmark()))


def follow() -> None:
    """Hand PyTorch's switches to convfuse.config where they differ from what it holds
    (compared with config's own record, not a copy of ours: two threads' calls can then
    not leave a stale setting behind)."""
    now = current()
    if now != config._framework:
        config.constrain(*now)


config.set_source(follow)  # convfuse's own GPU ops follow them too, once the bridge loads
