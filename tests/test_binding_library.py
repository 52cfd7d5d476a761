"""convfuse._cudnn against the real libcudnn, on the CPU: the library itself (version,
error strings), its constants against the cuDNN headers, and its signatures against the
Binding section of docs/DESIGN.md."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests._binding_helpers import DESIGN_CONSTANTS, lib

ALGO_PREFIXES = (
    "CUDNN_CONVOLUTION_FWD_ALGO_", "CUDNN_CONVOLUTION_BWD_DATA_ALGO_",
    "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_", "CUDNN_STATUS_",
)


def _header_dir() -> Path | None:
    for site in sys.path:
        cand = Path(site) / "nvidia" / "cudnn" / "include"
        if (cand / "cudnn_graph.h").is_file():
            return cand
    return None


def _header_enums() -> dict[str, int]:
    """NAME = number pairs from the cuDNN headers (comments stripped)."""
    folder = _header_dir()
    if folder is None:
        pytest.skip("cuDNN headers not found on sys.path")
    names = ("cudnn_graph.h", "cudnn_ops.h", "cudnn_cnn.h")
    text = "".join((folder / n).read_text() for n in names)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    pairs = re.findall(r"\b(CUDNN_[A-Z0-9_]+)\s*(?:CUDNN_DEPRECATED_ENUM\s*)?=\s*(\d+)", text)
    return {name: int(value) for name, value in pairs}


def _header_define(name: str) -> int:
    folder = _header_dir()
    if folder is None:
        pytest.skip("cuDNN headers not found on sys.path")
    text = (folder / "cudnn_version.h").read_text()
    return int(re.search(rf"#define {name} (\d+)", text).group(1))


def test_version_matches_header():
    assert lib.getVersion() >= 90000
    major, minor = _header_define("CUDNN_MAJOR"), _header_define("CUDNN_MINOR")
    from_header = major * 10000 + minor * 100 + _header_define("CUDNN_PATCHLEVEL")
    assert from_header == lib.CUDNN_VERSION
    assert lib.getVersion() // 10000 == lib.CUDNN_VERSION // 10000 == lib.CUDNN_MAJOR
    assert lib.getCudartVersion() >= 11000


def test_error_strings():
    assert lib.getErrorString(2000) == "CUDNN_STATUS_BAD_PARAM"
    assert lib.getErrorString(1001) == "CUDNN_STATUS_NOT_INITIALIZED"
    assert lib.getErrorString(0) == "CUDNN_STATUS_SUCCESS"
    assert lib.getErrorString(3000) == "CUDNN_STATUS_NOT_SUPPORTED"
    assert isinstance(lib.getErrorString(123456), str)  # unknown codes must not crash


def test_constants_equal_header_values():
    header = _header_enums()
    names = DESIGN_CONSTANTS + [n for n in dir(lib) if n.startswith(ALGO_PREFIXES)]
    for name in names:
        assert getattr(lib, name) == header[name], name
    # every algorithm the header declares is exported
    for name in header:
        if name.startswith(ALGO_PREFIXES[:3]):
            assert hasattr(lib, name), name
    assert lib.CUDNN_DIM_MAX == 8


def _binding_params(obj) -> list[str]:
    """Parameter names of a pybind11 callable, from its signature line (self dropped)."""
    first = obj.__doc__.splitlines()[0]
    names = re.findall(r"(?:\(|, )(\w+): ", first[: first.rindex(")")])
    return [n for n in names if n != "self"]


def _design_calls():
    """(class or None, name, argument names) for each call DESIGN.md's Binding section shows."""
    text = (Path(__file__).parents[1] / "docs" / "DESIGN.md").read_text()
    section = text[text.index("## Binding"): text.index("## Geometry")]
    items = re.split(r"\n(?=- |\S)", section)
    for item in items:
        owner = re.match(r"- `(\w+)\(\)`", item)
        for dot, name, args in re.findall(r"`(\.?)(\w+)\(([^)]*)\)", item):
            if dot or not isinstance(getattr(lib, name, None), type):
                names = [a.split(":")[0].strip() for a in args.split(",") if a.strip()]
                yield (owner.group(1) if dot else None), name, names


def test_signatures_follow_design_doc():
    seen = 0
    for owner, name, design in _design_calls():
        target = getattr(getattr(lib, owner), name) if owner else getattr(lib, name)
        bound = _binding_params(target)
        assert len(bound) == len(design), (owner, name, bound, design)
        for b, d in zip(bound, design):
            # DESIGN abbreviates a few names to one letter (n, m): only the position counts.
            assert b == d or (len(d) == 1 and d in "nm"), (owner, name, bound, design)
        seen += 1
    assert seen >= 35
