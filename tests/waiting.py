"""Polling for a condition another process brings about (a daemon, a client)."""

from __future__ import annotations

import os
import signal
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


def child_exit(pid: int, timeout: float) -> int | None:
    """A forked child's exit code, or None when it did not end within ``timeout``
    seconds (it is then killed and reaped)."""
    deadline = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(done[1])


def in_child(check: Callable[[], bool], timeout: float) -> int | None:
    """Run ``check`` in a forked child: 0 when it returned true, 1 when false, 2 when it
    raised, None when it did not end within ``timeout`` seconds (a call that blocks
    for good fails a test instead of hanging the suite)."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            code = 0 if check() else 1
        finally:
            os._exit(code)
    return child_exit(pid, timeout)
