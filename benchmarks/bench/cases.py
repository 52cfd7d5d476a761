"""What gets measured: layer configurations, precisions, bias-gradient shapes, sizes.

The GPU tables are the real ones. On the CPU the same cases run with their batch, spatial
size and channels capped (`scaled`), and each record says what it was scaled from, so a
CPU run exercises every code path without pretending to be the GPU workload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

from convfuse import config
from convfuse.geometry import ConvGeometry

LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class Precision:
    """A dtype plus the math mode cuDNN may use for it.

    `tol` bounds max|fused - unfused| / max|unfused|: the two paths round differently
    (the unfused one rounds after every pass) and may pick different algorithms.
    """

    name: str
    dtype: str
    allow_tf32: bool
    tol: float

    @contextlib.contextmanager
    def flags(self) -> Iterator[None]:
        with config.flags(allow_tf32=self.allow_tf32):
            yield


PRECISIONS: dict[str, Precision] = {
    # 3e-4: with the algorithm search on, fused, unfused and PyTorch may each pick an FFT
    # or Winograd algorithm, each within ~1e-4 of the exact result (tests/gpu's bound)
    "fp32": Precision("fp32", "float32", allow_tf32=False, tol=3e-4),
    "tf32": Precision("tf32", "float32", allow_tf32=True, tol=2e-2),
    "fp16": Precision("fp16", "float16", allow_tf32=False, tol=2e-2),
    "bf16": Precision("bf16", "bfloat16", allow_tf32=False, tol=6e-2),
}


def cpu_skip_reason(precision: Precision, quick: bool) -> str | None:
    """Why the CPU reference engine does not run a precision, or None when it does."""
    if precision.name == "tf32":
        return "CPU: NumPy has no TF32 (the reference engine computes float32 exactly)"
    if precision.name in ("fp16", "bf16") and quick:
        return (f"CPU --quick: the reference engine stores {precision.dtype} but computes in "
                "float32, so it would only repeat the fp32 case")
    return None


def cpu_note(precision: Precision) -> str | None:
    if precision.name in ("fp16", "bf16"):
        return f"CPU: {precision.dtype} storage only; the reference engine computes in float32"
    return None


@dataclass(frozen=True)
class LayerCase:
    """One square 2-d convolution layer: conv + bias + activation (+ residual)."""

    name: str
    origin: str
    batch: int
    cin: int
    cout: int
    size: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    activation: str = "relu"
    residual: bool = False
    scaled_from: str | None = None

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.cin == self.cout

    def x_shape(self, layout: str) -> tuple[int, ...]:
        n, c, s = self.batch, self.cin, self.size
        return (n, s, s, c) if layout == "NHWC" else (n, c, s, s)

    def w_shape(self, layout: str) -> tuple[int, ...]:
        k, c, r = self.cout, self.cin // self.groups, self.kernel
        return (k, r, r, c) if layout == "NHWC" else (k, c, r, r)

    def geometry(self, layout: str) -> ConvGeometry:
        return ConvGeometry.create(self.x_shape(layout), self.w_shape(layout), self.stride,
                                   self.padding, 1, self.groups, layout)

    def describe(self) -> str:
        extra = f" s{self.stride}" if self.stride != 1 else ""
        extra += f" g{self.groups}" if self.groups != 1 else ""
        extra += " +res" if self.residual else ""
        return (f"N{self.batch} {self.cin}->{self.cout} {self.size}x{self.size} "
                f"k{self.kernel}{extra} {self.activation}")

    def scaled(self, batch: int, size: int, channels: int) -> LayerCase:
        """The same layer with batch, spatial size and channels capped (for the CPU)."""
        cin, cout = min(self.cin, channels), min(self.cout, channels)
        groups = min(cin, cout) if self.depthwise else self.groups
        new = replace(self, batch=min(self.batch, batch), size=min(self.size, size),
                      cin=cin, cout=cout, groups=groups)
        return new if new == self else replace(new, scaled_from=self.describe())


_MNIST = "model-zoo MNIST conv net (Flux #558), batch 128"
_R18 = "ResNet-18"
_R50 = "ResNet-50 bottleneck"
RESNET_BATCH = 64

LAYERS: tuple[LayerCase, ...] = (
    LayerCase("mnist.conv1", _MNIST, 128, 1, 16, 28, 3, padding=1),
    LayerCase("mnist.conv2", _MNIST, 128, 16, 32, 14, 3, padding=1),
    LayerCase("mnist.conv3", _MNIST, 128, 32, 32, 7, 3, padding=1),
    LayerCase("r18.layer1.3x3", _R18, RESNET_BATCH, 64, 64, 56, 3, padding=1),
    LayerCase("r18.layer1.3x3+res", _R18 + " basic block, second conv: fused z vs add + relu",
              RESNET_BATCH, 64, 64, 56, 3, padding=1, residual=True),
    LayerCase("r18.layer2.3x3", _R18, RESNET_BATCH, 128, 128, 28, 3, padding=1),
    LayerCase("r18.layer3.3x3", _R18, RESNET_BATCH, 256, 256, 14, 3, padding=1),
    LayerCase("r18.layer4.3x3", _R18, RESNET_BATCH, 512, 512, 7, 3, padding=1),
    LayerCase("r18.layer2.down1x1", _R18 + " downsample (no activation)", RESNET_BATCH,
              64, 128, 56, 1, stride=2, activation="identity"),
    LayerCase("r50.layer1.1x1in", _R50, RESNET_BATCH, 256, 64, 56, 1),
    LayerCase("r50.layer1.1x1out+res", _R50 + " expand: fused z vs add + relu", RESNET_BATCH,
              64, 256, 56, 1, residual=True),
    LayerCase("r50.layer3.1x1in", _R50, RESNET_BATCH, 1024, 256, 14, 1),
    LayerCase("r50.layer3.1x1out+res", _R50, RESNET_BATCH, 256, 1024, 14, 1, residual=True),
    LayerCase("r50.layer4.1x1out+res", _R50, RESNET_BATCH, 512, 2048, 7, 1, residual=True),
    LayerCase("mbv2.dw3x3", "MobileNetV2 depthwise (expanded block 2)", RESNET_BATCH,
              144, 144, 56, 3, padding=1, groups=144),
)

QUICK_LAYERS = ("mnist.conv1", "mnist.conv2", "r18.layer1.3x3", "r18.layer1.3x3+res",
                "r50.layer3.1x1in", "mbv2.dw3x3")

# (batch, spatial, channels) caps for the CPU reference engine.
CPU_CAPS = {True: (8, 14, 32), False: (16, 28, 64)}


def layer_cases(quick: bool, cpu: bool) -> list[LayerCase]:
    cases = [c for c in LAYERS if not quick or c.name in QUICK_LAYERS]
    if cpu:
        cases = [c.scaled(*CPU_CAPS[quick]) for c in cases]
    return cases


@dataclass(frozen=True)
class BiasCase:
    """A dy of shape (N, K, H, W) (channels-first), whose bias gradient is (K,)."""

    name: str
    origin: str
    n: int
    k: int
    h: int
    w: int
    scaled_from: str | None = None

    def shape(self, layout: str) -> tuple[int, ...]:
        n, k, h, w = self.n, self.k, self.h, self.w
        return (n, h, w, k) if layout == "NHWC" else (n, k, h, w)

    def geometry(self, layout: str) -> ConvGeometry:
        """A depthwise 1x1 convolution whose output is dy (only the output's shape matters)."""
        w_shape = (self.k, 1, 1, 1)
        return ConvGeometry.create(self.shape(layout), w_shape, 1, 0, 1, self.k, layout)

    def describe(self) -> str:
        return f"{self.n}x{self.k}x{self.h}x{self.w}"

    def scaled(self, batch: int, size: int, channels: int) -> BiasCase:
        new = replace(self, n=min(self.n, batch), k=min(self.k, channels), h=min(self.h, size),
                      w=min(self.w, size))
        return new if new == self else replace(new, scaled_from=self.describe())


BIAS_CASES: tuple[BiasCase, ...] = (
    BiasCase("v100.published", "FACTS: cuDNN 1.9 ms vs sum 0.11 ms on V100 fp32 (2019)",
             128, 64, 74, 74),
    BiasCase("mnist.conv1.out", _MNIST, 128, 16, 28, 28),
    BiasCase("r18.layer1.out", _R18, RESNET_BATCH, 64, 56, 56),
    BiasCase("r50.layer1.1x1out.out", _R50, RESNET_BATCH, 256, 56, 56),
    BiasCase("r18.layer4.out", _R18, RESNET_BATCH, 512, 7, 7),
    BiasCase("linear.out", "the digits net's Linear, batch 128", 128, 10, 1, 1),
)
QUICK_BIAS = ("v100.published", "mnist.conv1.out", "r18.layer1.out", "linear.out")
BIAS_ACTIVATIONS = ("identity", "relu")
BIAS_PRECISIONS = ("fp32", "fp16", "bf16")  # no TF32: a reduction has no matmul


def bias_cases(quick: bool, cpu: bool) -> list[BiasCase]:
    cases = [c for c in BIAS_CASES if not quick or c.name in QUICK_BIAS]
    if cpu:
        cases = [c.scaled(*CPU_CAPS[quick]) for c in cases]
    return cases


TRAIN_BATCHES = (8, 128)


def adam_sizes(quick: bool, cpu: bool) -> list[int]:
    if cpu:
        return [1_000_000] if quick else [1_000_000, 10_000_000]
    return [1_000_000, 10_000_000] if quick else [1_000_000, 10_000_000, 30_000_000, 100_000_000]
