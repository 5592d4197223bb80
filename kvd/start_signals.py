"""The daemon's signals, from its first moment to its exit (stdlib only: set first
thing in ``main``).

Until the loop serves, SIGTERM/SIGINT unwind the start-up and exit 0 (as a stop once
serving does), and a SIGHUP is kept and applied once serving: its default action would
kill the daemon, and ignored, the operator's edit would be lost. While it serves, each
signal's work is a callback on the loop; once stopped, stop signals are ignored.

Plain handlers throughout, never the loop's own: removing one of the loop's resets the
signal to its default action (death) for an instant before anything else is installed,
and the loop's close does the same; a stop signal in that instant turned a clean exit
into death by signal.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("kvd")
_reload = False


def take_start_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # (in-process tests: signals are the main thread's)
    signal.signal(signal.SIGHUP, _note_reload)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_starting)
    for sig in UNUSED:  # their default action is death without a word (a log-rotation
        signal.signal(sig, _unused)  # script's `kill -USR1`, say): say so and go on


UNUSED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


def _unused(signum: int, frame: object) -> None:
    log.warning("signal %s ignored: SIGHUP reloads the configuration, SIGTERM stops",
                signal.Signals(signum).name)


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


def serve_signal(loop: asyncio.AbstractEventLoop, sig: int,
                 callback: Callable[[], object]) -> None:
    """While serving: ``callback`` runs on ``loop`` for each ``sig``."""
    if threading.current_thread() is not threading.main_thread():
        return

    def on_signal(signum: int, frame: object) -> None:
        if loop.is_closed():  # exiting after a failure: nothing left to stop
            log.info("signal %d after the loop closed: ignored", signum)
            return
        loop.call_soon_threadsafe(callback)

    signal.signal(sig, on_signal)


def ignore_stop_signals() -> None:
    """Stopped cleanly: a later stop signal (systemd's, an operator's second one) must
    not turn the exit into death by signal."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
