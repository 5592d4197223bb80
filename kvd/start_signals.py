"""Signals before the event loop serves (stdlib only: set first thing in ``main``).

From the process's first moment until the loop takes them over, SIGTERM/SIGINT unwind
the start-up and exit 0 (as a stop once serving does), and a SIGHUP is kept and applied
once serving: its default action would kill the daemon, and ignored, the operator's
edit would be lost.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("kvd")
_reload = False


def take_start_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # (in-process tests: signals are the main thread's)
    signal.signal(signal.SIGHUP, _note_reload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_starting)


def reload_pending() -> bool:
    """Whether a SIGHUP came during start-up (cleared by asking)."""
    global _reload
    pending, _reload = _reload, False
    return pending


def _note_reload(signum: int, frame: object) -> None:
    global _reload
    _reload = True


def _stop_starting(signum: int, frame: object) -> None:
    log.info("stopped during start-up (signal %d)", signum)
    raise SystemExit(0)
