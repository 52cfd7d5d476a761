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
