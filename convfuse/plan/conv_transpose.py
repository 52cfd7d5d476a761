"""The plan of a transposed convolution: its forward convolution G's plan with the roles of
x and y swapped (Note [transposed convolution as a swapped convolution] in
convfuse/transpose_geometry.py).

Nothing here is new policy: the descriptors are G's (x_desc describes the transposed
convolution's output, y_desc its input), and algorithm choice, workspace limits, the walk
down the ranking on refusal or out-of-memory (Note [transient out-of-memory]), the capture
rules and the flags in force are ConvPlan's. The transposed convolution uses the
"bwd_data" slot for its forward, "fwd" for its data gradient and "bwd_filter" for its
filter gradient, so a Conv layer and a ConvTranspose layer that share G share one plan and
its cached algorithms.
"""

from __future__ import annotations

from typing import Any

from ..config import Flags
from ..transpose_geometry import ConvTransposeGeometry
from .conv import PlanKey

#: The ConvPlan direction slot of each transposed-convolution call.
TRANSPOSE_DIRECTIONS = {"forward": "bwd_data", "backward_data": "fwd",
                        "backward_filter": "bwd_filter"}


def transpose_plan_key(tgeom: ConvTransposeGeometry, dtype: Any,
                       flags: Flags | None = None, device: int | None = None) -> PlanKey:
    """The key of G's plain (unfused) plan; TypeError for anything but a
    ConvTransposeGeometry."""
    if not isinstance(tgeom, ConvTransposeGeometry):
        raise TypeError(f"tgeom must be a ConvTransposeGeometry, got {type(tgeom).__name__}")
    return PlanKey.create(tgeom.conv, dtype, "identity", False, flags, device)
