"""What convfuse.torch needs of PyTorch, checked before anything else of it is imported: a
missing or too old torch is an ImportError saying so, not an AttributeError deep inside."""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "convfuse.torch needs PyTorch: pip install torch (convfuse's `torch` extra; convfuse "
        "itself works without it)"
    ) from exc

#: pyproject.toml's floor: the oldest release this package has run on (the GPU image's).
MIN_TORCH = (2, 11)


def release(version: str) -> tuple[int, ...]:
    """(major, minor) of a torch version string ("2.13.0+cpu", "2.12.0a0+git...")."""
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())


if release(torch.__version__) < MIN_TORCH:
    raise ImportError(
        f"convfuse.torch needs PyTorch {'.'.join(map(str, MIN_TORCH))} or later, found "
        f"{torch.__version__} (convfuse itself works without it)")
