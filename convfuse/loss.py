"""Softmax cross-entropy loss with its gradient, on NumPy (CPU) or CuPy (GPU) logits."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import backend, kernels
from .backend import array_module, cupy_module
from .dtypes import SUPPORTED, compute_dtype
from .errors import BackwardBeforeForwardError, ConvfuseError, DeviceMismatchError, renamed

#: Threads per block of the loss kernels (loss.cu's XENT_BLOCK); one warp per row.
XENT_BLOCK = 256
_SUFFIXES = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}


class CrossEntropyLoss:
    """Mean softmax cross-entropy over a batch, as torch.nn.CrossEntropyLoss().

    `loss = loss_fn(logits, labels)` takes logits (N, C) of a supported float dtype and
    integer labels (N,) on the same device, and returns the mean loss as a 0-d array on
    that device: float64 for float64 logits, else float32. The log-softmax is computed
    stably (max-subtracted log-sum-exp) in float64 for float64 logits and float32 otherwise.
    `loss_fn.correct` is then a 0-d int64 array on the same device: how many rows' argmax
    (as numpy.argmax: the first maximum on ties, the first NaN if any) equals the label.
    Nothing is read back to the host, so a training step can be captured as a CUDA graph
    and metrics summed on the device (convfuse.metrics.Mean).

    `dlogits = loss_fn.backward()` returns (softmax(logits) - onehot(labels)) / N in the
    logits' dtype. It is computed by the forward's kernel, so backward costs nothing; it
    is handed out once per forward (a second backward raises BackwardBeforeForwardError).

    Labels outside [0, C): on the CPU the forward raises ValueError naming the value. On
    the GPU checking would need a host sync, so instead that row's loss is NaN (making the
    mean loss NaN), its gradient row is zero and it does not count as correct.
    """

    def __init__(self) -> None:
        self._dlogits: Any = None
        #: Correct predictions in the last forward's batch (0-d int64); None before one.
        self.correct: Any = None

    def __call__(self, logits: Any, labels: Any) -> Any:
        return self.forward(logits, labels)

    def forward(self, logits: Any, labels: Any) -> Any:
        try:
            for name, a in (("logits", logits), ("labels", labels)):
                if not (isinstance(a, np.ndarray) or backend.is_cupy(a)):
                    raise TypeError(f"{name} must be a NumPy or CuPy array, got "
                                    f"{type(a).__name__}")
            xp = array_module(logits, labels)  # refuses NumPy + CuPy
            _validate(logits, labels)
        except (TypeError, ValueError, ConvfuseError) as exc:
            raise renamed(exc, "CrossEntropyLoss") from None
        if xp is np:
            try:
                try:
                    loss, correct, dlogits = _forward_cpu(logits, labels)
                except (RuntimeWarning, FloatingPointError):
                    # an inf logit (inf - inf) under warnings-as-errors or np.seterr(
                    # all="raise"): the call is pure, so it runs again under IEEE semantics,
                    # as on the GPU and in PyTorch. Not an errstate around every call: that
                    # costs ~0.9 us of a ~15 us tiny call; in the default warning mode NumPy
                    # still prints its RuntimeWarning once.
                    with np.errstate(all="ignore"):
                        loss, correct, dlogits = _forward_cpu(logits, labels)
            except ValueError as exc:
                raise renamed(exc, "CrossEntropyLoss") from None
        else:
            loss, correct, dlogits = _forward_gpu(logits, labels)  # pragma: gpu
        self._dlogits, self.correct = dlogits, correct
        return loss

    def backward(self) -> Any:
        """d(mean loss)/d(logits) of the last forward, in the logits' dtype."""
        if self._dlogits is None:
            raise BackwardBeforeForwardError(
                "CrossEntropyLoss.backward() needs a forward first (each forward's gradient "
                "is returned by one backward)"
            )
        dlogits, self._dlogits = self._dlogits, None
        return dlogits

    def __repr__(self) -> str:
        return "CrossEntropyLoss()"


def _validate(logits: Any, labels: Any) -> None:
    if logits.dtype not in SUPPORTED.values():
        raise TypeError(
            f"logits must be a float array ({', '.join(SUPPORTED)}), got dtype {logits.dtype}"
        )
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D (N, C), got shape {tuple(logits.shape)}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise TypeError(f"labels must be an integer array, got dtype {labels.dtype}")
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D (N,), got shape {tuple(labels.shape)}")
    n, c = logits.shape
    if labels.shape[0] != n:
        raise ValueError(f"labels has {labels.shape[0]} entries, but logits has {n} rows")
    if n == 0 or c == 0:
        raise ValueError(f"logits must have at least one row and one class, got shape {(n, c)}")


def _forward_cpu(logits: np.ndarray, labels: np.ndarray) -> tuple[Any, Any, Any]:
    n, c = logits.shape
    bad = (labels < 0) | (labels >= c)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"labels must be in [0, {c}) for {c} classes; got {labels[row]} at row {row}"
        )
    ct = compute_dtype(logits.dtype)
    x = logits.astype(ct)  # a copy: the input is never modified
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    picked = x[rows, labels] - m[:, 0]
    loss = np.asarray((np.log(s[:, 0]) - picked).sum(dtype=ct) / ct.type(n), dtype=ct)
    correct = np.asarray(np.count_nonzero(np.argmax(x, axis=1) == labels), dtype=np.int64)
    grad = e / s
    grad[rows, labels] -= 1
    grad *= ct.type(1.0 / n)
    return loss, correct, grad.astype(logits.dtype, copy=False)


def _forward_gpu(logits: Any, labels: Any) -> tuple[Any, Any, Any]:  # pragma: gpu
    cp: Any = cupy_module()
    if logits.device.id != labels.device.id:
        raise DeviceMismatchError(
            f"logits are on GPU {logits.device.id} but labels on GPU {labels.device.id}"
        )
    with logits.device:
        x = cp.ascontiguousarray(logits)
        if labels.dtype in (np.int32, np.int64):
            lab = cp.ascontiguousarray(labels)
        else:
            lab = labels.astype(np.int64)
        label_suffix = "i32" if lab.dtype == np.int32 else "i64"
        n, c = x.shape
        ct = compute_dtype(x.dtype)
        # One extra element each: xent_mean stores the mean loss and the count there, and
        # the 0-d views handed out keep the row buffers alive (see loss.cu).
        row_loss = cp.empty(n + 1, dtype=ct)
        row_correct = cp.empty(n + 1, dtype=np.int64)
        dlogits = cp.empty_like(x)
        warps_per_block = XENT_BLOCK // 32
        blocks = max(1, min(-(-n // warps_per_block), 65535))
        rows_kernel = kernels.function(
            "loss", f"xent_rows_{_SUFFIXES[x.dtype.name]}_{label_suffix}"
        )
        rows_kernel((blocks,), (XENT_BLOCK,),
                    (x, lab, np.int64(n), np.int64(c), np.float64(1.0 / n), dlogits,
                     row_loss, row_correct))
        mean_kernel = kernels.function("loss", f"xent_mean_{_SUFFIXES[ct.name]}")
        mean_kernel((1,), (XENT_BLOCK,), (row_loss, row_correct, np.int64(n)))
        return row_loss[n], row_correct[n], dlogits


def kernel_names() -> list[str]:
    """Every kernel this module launches (the CPU suite checks each is in the cubin)."""
    rows = [f"xent_rows_{s}_{li}" for s in _SUFFIXES.values() for li in ("i32", "i64")]
    return [*rows, "xent_mean_f32", "xent_mean_f64"]
