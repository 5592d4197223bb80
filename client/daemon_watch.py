"""The watching of the daemon's process through a pidfd, for the I/O thread.

A Transfer's Done comes from the daemon; when its process is gone, none will, and waiting
for the deadline would keep an engine's step waiting for nothing. Where the daemon's pid
means the same process to us, a pidfd in the I/O thread's poller says at once that it
ended. This module holds those pidfds and which daemon run each belongs to; what an exit
ends is the I/O thread's (``IOLoop.daemon_exited``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container

import zmq

from kvd_proto import messages as m


class DaemonWatch:
    """The pidfds of the daemon runs the I/O thread watches, in its poller."""

    def __init__(self) -> None:
        self.poller: zmq.Poller | None = None  # the I/O thread's, once its loop runs
        # pidfd -> daemon run, where it is in our PID namespace: the current run, and an
        # earlier one while Transfers sent to it are not over (it may still copy them)
        self.daemons: dict[int, str] = {}

    def watch_daemon(self, hello: m.HelloOk, in_flight: Container[str]) -> None:
        """Learn at once when the daemon's process ends (it can copy nothing more then).
        Only where its pid means the same process to us: same PID namespace, which the
        daemon tells by echoing our pid as it sees it. An earlier run stays watched while
        Transfers sent to it are not over (``in_flight``: the runs they went to): only its
        own exit (or their deadlines) ends them, never the exit of the run that replaced
        it."""
        self.unwatch_daemons(lambda r: r != hello.instance and r not in in_flight)
        if hello.instance in self.daemons.values():
            return  # the same run again (the connection was lost, not the daemon)
        if hello.peer_pid != os.getpid() or hello.daemon_pid <= 0 or self.poller is None:
            return  # another namespace (or an older daemon): deadlines alone decide
        try:
            fd = os.pidfd_open(hello.daemon_pid)
        except OSError:
            return
        self.poller.register(fd, zmq.POLLIN)
        self.daemons[fd] = hello.instance

    def unwatch_daemons(self, which: Callable[[str], bool] = lambda run: True) -> None:
        for fd in [fd for fd, run in self.daemons.items() if which(run)]:
            del self.daemons[fd]
            if self.poller is not None:
                self.poller.unregister(fd)
            os.close(fd)
