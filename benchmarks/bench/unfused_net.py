"""The digits net built from unfused operations, as a framework without fusion runs it.

conv (cudnnConvolutionForward) -> bias pass -> relu pass -> max pool, twice; flatten;
matmul -> bias pass; softmax cross-entropy from array operations; backward as separate
passes (relu backward, generic bias reduction, filter and data gradients); Adam as separate
array operations per parameter. Pooling uses the same convfuse op as the fused net, so
the two nets differ exactly in what fusion changes.
"""

from __future__ import annotations

from typing import Any

from convfuse import ops
from convfuse.geometry import ConvGeometry
from convfuse.pool_geometry import PoolGeometry

from . import unfused

CLASSES = 10
IMAGE = 8  # the digits' 8x8 images


def build_fused(cf: Any, device: str, seed: int) -> Any:
    """The net of examples/train_digits.py: (N, 1, 8, 8) -> (N, 10)."""
    return cf.Sequential(
        cf.Conv2d(1, 16, 3, padding=1, activation="relu", device=device, seed=seed),
        cf.MaxPool2d(2),
        cf.Conv2d(16, 32, 3, padding=1, activation="relu", device=device, seed=seed + 1),
        cf.MaxPool2d(2),
        cf.Flatten(),
        cf.Linear(32 * 2 * 2, CLASSES, device=device, seed=seed + 2),
    )


def layer_geometries(batch: int) -> dict[str, Any]:
    g1 = ConvGeometry.create((batch, 1, IMAGE, IMAGE), (16, 1, 3, 3), padding=1)
    p1 = PoolGeometry.create(g1.output_shape, (2, 2), (2, 2), (0, 0), "max", "NCHW")
    g2 = ConvGeometry.create(p1.output_shape, (32, 16, 3, 3), padding=1)
    p2 = PoolGeometry.create(g2.output_shape, (2, 2), (2, 2), (0, 0), "max", "NCHW")
    return {"conv1": g1, "pool1": p1, "conv2": g2, "pool2": p2}


class UnfusedDigitNet:
    """Parameters in the fused net's order: conv1 w, b; conv2 w, b; linear w (out, in), b."""

    def __init__(self, xp: Any, params: list[Any], batch: int, lr: float) -> None:
        self.xp = xp
        self.params = [xp.array(p, copy=True) for p in params]
        self.m = [xp.zeros_like(p) for p in self.params]
        self.v = [xp.zeros_like(p) for p in self.params]
        self.t = 0
        self.lr = lr
        self.geoms = layer_geometries(batch)

    def _conv_relu_pool(self, x: Any, w: Any, b: Any, conv: str, pool: str) -> tuple:
        a = unfused.forward(self.xp, x, w, b, self.geoms[conv], "relu")
        return a, ops.pool_forward(a, self.geoms[pool])

    def forward_backward(self, x: Any, labels: Any) -> tuple[Any, list[Any]]:
        """The loss (0-d array) and every parameter's gradient."""
        xp = self.xp
        w1, b1, w2, b2, w3, b3 = self.params
        g = self.geoms
        a1, p1 = self._conv_relu_pool(x, w1, b1, "conv1", "pool1")
        a2, p2 = self._conv_relu_pool(p1, w2, b2, "conv2", "pool2")
        flat = p2.reshape(p2.shape[0], -1)
        logits = flat @ w3.T
        logits += b3
        loss, dlogits = _cross_entropy(xp, logits, labels)
        dw3 = dlogits.T @ flat
        db3 = dlogits.sum(axis=0)
        dp2 = (dlogits @ w3).reshape(p2.shape)
        dz2 = unfused.relu_backward(xp, ops.pool_backward(dp2, a2, p2, g["pool2"]), a2)
        db2 = unfused.bias_grad_generic(xp, dz2, g["conv2"])
        dw2 = ops.conv_backward_filter(p1, dz2, g["conv2"])
        dp1 = ops.conv_backward_data(dz2, w2, g["conv2"])
        dz1 = unfused.relu_backward(xp, ops.pool_backward(dp1, a1, p1, g["pool1"]), a1)
        db1 = unfused.bias_grad_generic(xp, dz1, g["conv1"])
        dw1 = ops.conv_backward_filter(x, dz1, g["conv1"])
        return loss, [dw1, db1, dw2, db2, dw3, db3]

    def step(self, x: Any, labels: Any) -> Any:
        loss, grads = self.forward_backward(x, labels)
        self.t += 1
        for p, gr, m, v in zip(self.params, grads, self.m, self.v):
            unfused.adam_step(self.xp, p, gr, m, v, self.t, self.lr)
        return loss


def _cross_entropy(xp: Any, logits: Any, labels: Any) -> tuple[Any, Any]:
    """Mean softmax cross-entropy and its gradient, from separate array operations."""
    n = logits.shape[0]
    shifted = logits - logits.max(axis=1, keepdims=True)
    e = xp.exp(shifted)
    s = e.sum(axis=1, keepdims=True)
    rows = xp.arange(n)
    loss = (xp.log(s[:, 0]) - shifted[rows, labels]).mean()
    grad = e / s
    grad[rows, labels] -= 1
    grad /= n
    return loss, grad
