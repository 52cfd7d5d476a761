"""convfuse._cudnn's Handle on a GPU: its stream set and read back."""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.gpu._binding_gpu_helpers")

from tests.gpu._binding_gpu_helpers import cp, lib  # noqa: E402

pytestmark = pytest.mark.gpu


def test_handle_stream_round_trip():
    h = lib.Handle()
    assert h.ptr != 0 and h.getStream() == 0
    stream = cp.cuda.Stream(non_blocking=True)
    h.setStream(stream.ptr)
    assert h.getStream() == stream.ptr
    h.setStream(0)
    assert h.getStream() == 0
