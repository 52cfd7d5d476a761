"""Shared by tests/test_ops_dispatch.py and tests/test_ops_cudnn_wiring.py: the convolution
geometries both files run (ranks 1 to 3, channels first and last, grouped, strided, dilated)."""

from __future__ import annotations

from convfuse.geometry import ConvGeometry

GEOMS = [
    ConvGeometry.create((2, 4, 7, 6), (6, 2, 3, 2), stride=(2, 1), padding=1, dilation=(1, 2),
                        groups=2),
    ConvGeometry.create((2, 7, 6, 4), (6, 3, 2, 4), stride=1, padding=(1, 0), layout="NHWC"),
    ConvGeometry.create((1, 3, 9), (4, 3, 3), stride=2, padding=1, layout="NCW"),
    ConvGeometry.create((1, 4, 4, 5, 2), (2, 2, 2, 3, 2), groups=1, layout="NDHWC"),
]
