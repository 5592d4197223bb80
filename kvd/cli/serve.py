"""``kvd serve``: run the daemon in the foreground (systemd runs it the same way)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys

from kvd import __version__
from kvd.config import load
from kvd.errors import KvdError
from kvd.logs import setup_logging
from kvd.start_signals import take_start_signals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvd", description="Per-node KV-cache offload daemon.")
    p.add_argument("--version", action="version", version=f"kvd {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon in the foreground")
    s.add_argument("--config", metavar="FILE", help="TOML config file (also KVD_CONFIG)")
    s.add_argument("--socket", metavar="PATH", help="ipc socket path (KVD_SOCKET)")
    s.add_argument("--pool-size", metavar="SIZE", help="pool size, e.g. 512M, 64G")
    s.add_argument("--pool-path", metavar="PATH", help="shared-memory pool file")
    s.add_argument("--extent-size", metavar="SIZE", help="allocation extent size")
    s.add_argument("--policy", metavar="NAME", help="eviction policy")
    s.add_argument("--copy-threads", type=int, metavar="N", help="copy threads")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    s.add_argument("--no-prefault", dest="prefault", action="store_const", const=False,
                   help="do not fault the pool in at start")
    s.add_argument("--mlock", action="store_const", const=True, help="lock the pool in RAM")
    s.add_argument("--persist", action="store_const", const=True,
                   help="keep the pool and an index journal across restarts (warm restart)")
    s.add_argument("--verify-on-load", dest="verify_on_load", action="store_const",
                   const=True, help="check each block's xxh3 before loading it")
    s.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="Prometheus endpoint port, 0 disables (KVD_METRICS_PORT; default 9727)")
    s.add_argument("--metrics-addr", metavar="ADDR",
                   help="Prometheus endpoint address (default 127.0.0.1)")
    s.add_argument("--events-endpoint", metavar="ADDR",
                   help="publish KV events in vLLM's format for fleet routers on this "
                        "ZeroMQ address, e.g. tcp://*:5557 (default: off)")
    s.add_argument("--events-replay-endpoint", metavar="ADDR",
                   help="replay socket for missed event batches, e.g. tcp://*:5558")
    s.add_argument("--events-hwm", type=int, metavar="N",
                   help="event batches queued per subscriber before it misses some")
    s.add_argument("--disk-path", metavar="DIR",
                   help="disk tier: evicted blocks go to a slot file in DIR (default: off)")
    s.add_argument("--disk-size", metavar="SIZE", help="disk tier size, e.g. 500G")
    s.add_argument("--remote", metavar="URLS",
                   help="remote tier: redis://HOST:PORT[,HOST:PORT...] of a Redis/Valkey "
                        "cluster shared by the fleet (default: off)")
    return p


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()
    take_start_signals()  # a stop or reload before the daemon serves is not its death
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    setup_logging("warning")  # what reading the configuration warns of, in the daemon's format
    try:
        config, origins = load(args.config, flags=flags)
    except KvdError as e:
        print(f"kvd: {e}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    raise_fd_limit()
    try:
        import uvloop

        # SIGHUP re-reads the same file, the environment and the same flags.
        uvloop.run(_serve(config, origins, lambda: load(args.config, flags=flags)))
    except KvdError as e:
        logging.getLogger("kvd").error("%s", e)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def open_standard_fds() -> None:
    """/dev/null in place of any of descriptors 0-2 closed at exec (``kvd serve 2>&-``):
    the files kvd opens next would take them. With stderr closed, logging failed at start
    (exit 1, without a word); with stdout closed, uvloop's epoll descriptor became 1 and
    libuv aborted the process at its stop."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stderr is None:  # Python saw fd 2 closed at start
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115


LOW_FD_LIMIT = 4096  # below this, a few thousand connections could end the daemon


def raise_fd_limit() -> None:
    """Each client connection is a descriptor, and ZeroMQ aborts the process when an
    accept fails for want of one (EMFILE): take the hard limit, not a shell's 1,024,
    and say so when even that is low (the abort is not kvd's to catch)."""
    log = logging.getLogger("kvd")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the descriptor limit from %d: %s", soft, e)
    if soft != resource.RLIM_INFINITY and soft < LOW_FD_LIMIT:
        log.warning("descriptor limit %d (hard %s): each client connection takes one, "
                    "and the daemon aborts (a ZeroMQ limit) when a connection finds none "
                    "left; raise it to %d or more (LimitNOFILE=, ulimit -Hn)", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, LOW_FD_LIMIT)


async def _serve(config, origins, reload_config) -> None:
    from kvd.server import serve

    await serve(config, origins, reload_config)


if __name__ == "__main__":
    sys.exit(main())
