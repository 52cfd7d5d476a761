"""convfuse inside PyTorch: fused convolution and batch-normalization layers as
torch.nn.Modules.

    pip install --no-build-isolation -e ".[cu12,torch]"   (after requirements/build-cu12.txt)

`Conv1d/2d/3d` take torch.nn.Conv*d's arguments plus `activation=` and compute
act(conv(x) + bias + residual) in one convfuse op, forward and backward; `BatchNorm1d/2d/3d`
take torch.nn.BatchNorm*d's plus `activation=` and compute act(batchnorm(x) + residual)
(docs/PYTORCH.md); `ConvTranspose1d/2d/3d` take torch.nn.ConvTranspose*d's plus
`activation=`. `convert(model)` swaps a model's convolutions and batch norms (and the
activation right after each, inside an nn.Sequential) for them, keeping the same Parameters
and buffers. `torch.compile(model, backend="convfuse")` fuses the same chains wherever a
model's forward writes them (a ResNet block's `bn2 -> += identity -> relu`), and
`explain(model, *inputs)` lists what it fused and left (convfuse/torch/dynamo/).
`import convfuse` never imports torch; only this package does.
"""

from __future__ import annotations

from . import _requires  # noqa: F401 (first: PyTorch present and recent enough)

# isort: split
from . import _flops, _vmap
from ._errors import InputDeviceError, InputShapeError, InputTypeError, TransformError
from .batchnorm import BatchNorm1d, BatchNorm2d, BatchNorm3d
from .conv import Conv1d, Conv2d, Conv3d
from .conv_transpose import ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from .convert import activation_of, convert, fused_batchnorm, fused_conv, fused_conv_transpose
from .dynamo import backend, explain

_flops.register()  # after the ops exist (conv, conv_transpose)
_vmap.register()

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "Conv1d", "Conv2d", "Conv3d",
           "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "InputDeviceError",
           "InputShapeError", "InputTypeError", "TransformError",
           "activation_of", "backend", "convert", "explain", "fused_batchnorm", "fused_conv",
           "fused_conv_transpose"]
