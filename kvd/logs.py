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
import sys
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


def setup_logging(level: str, stream: TextIO | None = None) -> None:
    """Configure the root logger for the daemon (replacing any earlier setup)."""
    stream = stream if stream is not None else sys.stderr
    tty = stream.isatty()
    fmt = "%(levelname)s %(name)s: %(message)s"
    if tty:
        fmt = "%(asctime)s " + fmt
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter(fmt, multiline=tty,
                                          priority=not tty and stream_is_journal(stream)))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # The Redis client logs every topology refresh and handshake at DEBUG; kvd's own
    # tier log says what matters (failures, the breaker).
    logging.getLogger("redis").setLevel(logging.INFO)
