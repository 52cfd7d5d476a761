"""Importing torchvision, timm and MONAI for tests that build their models without weights.

torchvision's wheel beside torch's CPU wheel (2.13.0+cpu) is built for the CUDA torch: its C
ops fail to register and `import torchvision` raises "operator torchvision::nms does not
exist". Its models need no C op, so when that happens the two schemas its Python code
checks at import (`nms`, `qnms`) are declared, without kernels, and the import retried.
Nothing here downloads: every model is built with random weights.
"""

from __future__ import annotations

import sys
from types import ModuleType

import pytest

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_library = None  # kept alive: dropping the Library object would remove the schemas


def _declare_torchvision_schemas() -> None:
    global _library
    import torch

    if _library is not None:
        return
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not hasattr(
                torch.ops.torchvision, name):
            _library.define(schema)


def import_torchvision() -> ModuleType:
    """torchvision, importable for its models on the CPU wheel of torch; skips the test
    when torchvision is not installed."""
    try:
        import torchvision
        return torchvision
    except ImportError:
        pytest.skip("torchvision is not installed")
    except RuntimeError:  # its C ops are for another torch build
        for name in [m for m in sys.modules if m == "torchvision" or
                     m.startswith("torchvision.")]:
            del sys.modules[name]
        _declare_torchvision_schemas()
        import torchvision
        return torchvision


def import_timm() -> ModuleType:
    import_torchvision()  # timm imports torchvision
    return pytest.importorskip("timm")


def import_monai() -> ModuleType:
    return pytest.importorskip("monai")
