"""Log lines that fit journald (and any other collector): one event per line.

Why: journald stores each line as its own entry, so a multi-line traceback becomes a
dozen unrelated entries, and a client-chosen name containing ESC or a newline could
forge entries or colour an operator's terminal. So when stderr is not a terminal every
control character (newlines of tracebacks included) is escaped, no timestamp is added
(journald stamps entries itself), and, when stderr is the journal (``$JOURNAL_STREAM``
names it), each line starts with the syslog priority ``<N>`` that journald turns into
the entry's PRIORITY (``SyslogLevelPrefix=`` is on by default). On a terminal lines get
a timestamp and tracebacks keep their lines, but ESC is still escaped: kvd never emits
ANSI colour.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time
from collections import deque
from typing import TextIO

# logging level -> syslog priority (sd-daemon.h: SD_ERR 3, SD_WARNING 4, SD_INFO 6, SD_DEBUG 7)
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
             logging.DEBUG: 7}
_ESCAPE_ALL = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}
_ESCAPE_ALL[0x0A] = "\\n"
_ESCAPE_ALL[0x09] = "\\t"
_ESCAPE_TTY = {c: v for c, v in _ESCAPE_ALL.items() if c not in (0x0A,)}


def stream_is_journal(stream: TextIO, environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``dev:inode``)."""
    value = environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class OneLineFormatter(logging.Formatter):
    """Formats a record (with its traceback) and escapes control characters."""

    def __init__(self, fmt: str, *, multiline: bool, priority: bool) -> None:
        super().__init__(fmt)
        self.table = _ESCAPE_TTY if multiline else _ESCAPE_ALL
        self.priority = priority

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).translate(self.table)
        if self.priority:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"
        return text


BACKLOG = 10_000  # lines kept for a log reader that fell behind; more are dropped, counted
_ATOMIC = 4096  # a line of this many bytes or more may block a pipe with room (PIPE_BUF)
CLOSE_WAIT_S = 2.0  # at exit, how long the lines still queued may take to go out


class NeverBlockingHandler(logging.StreamHandler):
    """Writes at once while the stream takes lines; once it would block (a pipe nobody
    reads, a stalled journald), lines go to a thread of their own that waits for it,
    so the event loop never waits on its log (it would stop answering every client).
    A backlog past BACKLOG lines is dropped and counted, in a line once lines flow."""

    def __init__(self, stream: TextIO, backlog: int = BACKLOG) -> None:
        super().__init__(stream)
        self._lines: deque[str] = deque()
        self._busy = False  # the writer thread is writing a line
        self._cv = threading.Condition()
        self._writer: threading.Thread | None = None
        self.backlog = backlog
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:  # (under the handler's lock)
        try:
            line = self.format(record) + self.terminator
            with self._cv:
                idle = not self._lines and not self._busy
            if idle and self._room(line):
                self.stream.write(line)
                self.flush()
            else:
                self._defer(line)
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own convention
            self.handleError(record)

    def _room(self, line: str) -> bool:
        """Whether writing ``line`` now cannot block."""
        try:
            fd = self.stream.fileno()
        except (AttributeError, OSError, ValueError):
            return True  # not a descriptor (a StringIO): writes never block
        encoding = getattr(self.stream, "encoding", None) or "utf-8"
        if len(line.encode(encoding, "replace")) >= _ATOMIC:
            return False
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        return bool(poll.poll(0))

    def _defer(self, line: str) -> None:
        with self._cv:
            if len(self._lines) >= self.backlog:
                self.dropped += 1
                return
            if self._writer is None:
                writer = threading.Thread(target=self._write, name="kvd-log", daemon=True)
                try:
                    writer.start()
                except RuntimeError:  # no thread now (TasksMax): this line is dropped
                    self.dropped += 1
                    return
                self._writer = writer
            self._lines.append(line)
            self._cv.notify_all()

    def close(self) -> None:
        """At exit: the lines still queued go out, for CLOSE_WAIT_S at most (a reader
        that never reads must not hold the process's exit)."""
        with self._cv:
            deadline = time.monotonic() + CLOSE_WAIT_S
            while (self._lines or self._busy) and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
        super().close()

    def _write(self) -> None:
        while True:
            with self._cv:
                while not self._lines:
                    self._cv.wait()
                line = self._lines.popleft()
                dropped, self.dropped = self.dropped, 0
                self._busy = True
            try:
                if dropped:
                    self.stream.write(self.format(logging.makeLogRecord({
                        "name": "kvd.logs", "levelno": logging.WARNING,
                        "levelname": "WARNING", "msg": f"{dropped} log lines dropped: the "
                        "log's reader did not keep up"})) + self.terminator)
                self.stream.write(line)
                self.stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to say it on
                pass
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()  # (close waits for the queue to empty)


def setup_logging(level: str, stream: TextIO | None = None) -> None:
    """Configure the root logger for the daemon (replacing any earlier setup)."""
    stream = stream if stream is not None else sys.stderr
    tty = stream.isatty()
    fmt = "%(levelname)s %(name)s: %(message)s"
    if tty:
        fmt = "%(asctime)s " + fmt
    handler = NeverBlockingHandler(stream)
    handler.setFormatter(OneLineFormatter(fmt, multiline=tty,
                                          priority=not tty and stream_is_journal(stream)))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # The Redis client logs every topology refresh and handshake at DEBUG; kvd's own
    # tier log says what matters (failures, the breaker).
    logging.getLogger("redis").setLevel(logging.INFO)
