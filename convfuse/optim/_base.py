"""What every convfuse optimizer shares: flat groups, the learning rate, step dispatch, state.

A step is, per dtype group, one fused kernel launch on the GPU or one vectorised NumPy pass
on the CPU, over the group's flat buffers (see _flat.py). On the GPU the learning rate and
the step count live in device memory, so `step()` queues one launch per group and nothing
else (but, until the host's own writes are seen done, a stream wait: Note [optimizer state
across streams]): no synchronisation, no allocation, no host-to-device copy. That is what makes it
capturable in a CUDA graph, and setting `.lr` queues an async fill of the device scalar.

Copies: `copy.deepcopy` and pickle of an optimizer (alone, or with its model in one call)
give a working optimizer: its state is its parameters, hyperparameters and `state_dict()`,
and restoring it re-homes the (copied) parameters into new flat buffers, so the copies of
the model and the optimizer stay linked exactly as the originals are. Copying a model and
its optimizer in two separate calls copies the parameters twice, as in PyTorch. A shallow
`copy.copy` re-homes the same parameters into the copy's buffers, so the original's next
step raises (check_homes) instead of silently updating nothing.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import dtypes, kernels
from ..backend import array_module, to_device
from ..errors import CaptureError, ConvfuseError
from ..nn.module import renamed
from ..nn.parameter import Parameter, check_set_to_none
from ..nn.state import is_torch_bfloat16, torch_bfloat16_numpy
from ..ops._checks import as_float
from ._flat import (
    FlatGroup,
    Params,
    aligned_zeros,
    build_groups,
    check_homes,
    check_params,
    device_context,
    slots_in_order,
)

BLOCK = 256
_SUFFIX = {
    dtypes.float32: "f32", dtypes.float64: "f64", dtypes.float16: "f16", dtypes.bfloat16: "bf16",
}


def real(value: Any, what: str) -> float:
    """`value` as a Python float; TypeError naming `what` unless it is a real number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} {value!r}")
    return as_float(value)


def check_lr(lr: Any) -> float:
    value = real(lr, "lr")
    if not 0.0 <= value < math.inf:  # `not` of the range, so that NaN is refused too
        raise ValueError(f"Invalid learning rate: {lr}")
    return value


# torch.optim's arguments that choose how its step runs, not what it computes: convfuse's
# step is always one fused, capturable launch (one NumPy pass on the CPU) with the numbers
# of torch's single-tensor rule, so every value torch takes is accepted and changes nothing
_HOW = {"foreach": True, "fused": True, "capturable": False}  # name: whether None is allowed
# torch.optim's arguments that change the update: only their default, False, is implemented
_OFF = ("amsgrad", "maximize", "differentiable")
# what torch.optim's defaults are for the flags above, saved in state_dict()'s group so that
# torch.optim loads a convfuse checkpoint and steps it (torch.optim.SGD.__setstate__ fills
# in no default for `dampening`: without it, torch's first step raised KeyError)
_TORCH_DEFAULTS = {"dampening": 0.0, "amsgrad": False, "maximize": False, "foreach": None,
                   "capturable": False, "differentiable": False, "fused": None}
# keys torch.optim's groups may hold that say nothing about the update: an lr_scheduler's
# `initial_lr` (its own bookkeeping) and the `param_names` of an optimizer built from
# named_parameters()
_IGNORED = ("initial_lr", "param_names")


def take_torch_flags(hyper: dict[str, Any], names: tuple[str, ...]) -> None:
    """Remove torch.optim's flags `names` from `hyper` (constructor keywords, or a torch
    state dict's group), refusing a value convfuse does not implement: TypeError for a
    non-bool, ValueError for a True that would change the update."""
    for name in names:
        if name not in hyper:
            continue
        value = hyper.pop(name)
        if name in _HOW and _HOW[name] and value is None:
            continue
        if not isinstance(value, (bool, np.bool_)):
            kind = "None or a bool" if _HOW.get(name) else "a bool"
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
        if name in _OFF and value:
            raise ValueError(f"{name}={value!r} is not supported: convfuse's fused update is "
                             f"torch.optim's with {name}=False (its default)")


def step_count(step: Any, where: str) -> int:
    """A state entry's step: an int, or (as torch.optim saves it) a 0-d tensor or array
    holding an integral value, such as torch's tensor(3.)."""
    if isinstance(step, (numbers.Integral, np.integer)) and not isinstance(step, (bool, np.bool_)):
        return int(step)
    if tuple(getattr(step, "shape", (None,))) == () and hasattr(step, "__array__"):
        try:
            a = np.asarray(step)
        except Exception:  # a device tensor: NumPy cannot read it
            a = None
        if a is not None and a.dtype.kind in "iu":
            return int(a)
        if a is not None and a.dtype.kind == "f" and float(a).is_integer():  # not inf, NaN
            return int(float(a))
    raise TypeError(f"{where} must be an int (or a 0-d tensor or array holding one), got "
                    f"{type(step).__name__} {step!r}")


class FlatOptimizer:
    """Base class: subclasses set `_kernel` (the kernel name without its dtype suffix) and
    implement `_validated` (keyword hyperparameters -> `defaults`, raising PyTorch's
    messages), `_state_names_of`, `_update_cpu` and `_hyper_args` (the kernel's trailing
    scalar arguments, in its order)."""

    _kernel = ""
    # torch.optim's own flags this optimizer's group holds (state_dict() saves them)
    _torch_flags: tuple[str, ...] = ()
    # whether torch.optim's state for this rule counts steps (SGD's holds only its buffer)
    _torch_counts_steps = True

    def __init__(self, params: Params, lr: Any, **hyper: Any) -> None:
        try:
            self._lr = check_lr(lr)
            self._defaults = self._validated(**hyper)
            plist = check_params(params)
        except (TypeError, ValueError, ConvfuseError) as exc:
            raise renamed(exc, type(self).__name__) from None
        self._build(plist)

    def _build(self, plist: list[Parameter]) -> None:
        self._groups: list[FlatGroup] = build_groups(plist, self._state_names())
        self._device_id = self._groups[0].device_id
        self._lr_dev: Any = None
        self._filled: Any = None  # Note [optimizer state across streams]
        self._filled_on = 0  # the stream the last host write was queued on
        if self._device_id >= 0:  # pragma: gpu
            self._setup_gpu()
            self._mark_filled()

    # -- copies ---------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        params = [s.param for _, s in slots_in_order(self._groups)]
        return {"params": params, "lr": self._lr, "defaults": dict(self._defaults),
                "state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # The parameters arrive already copied (deepcopy's memo, pickle's references), so
        # re-homing them links this optimizer to the copied model, not the original.
        self._lr = check_lr(state["lr"])
        self._defaults = self._validated(**state["defaults"])
        self._build(check_params(state["params"]))
        self.load_state_dict(state["state"])

    # -- subclass interface -------------------------------------------------------------
    def _validated(self, **hyper: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _state_names_of(self, defaults: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _state_names(self) -> tuple[str, ...]:
        return self._state_names_of(self._defaults)

    def _update_cpu(self, g: FlatGroup, t: int, lr: float) -> None:
        raise NotImplementedError

    def _hyper_args(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _state_args(self, g: FlatGroup) -> tuple[Any, ...]:
        return tuple(g.state[name] for name in self._state_names())

    # -- GPU ------------------------------------------------------------------------------
    def _setup_gpu(self) -> None:  # pragma: gpu
        import cupy

        with device_context(self._device_id):
            attrs = cupy.cuda.Device(self._device_id).attributes
            # A grid-stride loop over at most one full wave of resident blocks: enough to
            # saturate memory bandwidth, and fixed at construction so a captured graph and
            # an eager step launch the same grid.
            per_sm = max(1, attrs["MaxThreadsPerMultiProcessor"] // BLOCK)
            cap = attrs["MultiProcessorCount"] * per_sm
            self._lr_dev = cupy.full((), self._lr, dtype=cupy.float64)
            for g in self._groups:
                g.step_dev = cupy.zeros(1, dtype=cupy.int64)
                g.ticket_dev = cupy.zeros(1, dtype=cupy.uint32)
                g.kernel = kernels.function("optim", f"{self._kernel}_{_SUFFIX[g.dtype]}")
                g.grid = max(1, min(-(-g.numel // BLOCK), cap))

    # Note [optimizer state across streams]
    # The flat buffers, the state, the step counters and the learning rate are written by
    # the host's calls (construction, load_state_dict, an lr assignment) on the stream
    # current then; step() launches on the stream current at the step, which may be
    # another one that nothing orders after those writes: the kernel could read a step
    # counter or ticket before its zero fill (a wrong bias correction, and no error). So
    # each such write ends with an event, and the next step's stream waits for it until
    # the host has seen it done (ops/cudnn/constants.py's DeviceConstant: a query, no sync;
    # a wait recorded into a graph if the step is being captured). A step on the write's
    # own stream needs nothing: that stream's order has the write first.
    def _mark_filled(self) -> None:  # pragma: gpu
        import cupy

        from ..ops.cudnn.constants import DeviceConstant

        with device_context(self._device_id):
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record()
            self._filled = DeviceConstant((), event)
            self._filled_on = int(cupy.cuda.get_current_stream().ptr)

    def _after_fill(self, filled: Any) -> None:  # pragma: gpu
        import cupy

        from ..ops.cudnn.device import cupy_context

        with device_context(self._device_id):
            ctx = cupy_context()
            if ctx.stream_ptr == self._filled_on and not ctx.is_capturing():
                self._filled = None  # the same stream: its own order has the fill first
                return
            filled.ordered(cupy, ctx)
        if filled.complete:
            self._filled = None

    def _kernel_args(self, g: FlatGroup) -> tuple[Any, ...]:
        """The launch arguments in the kernels' order (on the CPU the device scalars are
        None; the test suite checks the order and types against optim.cu)."""
        return (g.data, g.grad, *self._state_args(g), np.int64(g.numel), self._lr_dev,
                g.step_dev, g.ticket_dev, *self._hyper_args())

    def _launch(self, g: FlatGroup) -> None:  # pragma: gpu
        with device_context(g.device_id):
            g.kernel((g.grid,), (BLOCK,), self._kernel_args(g))

    # -- public API -----------------------------------------------------------------------
    @property
    def defaults(self) -> dict[str, Any]:
        """The hyperparameters (but lr), as a new dict: every step reads the optimizer's own,
        and a value written into them would skip the constructor's checks. A write into this
        copy changes nothing, as a write into torch.optim's `defaults` changes no existing
        group (convfuse has one, fixed at construction or by load_state_dict)."""
        return dict(self._defaults)

    @property
    def lr(self) -> float:
        """The learning rate (a host-side mirror: reading it never touches the device)."""
        return self._lr

    @lr.setter
    def lr(self, value: Any) -> None:
        try:
            lr = check_lr(value)
        except (TypeError, ValueError) as exc:
            raise renamed(exc, type(self).__name__) from None
        if self._lr_dev is None:
            self._lr = lr
            return
        with device_context(self._device_id):  # pragma: gpu
            _refuse_lr_in_capture(type(self).__name__)  # before anything changes
            self._lr = lr
            self._lr_dev.fill(lr)  # an async kernel on the current stream
            self._mark_filled()

    @property
    def device(self) -> str:
        return "cpu" if self._device_id < 0 else "cuda"

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every gradient: one fill of each group's flat grad buffer (refused, as step
        is, once a parameter's arrays were replaced: it would zero what no layer reads).
        `set_to_none=True` (PyTorch's default) is refused: gradients are views of that
        buffer, and always arrays."""
        check_set_to_none(type(self).__name__, set_to_none)
        check_homes(self._groups)
        for g in self._groups:
            with device_context(g.device_id):
                g.grad.fill(0)

    def step(self, closure: None = None) -> None:
        """Apply one update to every parameter from its current `.grad`. torch.optim's
        `closure` (re-evaluating the loss) is not supported: TypeError unless None."""
        if closure is not None:
            raise TypeError(f"{type(self).__name__}.step: closure is not supported (convfuse "
                            "has no autograd to re-evaluate the loss): run the forward and "
                            "backward, then call step()")
        check_homes(self._groups)
        if self._filled is not None:  # pragma: gpu
            self._after_fill(self._filled)
        for g in self._groups:
            if g.on_gpu:  # pragma: gpu
                self._launch(g)
            else:
                g.step += 1
                # IEEE semantics, as on the GPU and in PyTorch: inf/NaN propagate silently.
                with np.errstate(all="ignore"):
                    self._update_cpu(g, g.step, self._lr)
            for s in g.slots:  # host counters only: a backward of an older forward refuses
                s.param._version += 1

    def _steps_taken(self, g: FlatGroup) -> int:
        if g.on_gpu:  # pragma: gpu
            return int(g.step_dev.get()[0])  # synchronises: state_dict is not on the hot path
        return g.step

    def state_dict(self) -> dict[str, Any]:
        """PyTorch-shaped state: per-parameter host (NumPy) copies, keyed by position, each
        buffer in its parameter's checkpoint layout (`Parameter.state_axes`: a channels-last
        conv weight's state as `model.state_dict()` holds the weight, (K, C, *kernel)), so
        a model + optimizer checkpoint moves between layouts and to torch.optim."""
        steps = {id(g): self._steps_taken(g) for g in self._groups}
        state: dict[int, dict[str, Any]] = {}
        for g, s in slots_in_order(self._groups):
            entry: dict[str, Any] = {"step": steps[id(g)]}
            for name in self._state_names():
                view = g.state[name][s.offset : s.offset + s.size].reshape(s.shape)
                host = s.param.to_state_layout(np.asarray(to_device(view, "cpu")))
                entry[name] = np.array(host, copy=True, order="C")
            state[s.index] = entry
        n = sum(len(g.slots) for g in self._groups)
        flags = {k: _TORCH_DEFAULTS[k] for k in self._torch_flags}
        group = {"lr": self._lr, **self._defaults, **flags, "params": list(range(n))}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (hyperparameters, lr, steps and buffers).
        Everything is checked before anything is written; errors name the optimizer."""
        try:
            self._load_state_dict(state_dict)
        except (TypeError, ValueError, ConvfuseError) as exc:
            raise renamed(exc, type(self).__name__) from None

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("state_dict must be a dict with keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if not (isinstance(groups, (list, tuple)) and len(groups) == 1
                and isinstance(groups[0], dict)):
            raise ValueError("state_dict['param_groups'] must be a list of exactly one dict")
        group = groups[0]
        n = sum(len(g.slots) for g in self._groups)
        ids = list(group.get("params", ()))
        if len(ids) != n:
            raise ValueError(f"state_dict is for {len(ids)} parameters, this optimizer has {n}")
        if ids != list(range(n)):
            raise ValueError(f"state_dict['param_groups'][0]['params'] must be the ids "
                             f"0..{n - 1} in order (one group, as state_dict() saves it), got "
                             f"{ids}")
        hyper = {k: v for k, v in group.items() if k not in ("lr", "params", *_IGNORED)}
        defaults = self._validated(**hyper)
        names = self._state_names_of(defaults)
        lr = check_lr(group.get("lr"))
        plan = self._checked_entries(state_dict["state"], names)
        fresh = None
        if names != self._state_names():
            # torch.optim takes the checkpoint's hyperparameters whatever the optimizer was
            # built with: SGD(momentum=0.9)'s state into SGD(lr) brings its momentum buffer,
            # allocated here, after every check and before anything changes. (Other
            # buffers than the captured ones: a captured step is captured again after it.)
            fresh = [self._new_state(g, names) for g in self._groups]
        self.lr = lr  # first: on the GPU it refuses a capture in progress (CaptureError)
        self._defaults = defaults
        for i, g in enumerate(self._groups):
            if fresh is not None:
                # the old buffers stay alive on the GPU: a step captured before would
                # replay on them (stale, but never on freed memory); the CPU captures none
                if g.on_gpu:
                    g.retired.append(g.state)
                g.state = fresh[i]
            with device_context(g.device_id):
                for s in g.slots:
                    for name in names:
                        value = plan[s.index][name].astype(g.compute_dtype).reshape(-1)
                        g.state[name][s.offset : s.offset + s.size] = to_device(value, self.device)
                self._set_steps(g, plan[g.slots[0].index]["step"])
        if self._device_id >= 0:  # pragma: gpu
            self._mark_filled()

    @staticmethod
    def _new_state(g: FlatGroup, names: tuple[str, ...]) -> dict[str, Any]:
        """Zeroed state buffers `names` for group `g`, laid out as build_groups lays them."""
        xp = array_module(g.data)
        with device_context(g.device_id):
            return {name: aligned_zeros(xp, int(g.data.size), g.compute_dtype)
                    for name in names}

    def _entry_step(self, entry: dict[str, Any], index: int, names: tuple[str, ...]) -> int:
        """The step an entry of `state_dict['state']` has taken, or ValueError unless it
        holds `names` and its step (or is one torch.optim writes, see _checked_entries)."""
        if not entry:  # torch.optim's for a parameter that has not stepped yet
            return 0
        if set(entry) == {"step", *names}:
            return step_count(entry["step"], f"state_dict['state'][{index}]['step']")
        if not self._torch_counts_steps and names and set(entry) == set(names):
            return 1  # torch.optim.SGD's buffer: the rule reads only that it was stepped
        raise ValueError(f"state_dict['state'][{index}] must hold {sorted({'step', *names})}")

    def _checked_entries(self, state: Any, names: tuple[str, ...]) -> dict[int, dict[str, Any]]:
        """The state's entries by parameter index, checked and in storage order. torch.optim
        creates a parameter's state at its first step with a gradient: a missing or empty
        entry is one that has not stepped (step 0, zero buffers), and torch.optim.SGD's
        entries, which count no steps, have stepped once (all its rule reads)."""
        if not isinstance(state, dict):
            raise ValueError(f"state_dict['state'] must be a dict, got {type(state).__name__}")
        plan: dict[int, dict[str, Any]] = {}
        for g in self._groups:
            steps = set()
            for s in g.slots:
                entry = state.get(s.index, {})
                if not isinstance(entry, dict):
                    raise ValueError(f"state_dict['state'][{s.index}] must be a dict, got "
                                     f"{type(entry).__name__}")
                step = self._entry_step(entry, s.index, names)
                steps.add(step)
                arrays = {k: _host_array(entry[k], f"state_dict['state'][{s.index}][{k!r}]")
                          if entry else np.zeros(s.param.state_shape) for k in names}
                for k, a in arrays.items():
                    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
                        raise TypeError(f"state_dict['state'][{s.index}][{k!r}] must be a "
                                        f"floating array, got dtype {a.dtype}")
                    want = s.param.state_shape
                    if a.shape != want:
                        where = "the parameter has" if want == s.shape else \
                            "the parameter's checkpoint layout has"
                        raise ValueError(f"state_dict['state'][{s.index}][{k!r}] has shape "
                                         f"{a.shape}, {where} {want}")
                    arrays[k] = s.param.from_state_layout(a)  # the storage order
                plan[s.index] = {"step": step, **arrays}
            if len(steps) != 1 or min(steps) < 0:
                raise ValueError(f"parameters of dtype {g.dtype} must share one step count >= 0, "
                                 f"got {sorted(steps)} (a missing or empty entry, torch.optim's "
                                 "for a parameter that never had a gradient, counts 0: "
                                 "convfuse steps every parameter of a dtype together)")
        return plan

    def _set_steps(self, g: FlatGroup, t: int) -> None:
        if g.on_gpu:  # pragma: gpu
            g.step_dev.fill(t)
        else:
            g.step = t

    def __repr__(self) -> str:
        hyper = ", ".join(f"{k}={v}" for k, v in self._defaults.items())
        sizes = ", ".join(f"{g.dtype}: {len(g.slots)} params" for g in self._groups)
        return f"{type(self).__name__}(lr={self._lr}, {hyper}; {self.device}; {sizes})"


def _host_array(value: Any, where: str) -> np.ndarray:
    """A state buffer as a host array: NumPy, CuPy, or a CPU torch tensor (bfloat16
    included, which NumPy cannot take over __array__)."""
    try:
        if is_torch_bfloat16(value):
            return torch_bfloat16_numpy(value)
        return np.asarray(to_device(value, "cpu"))
    except Exception as exc:
        raise TypeError(f"{where}: cannot read a {type(value).__name__} as an array "
                        f"({exc})") from None


def _refuse_lr_in_capture(name: str) -> None:  # pragma: gpu
    """Inside a captured step the device copy's fill would be recorded with this value and
    replayed over every later assignment, silently: refuse it, as the module notes say lr
    is set between replays."""
    from ..plan.capture import stream_is_capturing

    if stream_is_capturing():
        raise CaptureError(f"{name}.lr was assigned while a CUDA graph was being captured: "
                           "the graph would replay this value over later assignments; set "
                           "lr outside the captured step (between replays)")
