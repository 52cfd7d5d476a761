"""PyTorch, for the convfuse/PyTorch columns: the same cases on the same data.

On a GPU this needs a CUDA PyTorch and is skipped with a note otherwise; it runs with
torch.backends.cudnn.benchmark = True and PyTorch's own CUDA events. On the CPU, when
torch is importable, the CPU reference engine is compared against PyTorch CPU, labelled
so: that says nothing about either library on a GPU.
Inputs go through host memory (float32) so that no DLPack support for bfloat16 is assumed;
that copy happens before timing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import convfuse as cf

from . import checks
from .cases import LayerCase, Precision
from .engine import Engine
from .timing import CpuTimer, TorchEventTimer

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def load(engine: Engine, disabled: bool,
         autotune: bool = True) -> tuple[TorchSide | None, str]:
    """The PyTorch side for this engine, or None and a sentence saying why not; on a GPU
    PyTorch's cuDNN autotunes as convfuse does (`autotune`: not under --heuristics)."""
    if disabled:
        return None, "PyTorch comparison disabled (--no-torch)"
    try:
        import torch
    except ImportError:
        return None, "PyTorch is not installed, so there is no PyTorch column"
    if engine.is_gpu:  # pragma: gpu
        if not torch.cuda.is_available():
            return None, (f"PyTorch {torch.__version__} has no usable CUDA, so the GPU run "
                          "has no PyTorch column")
        return TorchSide(torch, "cuda", autotune), ""
    return TorchSide(torch, "cpu"), (f"PyTorch {torch.__version__} CPU compared against the "
                                     "CPU reference engine (says nothing about GPUs)")


class TorchSide:
    def __init__(self, torch: Any, device: str, autotune: bool = True) -> None:
        self.torch = torch
        self.device = device
        self.label = f"PyTorch {torch.__version__} ({'CUDA' if device == 'cuda' else 'CPU'})"
        self.timer = TorchEventTimer(torch) if device == "cuda" else CpuTimer()
        # cuDNN's flags only matter on CUDA, and setting one raises once anything imported
        # torch's test utilities (they freeze the global flags): a CPU run sets none.
        # convfuse.torch, once imported, makes convfuse follow these switches too (Note [a
        # framework's switches]): both sides autotune, or neither.
        if device == "cuda":  # pragma: gpu
            torch.backends.cudnn.benchmark = autotune

    # -- helpers ------------------------------------------------------------------------
    def release(self) -> None:
        """Hand PyTorch's cached blocks back, so CuPy's next case finds the memory free."""
        if self.device == "cuda":  # pragma: gpu
            self.torch.cuda.empty_cache()

    def _set_tf32(self, allow: bool) -> None:
        if self.device != "cuda":
            return
        self.torch.backends.cudnn.allow_tf32 = allow  # pragma: gpu
        self.torch.backends.cuda.matmul.allow_tf32 = allow

    def set_precision(self, allow_tf32: bool) -> None:
        """PyTorch's TF32 flags for a case's precision, set before either side builds a
        plan: once convfuse.torch is imported convfuse's TF32 is its own flag AND PyTorch's,
        so a flag the previous case left would change convfuse's precision between the
        check and the timed calls."""
        self._set_tf32(allow_tf32)

    def match_convfuse_tf32(self) -> None:
        """PyTorch's TF32 flags as convfuse's config allows TF32, for the convolutions and
        for matmul (convfuse's Linear is a 1x1 convolution): each section starts so
        (fused_vs_unfused._section), since a section that varies precision leaves the last
        one's flags set and the next would time PyTorch in another precision."""
        self._set_tf32(cf.config.get().allow_tf32)

    def tensor(self, host: np.ndarray, dtype: str = "float32", nhwc: bool = False) -> Any:
        """A device tensor from a host array; NHWC arrays become channels_last NCHW views."""
        t = self.torch.from_numpy(np.ascontiguousarray(host, dtype=np.float32))
        t = t.to(self.device).to(getattr(self.torch, _DTYPES[dtype]))
        return t.permute(0, 3, 1, 2) if nhwc else t

    def _host(self, t: Any, nhwc: bool = False) -> np.ndarray:
        t = t.detach()
        if nhwc:
            t = t.permute(0, 2, 3, 1)
        return t.float().cpu().numpy()

    def _adam(self, params: Any, lr: float) -> tuple[Any, str]:
        optim = self.torch.optim
        try:
            return optim.Adam(params, lr=lr, fused=True), "fused=True"
        except (RuntimeError, ValueError, TypeError) as exc:
            return optim.Adam(params, lr=lr), f"default (fused=True refused: {exc})"

    # -- layer forward ------------------------------------------------------------------
    def conv_forward(self, case: LayerCase, layout: str, prec: Precision,
                     host_sets: list) -> tuple[tuple[Any, Any], np.ndarray]:
        """PyTorch eager: conv2d (cuDNN conv, then its bias add), += residual, relu_.

        Returns the form to time, (timer, fn) under no_grad, and its first output."""
        F = self.torch.nn.functional
        nhwc = layout == "NHWC"
        self._set_tf32(prec.allow_tf32)
        sets = []
        for s in host_sets:
            sets.append({
                "x": self.tensor(s["x"], prec.dtype, nhwc),
                "w": self.tensor(s["w"], prec.dtype, nhwc),
                "b": self.tensor(s["b"], prec.dtype),
                "z": None if s["z"] is None else self.tensor(s["z"], prec.dtype, nhwc),
            })

        def run(i: int) -> Any:
            s = sets[i]
            y = F.conv2d(s["x"], s["w"], s["b"], case.stride, case.padding, 1, case.groups)
            if s["z"] is not None:
                y += s["z"]
            if case.activation == "relu":
                y.relu_()
            return y

        def timed(i: int) -> Any:
            with self.torch.no_grad():
                return run(i)

        return (self.timer, timed), self._host(timed(0), nhwc)

    # -- training step ------------------------------------------------------------------
    def _net(self, weights: list[np.ndarray]) -> Any:
        nn = self.torch.nn
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 2 * 2, 10),
        ).to(self.device)
        with self.torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(self.tensor(np.asarray(w, np.float32)).reshape(p.shape))
        return model

    def train_forms(self, ctx: Any, weights: list[np.ndarray], xs: list, ys: list,
                    lr: float, want_loss: np.ndarray, want_grads: list[np.ndarray],
                    rec: dict) -> dict[str, Any]:
        """torch_eager and torch_compile: check loss and gradients; return the forms that
        agree, as (timer, step) pairs for the caller to time alongside its own."""
        eng = ctx.engine
        self._set_tf32(cf.config.get().allow_tf32 if self.device == "cuda" else False)
        txs = [self.tensor(eng.to_host(x)) for x in xs]
        tys = [self.torch.from_numpy(eng.to_host(y).astype(np.int64)).to(self.device)
               for y in ys]
        tol = 1e-4 if self.device == "cpu" else 2e-2
        out = {}
        for form, compiled in (("torch_eager", False), ("torch_compile", True)):
            if compiled and self.device == "cpu":
                rec["forms"][form] = ("skipped on the CPU: it would time Inductor's C++ code "
                                      "against the reference engine")
                continue
            try:
                note, step = self._train_one(txs, tys, weights, lr, compiled, want_loss,
                                             want_grads, tol, rec, form)
                rec["forms"][form] = note
                if step is not None:
                    out[form] = (self.timer, step)
            except Exception as exc:  # PyTorch's failure is reported, not convfuse's
                rec["forms"][form] = f"error: {type(exc).__name__}: {exc}"
        return out

    def _train_one(self, txs: list, tys: list, weights: list, lr: float, compiled: bool,
                   want_loss: np.ndarray, want_grads: list, tol: float, rec: dict,
                   form: str) -> tuple[str, Any]:
        model = self._net(weights)
        # dynamic=False: each batch size its own static graph, as a user compiling one
        # training run gets (a second size would otherwise compile with a symbolic batch)
        forward = self.torch.compile(model, dynamic=False) if compiled else model
        opt, opt_note = self._adam(model.parameters(), lr)
        loss_fn = self.torch.nn.CrossEntropyLoss()

        def grads(i: int) -> Any:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(forward(txs[i]), tys[i])
            loss.backward()
            return loss

        def step(i: int) -> Any:
            loss = grads(i)
            opt.step()
            return loss

        loss0 = self._host(grads(0))
        found = [checks.compare(f"{form} vs fused loss", loss0, want_loss, tol)]
        for i, (p, g) in enumerate(zip(model.parameters(), want_grads)):
            found.append(checks.compare(f"{form} vs fused grad {i}",
                                        self._host(p.grad).reshape(g.shape), g, tol))
        rec["checks"].extend(found)
        if not checks.all_ok(found):
            return "check failed (not timed): " + checks.failures(found), None
        mode = "torch.compile(model)" if compiled else "eager"
        bench = ", cudnn.benchmark=True" if self.device == "cuda" else ""
        return f"{self.label}, {mode}{bench}, Adam {opt_note}", step

    # -- optimizer ----------------------------------------------------------------------
    def adam(self, ctx: Any, ps: list, gs: list, lr: float, want_delta: np.ndarray,
             rec: dict) -> Any:
        """torch.optim.Adam on the same tensors: its form (timer, step) once its first
        update agrees with convfuse's, else None (with a note)."""
        eng = ctx.engine
        params = []
        for p, g in zip(ps, gs):
            tp = self.torch.nn.Parameter(self.tensor(eng.to_host(p)))
            tp.grad = self.tensor(eng.to_host(g))
            params.append(tp)
        opts = [self._adam([tp], lr) for tp in params]
        p0 = eng.to_host(ps[0]).astype(np.float64)
        opts[0][0].step()
        delta = self._host(params[0]).astype(np.float64) - p0
        check = checks.compare("PyTorch vs fused update", delta, want_delta, 1e-3)
        rec["checks"].append(check)
        if not check["ok"]:
            rec["notes"].append("PyTorch's Adam update disagrees; its time is not reported")
            return None
        rec["torch"] = f"{self.label}, torch.optim.Adam {opts[0][1]}"
        for opt, _ in opts[1:]:  # each one's first step allocates its state: not timed
            opt.step()
        return self.timer, lambda i: opts[i][0].step()
