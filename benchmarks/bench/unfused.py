"""The unfused forms: what Flux and PyTorch eager do, one pass per operation.

Every function here works on NumPy and CuPy arrays alike; on CuPy each line is at least
one kernel launch and one round trip of the activation tensor through memory.
"""

from __future__ import annotations

from typing import Any

from convfuse import ops
from convfuse.geometry import ConvGeometry

ADAM_BETAS = (0.9, 0.999)  # PyTorch's defaults, which convfuse.optim.Adam shares
ADAM_EPS = 1e-8


def bias_view_shape(geom: ConvGeometry) -> tuple[int, ...]:
    """The bias as an array that broadcasts along the output's channel axis."""
    shape = [1] * (geom.rank + 2)
    shape[geom.channel_axis] = geom.out_channels
    return tuple(shape)


def forward(xp: Any, x: Any, w: Any, b: Any, geom: ConvGeometry, activation: str,
            residual: Any = None) -> Any:
    """cudnnConvolutionForward, then a bias-add pass, a residual-add pass, an activation pass."""
    y = ops.conv_forward(x, w, geom)
    y += b.reshape(bias_view_shape(geom))  # PyTorch eager adds a conv's bias after cuDNN's conv
    if residual is not None:
        y += residual  # torchvision's `out += identity`
    if activation == "relu":
        xp.maximum(y, 0, out=y)  # torchvision's `relu(inplace=True)`
    elif activation != "identity":
        raise ValueError(f"the unfused forward covers identity and relu, not {activation!r}")
    return y


def relu_backward(xp: Any, dy: Any, y: Any) -> Any:
    """dz = dy where y > 0, else 0: one elementwise pass (PyTorch's threshold_backward)."""
    return xp.where(y > 0, dy, 0)


def bias_grad_generic(xp: Any, dz: Any, geom: ConvGeometry) -> Any:
    """CuPy's (or NumPy's) generic reduction, accumulating in float32, cast to dz's dtype."""
    return dz.sum(axis=geom.reduce_axes, dtype=xp.float32).astype(dz.dtype)


def adam_step(xp: Any, p: Any, g: Any, m: Any, v: Any, t: int, lr: float,
              betas: tuple[float, float] = ADAM_BETAS, eps: float = ADAM_EPS) -> None:
    """One Adam update as separate array operations, each a pass over memory."""
    b1, b2 = betas
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * (g * g)
    denom = xp.sqrt(v / (1 - b2**t))
    denom += eps
    p -= (lr / (1 - b1**t)) * (m / denom)
