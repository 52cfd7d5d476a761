"""Optimizers over flat parameter buffers: SGD, Adam and AdamW, exact to PyTorch's rules.

At construction each optimizer groups its parameters by dtype and re-homes every
`Parameter.data` and `.grad` into views of one flat buffer per group. A step is then one
fused kernel launch per group on the GPU (capturable in a CUDA graph: the learning rate and
step count live in device memory), or one vectorised NumPy pass per group on the CPU.
"""

from __future__ import annotations

from .adam import Adam, AdamW
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW"]
