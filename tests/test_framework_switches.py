"""Note [a framework's switches] (convfuse/config.py): PyTorch's cuDNN switches combined
with convfuse's flags, read by convfuse.torch's _switches and followed by both APIs' GPU
calls (on tests/_fake_cuda.py's and test_ops_cudnn_wiring's fake devices)."""

from __future__ import annotations

import pytest

from convfuse import config

torch = pytest.importorskip("torch")

from convfuse.torch import _switches  # noqa: E402

# parents first: setting one sets its children
_PRECISIONS = (("generic", "all"), ("cuda", "all"), ("cuda", "conv"), ("cuda", "rnn"))


def _precision(backend: str, op: str, value: str) -> None:
    """torch.backends.<...>.fp32_precision = value, through torch's C setter: the Python
    attributes refuse once torch's test utilities froze the global flags (the module_db
    tests import them), what the C setters do not check."""
    torch._C._set_fp32_precision_setter(backend, op, value)


@pytest.fixture
def switches():
    """PyTorch's switches and convfuse's combination restored after the test (set and
    restored through torch's C setters: see _precision)."""
    c = torch._C
    saved = ([c._get_fp32_precision_getter(*k) for k in _PRECISIONS],
             c._get_cudnn_deterministic(), c._get_cudnn_benchmark(),
             c._get_deterministic_algorithms())
    legacy_tf32 = c._get_cudnn_allow_tf32()
    assert saved[1:] == (False, False, False)
    yield
    # the legacy flag first: the precisions alone leave it stale, and torch's own legacy
    # reads (torch.export's set_flags) then refuse the mix
    c._set_cudnn_allow_tf32(legacy_tf32)
    for k, v in zip(_PRECISIONS, saved[0], strict=True):
        c._set_fp32_precision_setter(*k, v)
    c._set_cudnn_deterministic(saved[1])
    c._set_cudnn_benchmark(saved[2])
    torch.use_deterministic_algorithms(saved[3])
    config.constrain(*_switches.current())  # PyTorch's defaults: nothing added
    assert config.get() is config._current


def test_each_side_can_ask_for_the_safer_choice(switches):
    own = config.get()
    assert own == config.Flags() and config._current is own
    config.constrain(True, False, False)  # PyTorch's defaults add nothing: the same object
    assert config.get() is own
    config.constrain(False, True, True)
    got = config.get()
    assert (got.allow_tf32, got.deterministic, got.benchmark) == (False, True, True)
    assert config.allow_tf32 is True  # reading a flag gives convfuse's own setting
    config.constrain(True, False, False)
    assert config.get() is own
    config.constrain(False, True, True)
    assert config.get() is got  # one snapshot per combined setting: plans and bound calls
    with config.flags(allow_tf32=False, workspace_limit=64):
        assert config.get().allow_tf32 is False and config.get().workspace_limit == 64
        assert config.get().deterministic is True
    assert config.get() is got
    config.constrain(True, False, False)
    with config.flags(deterministic=True, allow_tf32=False):  # convfuse's own side
        assert config.get() is config._current
        assert (config.get().deterministic, config.get().allow_tf32) == (True, False)


def test_pytorchs_tf32_precision_is_read_as_aten_resolves_it(switches):
    assert _switches.allow_tf32() is True  # torch's default for cuDNN convolutions
    torch._C._set_cudnn_allow_tf32(False)
    assert _switches.allow_tf32() is False
    torch._C._set_cudnn_allow_tf32(True)
    _precision("cuda", "conv", "ieee")  # the new API, conv alone
    assert _switches.allow_tf32() is False
    _precision("cuda", "conv", "none")  # conv inherits cudnn's, then torch's
    _precision("generic", "all", "tf32")
    assert _switches.allow_tf32() is True
    _precision("generic", "all", "ieee")
    assert _switches.allow_tf32() is False
    _precision("generic", "all", "none")


def test_pytorchs_determinism_and_benchmark_are_read(switches):
    assert _switches.current() == (True, False, False)
    torch.use_deterministic_algorithms(True)
    assert _switches.current() == (True, True, False)
    torch.use_deterministic_algorithms(False)
    torch._C._set_cudnn_deterministic(True)
    torch._C._set_cudnn_benchmark(True)
    assert _switches.current() == (True, True, True)


def test_a_bridge_call_on_cuda_follows_pytorchs_switches(switches, monkeypatch):
    """The switches flipped between calls hold from the next call on: the plans the calls
    run are keyed on the combined flags."""
    import convfuse.torch as cft
    from convfuse.plan import conv as plan_conv
    from tests._fake_cuda import forget_signatures, install

    cuda = install(monkeypatch)
    keys = []  # every conv plan key made: what the plans are keyed on
    made = plan_conv.PlanKey.create
    monkeypatch.setattr(plan_conv.PlanKey, "create", lambda *a, **k: keys.append(made(*a, **k))
                        or keys[-1])
    try:
        conv = cft.Conv2d(2, 2, 3, padding=1)
        x = torch.randn(1, 2, 4, 4)
        with torch.no_grad():
            conv(x)
            assert {(k.math_type, k.deterministic) for k in keys} == {
                ("CUDNN_DEFAULT_MATH", False)}
            keys.clear()
            torch._C._set_cudnn_allow_tf32(False)
            torch.use_deterministic_algorithms(True)
            conv(x)
        assert keys and {(k.math_type, k.deterministic) for k in keys} == {
            ("CUDNN_FMA_MATH", True)}
        assert cuda.names()  # cuDNN was called
    finally:
        forget_signatures()


def test_convfuses_own_gpu_ops_follow_them_too(switches, monkeypatch):
    """A CuPy op asks the registered source first (ops/_checks.engine), so a switch flipped
    in PyTorch holds for convfuse's own API from its next GPU op."""
    import numpy as np

    from convfuse import ops
    from convfuse.geometry import ConvGeometry
    from tests.test_ops_cudnn_wiring import FakeGpu

    gpu = FakeGpu(monkeypatch)
    geom = ConvGeometry.create((1, 2, 4, 4), (2, 2, 3, 3), padding=1)
    x, w = gpu.array(geom.input_shape, np.float32), gpu.array(geom.weight_shape, np.float32)
    torch._C._set_cudnn_deterministic(True)
    ops.conv_forward(x, w, geom)
    assert config.get().deterministic is True
    torch._C._set_cudnn_deterministic(False)
    ops.conv_forward(x, w, geom)
    assert config.get().deterministic is False


def test_the_hooks_refuse_bad_arguments_before_changing_anything(switches):
    from convfuse import backend

    before = config.get()
    with pytest.raises(TypeError, match=r"config.constrain: deterministic must be a bool, "
                                        r"got str 'yes'"):
        config.constrain(True, "yes", False)
    with pytest.raises(TypeError, match=r"config.set_source: source must be callable or None"
                                        r", got int 3"):
        config.set_source(3)
    assert config.get() is before and config._source is _switches.follow
    with pytest.raises(TypeError, match=r"register_device_array_type: cls must be a class"):
        backend.register_device_array_type("DeviceArray")
