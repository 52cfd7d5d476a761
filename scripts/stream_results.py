"""pytest plugin for scripts/gpu_acceptance.sh: one JSON line per test, flushed as it
happens, so a chunk cut by its time cap (or the whole visit killed) still leaves every
finished result and names the test that was running.

Use: PYTHONPATH=scripts python -m pytest -p stream_results --stream-results FILE --chunk NAME

Lines (appended, never rewritten):
  {"chunk": "gpu-core", "start": "tests/gpu/test_x.py::test_y[a]", "t": 12.3}
  {"chunk": "gpu-core", "id": "tests/gpu/test_x.py::test_y[a]", "outcome": "passed",
   "seconds": 0.41, "message": ""}
outcome is passed, failed, skipped or error (a failure in setup or teardown). `t` is
seconds since the chunk started. A `start` with no result after it is the test that was
running when the chunk ended.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

_MESSAGE_CHARS = 400


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stream_results")
    group.addoption("--stream-results", default=None, help="append one JSON line per test")
    group.addoption("--chunk", default="", help="chunk name written into every line")


class _Writer:
    def __init__(self, path: str, chunk: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (open for the session)
        self.chunk = chunk
        self.t0 = time.monotonic()
        self.failed: set[str] = set()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({"chunk": self.chunk, **record}) + "\n")
        self.file.flush()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self.write({"start": nodeid, "t": round(time.monotonic() - self.t0, 2)})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = None
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = report.outcome
            if report.when == "setup" and report.failed:
                outcome = "error"
        elif report.when == "teardown" and report.failed:
            outcome = "error"
        if outcome is None:
            return
        message = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longreprtext)
            message = " ".join(text.split())[:_MESSAGE_CHARS]
        elif report.skipped and isinstance(report.longrepr, tuple):
            message = str(report.longrepr[2])[:_MESSAGE_CHARS]
        self.write({"id": report.nodeid, "outcome": outcome,
                    "seconds": round(report.duration, 3), "message": message})

    def pytest_sessionfinish(self) -> None:
        self.file.close()


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--stream-results")
    if path and not hasattr(config, "workerinput"):  # under xdist, the controller writes
        config.pluginmanager.register(_Writer(path, config.getoption("--chunk")),
                                      "stream_results_writer")
