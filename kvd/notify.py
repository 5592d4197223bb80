"""The systemd notify protocol, spoken directly (no libsystemd).

Why by hand: the protocol is one datagram of ``KEY=VALUE`` lines to the AF_UNIX socket
named by ``$NOTIFY_SOCKET`` (a path, or an abstract socket when it starts with ``@``),
and a C dependency for that is not worth it. Outside systemd (no ``$NOTIFY_SOCKET``)
every call is a no-op, so the daemon runs the same way under a shell, a test, or k8s.

Sending never raises: notification is advice to the service manager, and a daemon
that serves must not stop serving because its supervisor's socket went away.

Who calls what (see ``kvd.lifecycle``): ``extending()`` around slow start-up work (the
pool is faulted in before the loop runs, so a thread keeps extending the start
timeout), ``ready()`` once the socket accepts clients, ``status()`` from the loop,
``watchdog()`` from a ``loop.call_later`` chain so a hung loop misses its pings and
systemd restarts the service, ``stopping()`` first thing on SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping

log = logging.getLogger("kvd.notify")


def _address(name: str) -> str | bytes:
    """``@foo`` is the abstract socket ``\\0foo``; anything else is a filesystem path."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    """One datagram per call to ``$NOTIFY_SOCKET``; disabled when it is unset."""

    def __init__(self, socket_name: str | None = None,
                 watchdog_usec: int = 0) -> None:
        self.socket_name = socket_name or ""
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # extending() sends from a thread during start-up
        self._last_status = ""
        if self.socket_name:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Read ``NOTIFY_SOCKET`` and ``WATCHDOG_USEC`` (ignored when ``WATCHDOG_PID``
        names another process, as sd_watchdog_enabled does)."""
        env = os.environ if environ is None else environ
        usec = 0
        try:
            usec = int(env.get("WATCHDOG_USEC", "0"))
        except ValueError:
            log.warning("ignoring WATCHDOG_USEC=%r: not an integer", env.get("WATCHDOG_USEC"))
        wpid = env.get("WATCHDOG_PID", "")
        if wpid and wpid != str(os.getpid()):
            usec = 0
        return cls(env.get("NOTIFY_SOCKET") or None, max(usec, 0))

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def watchdog_interval(self) -> float:
        """Seconds between WATCHDOG=1 pings (half the timeout, as systemd advises); 0
        when the watchdog is off."""
        return self.watchdog_usec / 2e6 if self.enabled else 0.0

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines in one datagram; False when not sent."""
        if self._sock is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\n", " ")  # one field per line, by protocol
            lines.append(f"{key}={text}")
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            try:
                self._sock.sendto(data, _address(self.socket_name))
            except OSError as e:
                log.debug("sd_notify to %s failed: %s", self.socket_name, e)
                return False
        return True

    # ------------------------------------------------------------ the messages kvd sends
    def ready(self, status: str = "") -> bool:
        fields: dict[str, str | int] = {"READY": 1, "MAINPID": os.getpid()}
        if status:
            fields["STATUS"] = status
            self._last_status = status
        return self.send(**fields)

    def status(self, text: str) -> bool:
        """STATUS= for ``systemctl status``; repeated texts are not resent."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.send(STATUS=text)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str = "stopping", within: float = 0.0) -> bool:
        """STOPPING=1; with ``within``, the seconds the stop may take from now
        (``EXTEND_TIMEOUT_USEC`` extends ``TimeoutStopSec`` too, where it is shorter)."""
        self._last_status = status
        if within > 0:
            return self.send(STOPPING=1, STATUS=status,
                             EXTEND_TIMEOUT_USEC=int(within * 1e6))
        return self.send(STOPPING=1, STATUS=status)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload managers match the reload (systemd 253+).
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(
            time.CLOCK_MONOTONIC) // 1000)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1e6))

    @contextlib.contextmanager
    def extending(self, what: str, *, every: float = 10.0, by: float = 30.0,
                  at_most: float = 3600.0) -> Iterator[None]:
        """While the block runs, ask systemd for ``by`` more seconds every ``every``
        seconds (``EXTEND_TIMEOUT_USEC``), for ``at_most`` seconds in all, with STATUS
        naming the work. A thread, because the work blocks the (not yet running) loop."""
        if not self.enabled:
            yield
            return
        done = threading.Event()
        start = time.monotonic()

        def keep_extending() -> None:
            while True:
                elapsed = time.monotonic() - start
                self.send(EXTEND_TIMEOUT_USEC=int(by * 1e6),
                          STATUS=f"{what} ({elapsed:.0f}s)")
                if done.wait(every) or elapsed + every > at_most:
                    return

        t = threading.Thread(target=keep_extending, name="kvd-notify-extend", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join(timeout=1.0)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
