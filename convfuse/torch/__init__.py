"""convfuse inside PyTorch: fused convolution layers as torch.nn.Modules.

    pip install ".[cu12,torch]"

`Conv1d/2d/3d` take torch.nn.Conv*d's arguments plus `activation=` and compute
act(conv(x) + bias + residual) in one convfuse op, forward and backward (docs/PYTORCH.md).
`convert(model)` swaps a model's convolutions (and the activation right after each, inside
an nn.Sequential) for them, keeping the same Parameters. `import convfuse` never imports
torch; only this package does.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "convfuse.torch needs PyTorch: pip install 'convfuse[torch]' (convfuse itself works "
        "without it)"
    ) from exc

from .conv import Conv1d, Conv2d, Conv3d
from .convert import activation_of, convert, fused_conv

__all__ = ["Conv1d", "Conv2d", "Conv3d", "activation_of", "convert", "fused_conv"]
