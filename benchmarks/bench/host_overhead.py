"""Host time per call (issue #25): convfuse against PyTorch eager where the arithmetic is
negligible and Python's per-call work decides a small or medium batch's step.

Rows, each convfuse / PyTorch with a goal (<= target) and met/unmet as goals.py records it:
- conv_forward_nograd, conv_forward_backward, batchnorm2d_train_fwd_bwd,
  conv_transpose2d_fwd_bwd: convfuse.torch's layers against torch.nn's at tiny shapes
  (1x1x4x4 inputs, 3x3 kernels; BatchNorm2d at 2x1x4x4 in training mode). CPU goal 2.5x;
  on a GPU the same calls on CUDA tensors, timed on the host (perf_counter around each call,
  no sync: the launches are the cost), goal 1.5x;
- numpy_conv2d_forward: convfuse.Conv2d on NumPy arrays against torch.nn.Conv2d (no_grad),
  CPU only, goal 3x;
- aspp_fwd_bwd: DeepLabV3's ASPP conv (960 -> 256, 3x3, dilation and padding 36, a 4x4 map),
  forward + backward through convfuse.torch against torch.nn; goal 2x (reference/conv.py
  Note [choosing the method] says why it was 23x);
- resnet18_step_b8/32/128 (GPU only): one training step (zero_grad, forward, cross-entropy,
  backward, SGD momentum 0.9) of torchvision's resnet18, convfuse.torch.convert of it against
  PyTorch eager, and both captured as one torch.cuda.graph; no goal, ratios only.

Each timed sample runs `inner` calls and is divided by it, so the timer's own cost stays out
of a 20 us figure; forms are timed interleaved (timing.py Note [spread and unstable figures])
with this section's own short budget (about 1-2 s a row on the CPU, 10-15 s for the section;
--quick halves it). On the CPU both libraries run on one thread (torch.set_num_threads(1) and
the reference engine's pool), so a row compares per-call work, not core counts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

import convfuse as cf

from . import checks, records, timing
from .records import Context
from .timing import Budget, CpuTimer

try:  # a convfuse without the reference engine's thread pool (for before/after runs)
    from convfuse.ops.reference import _threads
except ImportError:  # pragma: no cover
    _threads = None

SECTION = "host-overhead"
CPU_TARGETS = {
    "conv_forward_nograd": 2.5, "conv_forward_backward": 2.5,
    "batchnorm2d_train_fwd_bwd": 2.5, "conv_transpose2d_fwd_bwd": 2.5,
    "numpy_conv2d_forward": 3.0, "aspp_fwd_bwd": 2.0,
}
GPU_HOST_TARGET = 1.5  # host time per fused call against PyTorch eager's, on a GPU
RESNET_BATCHES = (8, 32, 128)
INNER = 20  # calls per timed sample at the tiny shapes
TOL = 1e-4
# On a GPU both libraries may run float32 convolutions in TF32 (convfuse's config.allow_tf32
# and torch.backends.cudnn.allow_tf32 are on by default), with algorithms each chooses: the
# agreement checks there take cases.py's TF32 tolerance, as the timed calls are the
# defaults users run.
GPU_TOL = 2e-2


def budget(quick: bool, gpu: bool) -> Budget:
    """Per row: warm-up, then interleaved rounds until the medians settle or time runs out."""
    if gpu:  # pragma: gpu
        return Budget(5, 10, 100, 1.0 if quick else 2.0)
    return Budget(3, 5, 100, 0.6 if quick else 1.5)


def run(ctx: Context) -> list[dict[str, Any]]:
    gpu = ctx.engine.is_gpu
    where = "GPU" if gpu else "CPU"
    names = [*CPU_TARGETS, *(f"resnet18_step_b{b}" for b in RESNET_BATCHES)]
    if ctx.torch is None:
        return [records.skip(_new(n, gpu), f"{where}: {ctx.torch_note}") for n in names]
    if gpu and ctx.torch.device != "cuda":  # pragma: gpu
        return [records.skip(_new(n, gpu), f"GPU: {ctx.torch_note}") for n in names]
    torch = ctx.torch.torch
    saved_threads = torch.get_num_threads()
    if not gpu:
        torch.set_num_threads(1)
        if _threads is not None:
            _threads.set_num_threads(1)
    try:
        bench = _Bench(ctx, torch, gpu)
        out = [bench.row(name, fn) for name, fn in (
            ("conv_forward_nograd", bench.conv_forward),
            ("conv_forward_backward", bench.conv_forward_backward),
            ("batchnorm2d_train_fwd_bwd", bench.batchnorm),
            ("conv_transpose2d_fwd_bwd", bench.conv_transpose),
        )]
        numpy_rec = _new("numpy_conv2d_forward", gpu)
        out.append(records.skip(numpy_rec, "GPU: the NumPy API row times the CPU engine")
                   if gpu else bench.row("numpy_conv2d_forward", bench.numpy_forward))
        out.append(bench.row("aspp_fwd_bwd", bench.aspp))
        for i, b in enumerate(RESNET_BATCHES):
            rec = _new(f"resnet18_step_b{b}", gpu, batch=b)
            if not gpu:
                out.append(records.skip(rec, "CPU: no GPU here ("
                                        + (cf.backend.gpu_unavailable_reason() or "CPU run")
                                        + "); the ResNet-18 steps run on a GPU only"))
                continue
            try:  # pragma: gpu
                out.append(records.guarded(ctx, rec, f"{SECTION} {rec['case']}",
                                           lambda rec=rec, b=b: bench.resnet(rec, b)))
            except KeyboardInterrupt:  # pragma: gpu
                # a time cap's SIGINT (the acceptance run's host part) during the longest
                # rows: the section keeps what it measured, and is written, marked cut
                ctx.interrupted = True
                out += [records.skip(_new(f"resnet18_step_b{c}", gpu, batch=c),
                                     "interrupted (SIGINT: a time cap) before this row "
                                     "finished") for c in RESNET_BATCHES[i:]]
                break
        return out
    finally:
        if not gpu:
            torch.set_num_threads(saved_threads)
            if _threads is not None:
                _threads.set_num_threads(None)


def _new(name: str, gpu: bool, **fields: Any) -> dict[str, Any]:
    rec = records.new(SECTION, name, device="GPU" if gpu else "CPU", **fields)
    if name.startswith("resnet18"):
        return rec
    target = GPU_HOST_TARGET if gpu and name != "aspp_fwd_bwd" else CPU_TARGETS[name]
    rec["goal"] = {"comparison": "<=", "target": target, "unit": "x PyTorch"}
    return rec


def _met(rec: dict, measured: float, low: float, high: float, unstable: bool) -> None:
    """goals.py's verdict: `goal_ratio` = measured / target, <= 1 when met."""
    g = rec["goal"]
    g.update(measured=measured, low=low, high=high, unstable=unstable,
             met=measured <= g["target"])
    rec["ratios"]["goal_ratio"] = measured / g["target"]
    rec["ratio_intervals"]["goal_ratio"] = {
        "low": low / g["target"], "high": high / g["target"],
        "spread": (high - low) / measured, "unstable": unstable}


def _per_call(stats: timing.Stats, inner: int) -> timing.Stats:
    return timing.summarize([s / inner for s in stats.samples])


class _Bench:
    """The rows' forms: each method fills its record's checks and returns the two forms
    (convfuse, PyTorch) as (timer, fn) pairs and the calls per sample, or None when the
    forms disagree (the record then says so and nothing is timed)."""

    def __init__(self, ctx: Context, torch: Any, gpu: bool) -> None:
        import convfuse.torch as cft

        self.ctx, self.torch, self.gpu, self.cft = ctx, torch, gpu, cft
        self.device = "cuda" if gpu else "cpu"
        self.nn = torch.nn
        # host time per call, on either device (on a GPU from an idle queue: HostTimer)
        self.host = timing.HostTimer(torch.cuda.synchronize) if gpu else CpuTimer()
        self.budget = budget(ctx.quick, gpu)
        self.tol = GPU_TOL if gpu else TOL
        # why CUDA graphs are no longer tried in this process (None: they are)
        self.no_capture: str | None = None

    def row(self, name: str, make: Callable[[dict], Any]) -> dict[str, Any]:
        rec = _new(name, self.gpu, threads=1 if not self.gpu else None)
        rec["timer"] = self.host.kind  # the payload's method.timer is the engine's

        def measure() -> None:
            made = make(rec)
            if made is None:
                return
            ours, theirs, inner = made
            rec["timer"] = ours[0].kind  # the forms' own timer (the ASPP row's is events)
            stats = timing.measure_interleaved({"convfuse": ours, "torch": theirs}, 1,
                                               self.budget)
            for form, st in stats.items():
                records.put_timing(rec, form, _per_call(st, inner))
            records.ratio(rec, "convfuse/pytorch", "convfuse", "torch")
            iv = rec["ratio_intervals"]["convfuse/pytorch"]
            _met(rec, rec["ratios"]["convfuse/pytorch"], iv["low"], iv["high"],
                 iv["unstable"])

        return records.guarded(self.ctx, rec, f"{SECTION} {name}", measure)

    # -- helpers ------------------------------------------------------------------------
    def _tensor(self, shape: tuple[int, ...], seed: int, grad: bool = False) -> Any:
        t = self.torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)
                                  .astype(np.float32)).to(self.device)
        return t.requires_grad_(grad)

    def _agree(self, rec: dict, pairs: list[tuple[str, Any, Any]]) -> bool:
        for what, a, b in pairs:
            rec["checks"].append(checks.compare(what, a.detach().cpu().numpy(),
                                                b.detach().cpu().numpy(), self.tol))
        if not checks.all_ok(rec["checks"]):
            records.check_failed(rec, checks.failures(rec["checks"]))
            return False
        return True

    def _looped(self, fn: Callable[[], Any], inner: int) -> Callable[[int], None]:
        def run(i: int) -> None:
            for _ in range(inner):
                fn()
        return run

    def _pair(self, ours: Callable[[], Any], theirs: Callable[[], Any], inner: int = INNER,
              timer: Any = None) -> tuple[Any, Any, int]:
        t = timer or self.host
        return (t, self._looped(ours, inner)), (t, self._looped(theirs, inner)), inner

    def _fwd_bwd(self, rec: dict, ours: Any, theirs: Any, x: Any, what: str,
                 timer: Any = None, inner: int = INNER) -> Any:
        """Forms running forward + backward from a fixed dy, after checking the output and
        every gradient (a sum's gradient through a batch norm is ~0: no test of anything)."""
        ya, yb = ours(x), theirs(x)
        dy = self._tensor(tuple(ya.shape), 9)
        ga = self.torch.autograd.grad(ya, [x, *ours.parameters()], dy)
        gb = self.torch.autograd.grad(yb, [x, *theirs.parameters()], dy)
        pairs = [(f"{what} output", ya, yb)] + [
            (f"{what} grad {i}", a, b) for i, (a, b) in enumerate(zip(ga, gb, strict=True))]
        if not self._agree(rec, pairs):
            return None
        return self._pair(lambda: ours(x).backward(dy), lambda: theirs(x).backward(dy),
                          inner, timer)

    # -- rows ---------------------------------------------------------------------------
    def conv_forward(self, rec: dict) -> Any:
        rec["shape"] = "x 1x1x4x4, Conv2d(1, 1, 3, padding=1), no_grad"
        theirs = self.nn.Conv2d(1, 1, 3, padding=1).to(self.device)
        ours = self.cft.convert(copy.deepcopy(theirs))
        x = self._tensor((1, 1, 4, 4), 0)
        no_grad = self.torch.no_grad
        with no_grad():
            if not self._agree(rec, [("forward", ours(x), theirs(x))]):
                return None

        def run(m: Any) -> Callable[[], Any]:
            def call() -> Any:
                with no_grad():
                    return m(x)
            return call

        return self._pair(run(ours), run(theirs))

    def conv_forward_backward(self, rec: dict) -> Any:
        rec["shape"] = "x 1x1x4x4 (requires grad), Conv2d(1, 1, 3, padding=1), y.backward(dy)"
        theirs = self.nn.Conv2d(1, 1, 3, padding=1).to(self.device)
        ours = self.cft.convert(copy.deepcopy(theirs))
        return self._fwd_bwd(rec, ours, theirs, self._tensor((1, 1, 4, 4), 1, True), "conv")

    def batchnorm(self, rec: dict) -> Any:
        rec["shape"] = "x 2x1x4x4 (requires grad), BatchNorm2d(1) training, y.backward(dy)"
        theirs = self.nn.BatchNorm2d(1).to(self.device).train()
        ours = self.cft.convert(copy.deepcopy(theirs)).train()
        return self._fwd_bwd(rec, ours, theirs, self._tensor((2, 1, 4, 4), 2, True),
                             "batchnorm")

    def conv_transpose(self, rec: dict) -> Any:
        rec["shape"] = ("x 1x1x4x4 (requires grad), ConvTranspose2d(1, 1, 3, padding=1), "
                        "y.backward(dy)")
        theirs = self.nn.ConvTranspose2d(1, 1, 3, padding=1).to(self.device)
        ours = self.cft.convert(copy.deepcopy(theirs))
        return self._fwd_bwd(rec, ours, theirs, self._tensor((1, 1, 4, 4), 3, True),
                             "conv_transpose")

    def numpy_forward(self, rec: dict) -> Any:
        rec["shape"] = "x 1x1x4x4 NumPy, convfuse.Conv2d(1, 1, 3, padding=1) vs torch.nn no_grad"
        ours = cf.Conv2d(1, 1, 3, padding=1, seed=self.ctx.seed)
        theirs = self.nn.Conv2d(1, 1, 3, padding=1)
        with self.torch.no_grad():
            theirs.weight.copy_(self.torch.from_numpy(ours.weight.data.copy()))
            theirs.bias.copy_(self.torch.from_numpy(ours.bias.data.copy()))
        x = np.random.default_rng(4).standard_normal((1, 1, 4, 4)).astype(np.float32)
        tx = self.torch.from_numpy(x)
        no_grad = self.torch.no_grad
        with no_grad():
            want = theirs(tx).numpy()
        rec["checks"].append(checks.compare("forward", ours(x), want, self.tol))
        if not checks.all_ok(rec["checks"]):
            records.check_failed(rec, checks.failures(rec["checks"]))
            return None

        def torch_call() -> Any:
            with no_grad():
                return theirs(tx)

        return self._pair(lambda: ours(x), torch_call)

    def aspp(self, rec: dict) -> Any:
        rec["shape"] = ("x 1x960x4x4 (requires grad), Conv2d(960, 256, 3, padding=36, "
                        "dilation=36) (DeepLabV3 ASPP), y.backward(dy)")
        theirs = self.nn.Conv2d(960, 256, 3, padding=36, dilation=36).to(self.device)
        ours = self.cft.convert(copy.deepcopy(theirs))
        timer = self.ctx.torch.timer if self.gpu else self.host
        return self._fwd_bwd(rec, ours, theirs, self._tensor((1, 960, 4, 4), 5, True), "aspp",
                             timer, inner=1)

    def resnet(self, rec: dict, batch: int) -> None:  # pragma: gpu
        """Eager and CUDA-graph steps of torchvision's resnet18, convfuse.torch.convert of it
        against PyTorch; a form that fails to build or capture is reported, not fatal."""
        torch = self.torch
        try:
            import torchvision
        except ImportError as exc:
            records.skip(rec, f"GPU: torchvision is not importable ({exc})")
            return
        size = 64 if self.ctx.quick else 224
        tf32 = "float32 (TF32 convolutions)" if cf.config.get().allow_tf32 else "float32"
        rec["shape"] = (f"resnet18 batch {batch} at {size}x{size}, 1000 classes, {tf32}, "
                        "SGD momentum 0.9")
        torch.backends.cudnn.benchmark = True
        base = torchvision.models.resnet18(num_classes=1000).to("cuda")
        models = {"torch": base, "convfuse": self.cft.convert(copy.deepcopy(base))}
        x = torch.randn(batch, 3, size, size, device="cuda")
        y = torch.randint(0, 1000, (batch,), device="cuda")
        # the two models agree before either is timed: a wrong conversion is no speed-up
        loss_fn = torch.nn.CrossEntropyLoss()
        with torch.no_grad():
            losses = [loss_fn(m(x), y).reshape(1) for m in models.values()]
        if not self._agree(rec, [("loss of the first batch", losses[1], losses[0])]):
            return
        forms: dict[str, Any] = {}
        rec["forms"] = {}
        rec["timer"] = self.ctx.torch.timer.kind
        for name, model in models.items():
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            step = _train_step(torch, model, opt, x, y)
            forms[f"{name}_eager"] = (self.ctx.torch.timer, lambda i, s=step: s())
            rec["forms"][f"{name}_eager"] = "measured"
            if self.no_capture is not None:
                rec["forms"][f"{name}_graph"] = f"not attempted: {self.no_capture}"
                continue
            stream = torch.cuda.current_stream()
            try:
                forms[f"{name}_graph"] = (self.ctx.torch.timer, _captured(torch, step))
                rec["forms"][f"{name}_graph"] = "measured"
            except Exception as exc:  # a capture failure is a finding, not a crash
                # torch.cuda.graph leaves its capture stream current when capture_end
                # raises, and before 2.12 (pytorch#180395) the caching allocator can stay
                # mid-capture, so that every later capture fails in empty_cache: this
                # row's other forms run on the caller's stream, later rows capture nothing
                torch.cuda.set_stream(stream)
                self.no_capture = (f"an earlier capture failed ({rec['case']} {name}), "
                                   "which can leave PyTorch's allocator mid-capture")
                if isinstance(exc.__context__, KeyboardInterrupt):
                    # a time cap's interrupt inside the capture, which capture_end's own
                    # error replaced: the cap, not a finding
                    raise exc.__context__ from None
                rec["forms"][f"{name}_graph"] = f"error: {type(exc).__name__}: {exc}"
        stats = timing.measure_interleaved(forms, 1, self.ctx.budget)
        for form, st in stats.items():
            records.put_timing(rec, form, st)
        records.ratio(rec, "convfuse/pytorch", "convfuse_eager", "torch_eager")
        records.ratio(rec, "convfuse_graph/torch_graph", "convfuse_graph", "torch_graph")
        records.ratio(rec, "convfuse_graph/convfuse_eager", "convfuse_graph", "convfuse_eager")


def _train_step(torch: Any, model: Any, opt: Any, x: Any, y: Any) -> Callable[[], Any]:
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> Any:
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _captured(torch: Any, step: Callable[[], Any]) -> Callable[[int], Any]:  # pragma: gpu
    """The step captured as one CUDA graph (warm-up on a side stream first, as PyTorch's
    whole-network capture recipe does), returned as a replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return lambda i: graph.replay()
