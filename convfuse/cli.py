"""The `convfuse` console command (also `python -m convfuse`). Subcommands: selfcheck."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import __version__

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convfuse", description="cuDNN-backed fused convolution layers: tools.")
    parser.add_argument("--version", action="version", version=f"convfuse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser(
        "selfcheck",
        help="check this install (and the GPU, if any) against the reference engine",
        description=(
            "Print the environment and check convfuse against cuDNN and its NumPy reference "
            "engine: on a GPU every op, layer, optimizer and a captured training step; "
            "without one, everything checkable on the CPU. Exit status 0 means every check "
            "passed, 1 that a check failed or the install is broken."),
    )
    check.add_argument("--json", metavar="FILE", help="also write the full report as JSON")
    check.add_argument("--cpu-only", action="store_true",
                       help="skip the GPU checks even when a GPU is usable")
    check.add_argument("--no-kernels", action="store_true",
                       help="skip compiling the custom CUDA kernels with NVRTC")
    return parser


def _unwritable(path: str) -> str | None:
    """Why the report cannot be written to `path`, or None (it may still fail later: the
    write's own error is reported then)."""
    if not path:
        return "needs a file name"
    if os.path.isdir(path):
        return f"{path!r} is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path!r} is not writable"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"the folder of {path!r} does not exist"
    return None if os.access(folder, os.W_OK) else f"the folder of {path!r} is not writable"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "selfcheck":
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.json is not None:  # before the checks run (on a GPU, minutes of them)
        problem = _unwritable(args.json)
        if problem:
            parser.exit(EXIT_USAGE, f"convfuse selfcheck: error: argument --json: {problem}\n")
    from .selfcheck import selfcheck

    try:
        return selfcheck(args.json, sys.stdout, cpu_only=args.cpu_only,
                         kernels=not args.no_kernels)
    except OSError as exc:  # e.g. --json into a folder that does not exist
        print(f"convfuse selfcheck: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a bug in selfcheck itself: say so without a traceback
        print(f"convfuse selfcheck: internal error ({type(exc).__name__}: {exc}); please "
              "report it with the output of `convfuse selfcheck --json report.json`",
              file=sys.stderr)
        return EXIT_INTERNAL
