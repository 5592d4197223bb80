"""What the client sets on its own process and threads, so that the daemon can copy the
engine's memory and the client's threads stay out of the engine's way."""

from __future__ import annotations

import os

PR_SET_PTRACER = 0x59616D61


def leave_compute_cpus() -> None:
    """Run this thread on the CPUs the engine keeps free, not its compute CPUs.

    vLLM's CPU workers pin every thread to their compute cores and leave others to the
    scheduler and helpers; a thread the worker starts inherits the pin and would take
    time slices from the model. The free CPUs are those the parent process may use and
    this thread may not; without a pin there are none and nothing changes."""
    try:
        spare = os.sched_getaffinity(os.getppid()) - os.sched_getaffinity(0)
        if spare:
            os.sched_setaffinity(0, spare)
    except OSError:  # no such parent, or not allowed: stay where we are
        pass


def allow_ptrace(daemon_pid: int) -> None:
    """Let the daemon read and write our memory where Yama restricts ptrace."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(daemon_pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass
