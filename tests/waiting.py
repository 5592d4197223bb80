"""Polling for a condition another process brings about (a daemon, a client)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(pred: Callable[[], object], timeout: float) -> bool:
    """Whether ``pred()`` became true within ``timeout`` seconds (checked once more at
    the end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())
