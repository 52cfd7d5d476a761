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
    """Mean softmax cross-entropy over a batch, as torch.nn.CrossEntropyLoss(ignore_index=).

    `CrossEntropyLoss(*, ignore_index=-100)`. Keyword-only: torch's positional order starts
    with `weight`, which convfuse does not have (nor `reduction` or `label_smoothing`: the
    loss is torch's default mean). `ignore_index` is an int (NumPy ints too), torch's -100
    by default: rows with that label (padding, say) are left out of the loss, the
    gradient, the correct count and the mean's denominator. It may lie inside [0, C): that
    class's rows are then ignored, as in torch.

    `loss = loss_fn(logits, labels)` takes logits (N, C) of a supported float dtype and
    integer labels (N,) on the same device, and returns the mean loss over the kept rows
    (those whose label is not `ignore_index`) as a 0-d array on that device: float64 for
    float64 logits, else float32. The log-softmax is computed stably (max-subtracted
    log-sum-exp) in float64 for float64 logits and float32 otherwise. If every row is
    ignored the loss is NaN (0/0, as torch). `loss_fn.correct` is then a 0-d int64 array
    on the same device: how many kept rows' argmax (as numpy.argmax: the first maximum on
    ties, the first NaN if any) equals the label. Nothing is read back to the host (the
    kept rows are counted on the device), so a training step can be captured as a CUDA
    graph and metrics summed on the device (convfuse.metrics.Mean).

    `dlogits = loss_fn.backward()` returns (softmax(logits) - onehot(labels)) / kept in
    the logits' dtype, with a zero row for each ignored row (all zeros if every row is
    ignored). An ignored row's gradient is zero even where its logits are inf or NaN,
    which torch's log_softmax backward turns into a NaN row. It is computed by the
    forward's kernel, so backward costs nothing; it is handed out once per forward (a
    second backward raises BackwardBeforeForwardError).

    Other labels outside [0, C): on the CPU the forward raises ValueError naming the value.
    On the GPU checking would need a host sync, so instead that row's loss is NaN (making
    the mean loss NaN), its gradient row is zero and it does not count as correct; it is a
    kept row, counted in the denominator.
    """

    def __init__(self, *, ignore_index: int = -100) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
            raise TypeError(f"CrossEntropyLoss: ignore_index must be an int, got "
                            f"{type(ignore_index).__name__} {ignore_index!r}")
        if not -(2**63) <= ignore_index < 2**63:
            raise ValueError("CrossEntropyLoss: ignore_index must fit in int64 (as torch's), "
                             f"got {ignore_index}")
        self._ignore_index = int(ignore_index)
        self._ignore_arg = np.int64(ignore_index)  # the kernels' argument, made once
        self._dlogits: Any = None
        #: Correct predictions in the last forward's batch (0-d int64); None before one.
        self.correct: Any = None

    @property
    def ignore_index(self) -> int:
        """The label whose rows are ignored (read-only: fixed at construction)."""
        return self._ignore_index

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
                    loss, correct, dlogits = _forward_cpu(logits, labels, self._ignore_index)
                except (RuntimeWarning, FloatingPointError):
                    # an inf logit (inf - inf) under warnings-as-errors or np.seterr(
                    # all="raise"): the call is pure, so it runs again under IEEE semantics,
                    # as on the GPU and in PyTorch. Not an errstate around every call: that
                    # costs ~0.9 us of a ~15 us tiny call; in the default warning mode NumPy
                    # still prints its RuntimeWarning once.
                    with np.errstate(all="ignore"):
                        loss, correct, dlogits = _forward_cpu(logits, labels,
                                                              self._ignore_index)
            except ValueError as exc:
                raise renamed(exc, "CrossEntropyLoss") from None
        else:
            loss, correct, dlogits = _forward_gpu(logits, labels,  # pragma: gpu
                                                  self._ignore_arg)
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
        if self._ignore_index == -100:
            return "CrossEntropyLoss()"
        return f"CrossEntropyLoss(ignore_index={self._ignore_index})"


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


def _forward_cpu(logits: np.ndarray, labels: np.ndarray,
                 ignore_index: int = -100) -> tuple[Any, Any, Any]:
    n, c = logits.shape
    bad = (labels < 0) | (labels >= c)
    has_bad = bad.any()
    ignored = None  # a mask only when some row is ignored: the usual call pays one compare
    if has_bad or 0 <= ignore_index < c:
        ignored = labels == ignore_index  # a Python int: compared exactly with any dtype
        if has_bad:
            bad &= ~ignored
            if bad.any():
                row = int(np.argmax(bad))
                raise ValueError(f"labels must be in [0, {c}) for {c} classes (or "
                                 f"ignore_index={ignore_index}); got {labels[row]} at row {row}")
        if not ignored.any():
            ignored = None
    ct = compute_dtype(logits.dtype)
    x = logits.astype(ct)  # a copy: the input is never modified
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(axis=1, keepdims=True)
    rows = np.arange(n)
    if ignored is None:
        kept, lab = n, labels
    else:  # an ignored row indexes column 0, then its values are dropped
        kept, lab = n - int(np.count_nonzero(ignored)), np.where(ignored, 0, labels)
    row_loss = np.log(s[:, 0]) - (x[rows, lab] - m[:, 0])
    hits = np.argmax(x, axis=1) == labels
    if ignored is not None:
        row_loss[ignored] = 0  # not a product: an ignored row's NaN must not leak
        hits &= ~ignored
    # kept == 0: NaN, as torch's 0/0, without NumPy's divide warning
    mean = row_loss.sum(dtype=ct) / ct.type(kept) if kept else ct.type(np.nan)
    loss = np.asarray(mean, dtype=ct)
    correct = np.asarray(np.count_nonzero(hits), dtype=np.int64)
    grad = e / s
    grad[rows, lab] -= 1
    grad *= ct.type(1.0 / max(kept, 1))
    if ignored is not None:
        grad[ignored] = 0
    return loss, correct, grad.astype(logits.dtype, copy=False)


def _forward_gpu(logits: Any, labels: Any,
                 ignore_index: np.int64) -> tuple[Any, Any, Any]:  # pragma: gpu
    cp: Any = cupy_module()
    dev = logits.device.id
    if dev != labels.device.id:
        raise DeviceMismatchError(
            f"logits are on GPU {dev} but labels on GPU {labels.device.id}"
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
        # One extra element each: xent_mean stores the mean loss and the correct count
        # there, and the 0-d views handed out keep the row buffers alive; row_correct's
        # second extra element holds xent_kept's count of kept rows (see loss.cu).
        row_loss = cp.empty(n + 1, dtype=ct)
        row_correct = cp.empty(n + 2, dtype=np.int64)
        dlogits = cp.empty_like(x)
        warps_per_block = XENT_BLOCK // 32
        blocks = max(1, min(-(-n // warps_per_block), 65535))
        n64 = np.int64(n)
        # logits' device is the current one: function_on skips asking CUDA for it
        kept_kernel = kernels.function_on("loss", f"xent_kept_{label_suffix}", dev)
        kept_kernel((1,), (XENT_BLOCK,), (lab, n64, ignore_index, row_correct))
        rows_kernel = kernels.function_on(
            "loss", f"xent_rows_{_SUFFIXES[x.dtype.name]}_{label_suffix}", dev
        )
        rows_kernel((blocks,), (XENT_BLOCK,),
                    (x, lab, n64, np.int64(c), ignore_index, dlogits, row_loss, row_correct))
        mean_kernel = kernels.function_on("loss", f"xent_mean_{_SUFFIXES[ct.name]}", dev)
        mean_kernel((1,), (XENT_BLOCK,), (row_loss, row_correct, n64))
        return row_loss[n], row_correct[n], dlogits


def kernel_names() -> list[str]:
    """Every kernel this module launches (the CPU suite checks each is in the cubin)."""
    rows = [f"xent_rows_{s}_{li}" for s in _SUFFIXES.values() for li in ("i32", "i64")]
    return ["xent_kept_i32", "xent_kept_i64", *rows, "xent_mean_f32", "xent_mean_f64"]
