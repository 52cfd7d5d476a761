"""convfuse declares requires-python >= 3.10: its source must parse with Python 3.10's grammar.

The interpreter running the tests may be newer, so each module is parsed with
`feature_version=(3, 10)`, which refuses most newer syntax (except*, type parameters,
...), plus one check CPython's parser skips there: a starred item in a subscript
(`a[x, *idx]`, PEP 646) is new in 3.11 unless the tuple is parenthesised
(`a[(x, *idx)]`, valid since 3.5). Where a Python 3.10 interpreter is installed (PATH or
pyenv), every module is also compiled by it, which catches the rest (PEP 701 f-strings).
"""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [*sorted((ROOT / "convfuse").rglob("*.py")), ROOT / "setup.py"]


def unparenthesized_starred_subscripts(source: str) -> list[int]:
    """Lines holding `a[..., *b]` without parentheses around the tuple (3.11+ syntax)."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple) and any(
                isinstance(e, ast.Starred) for e in node.slice.elts):
            # A parenthesised tuple's node starts at its "(" (Python 3.8+ positions).
            segment = ast.get_source_segment(source, node.slice)
            if segment is None or not segment.lstrip().startswith("("):
                lines.append(node.lineno)
    return lines


def py310_problems(source: str, name: str = "<src>") -> list[str]:
    try:
        ast.parse(source, name, feature_version=(3, 10))
    except SyntaxError as exc:
        return [f"{name}:{exc.lineno}: {exc.msg}"]
    return [f"{name}:{line}: starred item in an unparenthesised subscript (Python 3.11+)"
            for line in unparenthesized_starred_subscripts(source)]


def test_the_check_refuses_311_syntax_and_accepts_its_310_spelling():
    assert py310_problems("a[*idx]\n") and py310_problems("a[0, *idx] = 1\n")
    assert py310_problems("try:\n    pass\nexcept* ValueError:\n    pass\n")
    assert py310_problems("def f[T](x: T) -> T:\n    return x\n")
    assert len(py310_problems("x = a[:, *b][*c]\ny = a[(0, *b)]\n")) == 2  # both on line 1
    assert not py310_problems("a[(0, *idx)]\na[(slice(None), *(i for i in b))] = 1\n")
    assert not py310_problems("match x:\n    case [1, *rest]:\n        pass\n")  # 3.10


def test_every_module_parses_with_the_python310_grammar():
    problems = []
    for path in SOURCES:
        problems += py310_problems(path.read_text(), str(path.relative_to(ROOT)))
    assert problems == []


def _python310() -> str | None:
    found = shutil.which("python3.10")
    candidates = [found] if found else []
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", "3.10*", "bin", "python3.10")))
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except OSError:
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 10)":
            return exe
    return None


def test_a_python310_interpreter_compiles_every_module():
    exe = _python310()
    if exe is None:
        pytest.skip("no Python 3.10 interpreter on PATH or under pyenv")
    code = ("import sys\n"
            "for f in sys.argv[1:]:\n"
            "    compile(open(f, encoding='utf-8').read(), f, 'exec', dont_inherit=True)\n")
    proc = subprocess.run([exe, "-c", code, *map(str, SOURCES)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
