"""How often the cuDNN engine itself ran each op: its plan lookups, counted by the name of
the engine function asking. A bound call (Note [bound calls] in
convfuse/ops/cudnn/bound.py) asks no plan, and binding asks through bound.py's own
import, so neither is counted; counting this way replaces no op, so it unbinds nothing
(a spy on an op would see every call, and the calls would not be bound)."""

from __future__ import annotations

import sys
from typing import Any


def count_plan_lookups(monkeypatch: Any, module: Any, getter: str,
                       names: tuple[str, ...]) -> dict[str, int]:
    """{engine function name (leading underscores dropped): calls}, for `names`, counting
    `module.<getter>` calls from then on (through `monkeypatch`)."""
    counts = dict.fromkeys(names, 0)
    real = getattr(module, getter)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[sys._getframe(1).f_code.co_name.lstrip("_")] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, getter, counted)
    return counts


def forget_signatures() -> None:
    """Drop the torch bridge's per-signature decisions, and the bound calls they hold: on
    the fake device (tests/_fake_cuda.py) they are keyed by the CPU, so none may cross
    between fake CUDA calls and other tests; on a GPU, a test that counts the engine's
    calls from a signature's first call needs its signatures new."""
    from convfuse.torch import _bn_ops, _ops
    from convfuse.torch import batchnorm as torch_batchnorm
    from convfuse.torch import conv as torch_conv

    for cache in (torch_conv.CALLS, torch_batchnorm.CALLS, _ops._PREPARED, _bn_ops._PREPARED):
        cache.clear()
