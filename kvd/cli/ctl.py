"""``kvdctl``: the admin CLI. Human tables by default, ``--json`` everywhere.

Exit codes are part of the interface (probes and scripts test them):
0 ok, 1 unhealthy / refused / an error reply, 2 usage error, 3 daemon unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from kvd.cli import render, tail
from kvd.cli.admin import (EXIT_DOWN, EXIT_FAIL, EXIT_OK, EXIT_USAGE, AdminClient,
                           AdminError, Failed, Unreachable, document, fetch_status)
from kvd.config import SIZE_KEYS, default_socket, read_toml
from kvd.errors import ConfigError
from kvd_proto import messages as m

SYSTEM_CONFIG = "/etc/kvd/kvd.toml"
EVICT_WAIT_S = 120.0  # for the answer to evict/flush (a million blocks: seconds)
EPILOG = """\
exit codes:
  0  ok
  1  unhealthy, access refused, or kvd answered with an error
  2  usage error
  3  kvd unreachable (not running, no socket, or no answer in --timeout; evict and
     flush wait up to 120 s for their answer while kvd answers pings in --timeout)

socket: --socket, else $KVD_SOCKET, else `socket` from --config / $KVD_CONFIG /
/etc/kvd/kvd.toml, else the daemon's default."""


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < 1e6:  # nan and inf fail this too
        raise argparse.ArgumentTypeError(f"{text}: expected seconds above 0")
    return value


def _tenant_id(text: str) -> int:
    """A tenant id as the daemon gives them (-1 means "all" on the wire: use --all)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a tenant id: {text!r}") from None
    if not 0 <= value < 1 << 32:
        raise argparse.ArgumentTypeError(f"{text}: tenant ids are 0 or more (--all for "
                                         "every tenant)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdctl", description="Administer the local kvd.",
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--socket", help="daemon socket path")
    p.add_argument("--config", metavar="FILE", help="read `socket` from this kvd.toml")
    p.add_argument("--timeout", type=_seconds, default=3.0,
                   help="seconds to wait for kvd (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, text: str, **kw: Any) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=text, description=text, **kw)
        s.add_argument("--json", action="store_true", help="machine-readable output")
        return s

    cmd("status", "pool, blocks, traffic and errors at a glance")
    cmd("tenants", "one row per tenant: model, TP size, block size, blocks and bytes held")
    cmd("clients", "one row per connected client: pid, name, tenant, rank, transfers")
    t = cmd("top", "live view refreshed every second until Ctrl-C (--json: one line each)")
    t.add_argument("--interval", type=_seconds, default=1.0,
                   help="seconds between refreshes")
    t.add_argument("--iterations", type=int, default=0, help=argparse.SUPPRESS)
    e = cmd("evict", "drop READY unpinned blocks of one tenant (--tenant) or of all (--all); "
                     "leased, pending and in-flight blocks stay")
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--tenant", type=_tenant_id, metavar="ID")
    g.add_argument("--all", action="store_true")
    cmd("flush", "empty the cache like memcached's flush_all: drop every READY unpinned "
                 "block of every tenant; blocks in use (leased, being stored or copied) stay")
    cmd("config", "the daemon's effective configuration and where each value came from "
                  "(default, file, env or flag)")
    r = cmd("reload", "re-read the configuration as SIGHUP does, and wait until it is applied "
                      "(exit 0) or refused (exit 1, the running one kept): for ExecReload=")
    r.add_argument("--wait", type=_seconds, default=60.0,
                   help="seconds to wait for the read (a file on a slow mount; default "
                        "%(default)s), while kvd answers pings within --timeout")
    r.add_argument("--pid", type=_daemon_pid,
                   help="kvd's pid (systemd's $MAINPID): sent SIGHUP instead when kvd "
                        "cannot be asked (no socket, no answer to the hello, or a kvd "
                        "older than reload requests); exit 0 then, its log says the "
                        "outcome")
    h = cmd("health", "one line; exit 0 when kvd is serving, 1 when unhealthy, 3 when down")
    h.add_argument("--live", action="store_true",
                   help="liveness only: answering is enough (starting/stopping count as ok)")
    tail.add_parser(sub)
    try:
        from kvd.cli import simulate
    except ImportError:  # pragma: no cover - simulate ships with kvd
        pass
    else:
        simulate.add_parser(sub)
    return p


def resolve_socket(args: argparse.Namespace) -> str:
    """--socket, $KVD_SOCKET, the config file's ``socket``, the daemon's default."""
    if args.socket:
        return args.socket
    if os.environ.get("KVD_SOCKET"):
        return os.environ["KVD_SOCKET"]
    file = args.config or os.environ.get("KVD_CONFIG")
    if not file and os.path.exists(SYSTEM_CONFIG):
        file = SYSTEM_CONFIG
    if file:
        try:
            return _socket_of(file) or default_socket()
        except ValueError as e:  # fall back, but say why
            if args.config:
                raise
            print(f"kvdctl: ignoring {file}: {e}", file=sys.stderr)
    return default_socket()


def _socket_of(file: str) -> str:
    """The ``socket`` key of a kvd.toml, nothing else of it: the daemon's other settings
    (and their environment) are the daemon's business. ValueError says why not."""
    try:
        socket = read_toml(file).get("socket", "")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    if not isinstance(socket, str):
        raise ValueError(f"{file}: socket must be a path, not {socket!r}")
    return socket


def _client(args: argparse.Namespace) -> AdminClient:
    return AdminClient(args.socket_path, args.timeout)


def _out(args: argparse.Namespace, doc: Any, text: str | Callable[[], str]) -> int:
    """``text``: made only without --json (what --json prints needs no rendering)."""
    print(json.dumps(doc, indent=2) if args.json else text if isinstance(text, str) else text())
    return EXIT_OK


# ---------------------------------------------------------------- commands
def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = fetch_status(c)
    return _out(args, st, lambda: render.status_text(st))


def cmd_tenants(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = fetch_status(c)
    return _out(args, {"tenants": st["tenants"]}, lambda: render.tenants_table(st["tenants"]))


def cmd_clients(args: argparse.Namespace) -> int:
    with _client(args) as c:
        st = fetch_status(c)
    return _out(args, {"clients": st["clients"]}, lambda: render.clients_table(st["clients"]))


def _evicting(c: AdminClient) -> None:
    """The eviction's answer may take longer than --timeout (kvd drops a large pool in
    parts, serving requests in between), as long as kvd answers pings meanwhile."""
    c.patience = EVICT_WAIT_S


def cmd_evict(args: argparse.Namespace) -> int:
    with _client(args) as c:
        _evicting(c)
        reply = c.request(m.Evict, -1 if args.all else args.tenant)
    assert isinstance(reply, m.Ok)
    what = "all tenants" if args.all else f"tenant {args.tenant}"
    return _out(args, {"evicted_blocks": reply.count},
                f"evicted {reply.count} blocks of {what}")


def cmd_flush(args: argparse.Namespace) -> int:
    with _client(args) as c:
        _evicting(c)
        reply = c.request(m.Flush)
        c.patience = 0.0
        st = fetch_status(c)
    assert isinstance(reply, m.Ok)
    kept = st["blocks"]["ready"] + st["blocks"]["pending"]
    return _out(args, {"evicted_blocks": reply.count, "kept_blocks": kept},
                f"flushed {reply.count} blocks; {kept} in use kept")


def cmd_reload(args: argparse.Namespace) -> int:
    asked = False  # past the Hello: kvd has the request (no answer is then no reload)
    with AdminClient(args.socket_path, args.timeout) as c:
        try:
            c.connect()  # within --timeout: a stale socket is told at once
            c.patience = args.wait  # the read may take long: kvd answers pings meanwhile
            asked = True
            reply = c.request(m.Reload)  # refused: Failed, exit 1 with why
        except (Unreachable, Failed) as e:
            older = (isinstance(e, Failed) and e.code == m.Code.BAD_REQUEST
                     and "malformed message" in str(e))  # a kvd from before Reload
            if args.pid is None or not (older or isinstance(e, Unreachable) and not asked):
                raise
            return _sighup(args.pid, e)
    assert isinstance(reply, m.Reloaded)
    return _out(args, {"summary": reply.summary}, render.printable(reply.summary))


def _sighup(pid: int, why: Exception) -> int:
    """kvdctl reload's fallback: what ``ExecReload=kill -HUP`` did."""
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as e:
        print(f"kvdctl: kvd could not be asked ({why}), nor signalled: pid {pid}: "
              f"{e.strerror}", file=sys.stderr)
        return EXIT_DOWN
    print(f"kvdctl: kvd could not be asked ({why}); sent SIGHUP to pid {pid}: its log "
          "says what it applied", file=sys.stderr)
    return EXIT_OK


def _daemon_pid(text: str) -> int:
    """A pid to signal (argparse type): 0 and -1 would signal a group, or everything."""
    try:
        pid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a pid: {text!r}") from None
    if pid <= 1:
        raise argparse.ArgumentTypeError(f"{pid}: expected a process id above 1")
    return pid


def _show_value(key: str, value: Any) -> str:
    if key in SIZE_KEYS and isinstance(value, int):
        return f"{value} ({render.size(value)})"
    if key == "socket_mode" and isinstance(value, int):
        return oct(value)
    return json.dumps(value) if not isinstance(value, str) else value or '""'


def cmd_config(args: argparse.Namespace) -> int:
    with _client(args) as c:
        reply = c.request(m.GetConfig)
    assert isinstance(reply, m.ConfigOk)
    values = document(c, reply.values)
    doc = {k: {"value": v, "origin": reply.origins.get(k, "unknown")}
           for k, v in sorted(values.items())}
    text = render.table([[k, _show_value(k, d["value"]), d["origin"]] for k, d in doc.items()],
                        ["KEY", "VALUE", "ORIGIN"])
    return _out(args, doc, text)


def health_of(st: dict[str, Any], live: bool = False) -> tuple[bool, str]:
    """(healthy, one line of why)."""
    phase = st.get("phase", "serving")
    if st["pool"]["capacity_bytes"] <= 0:
        return False, "pool has no capacity"
    if not live and phase != "serving":
        return False, f"kvd is {phase}"
    if not live and (lost := (st.get("cuda") or {}).get("lost_gpus", 0)):
        return False, f"the CUDA context of {lost} GPU(s) is lost: restart kvd"
    if not live and (fault := st["pool"].get("fault")):
        return False, f"the pool file {fault}"
    used = st["pool"]["used_bytes"] / max(1, st["pool"]["capacity_bytes"])
    pin = st.get("pinning", {})
    note = f", pool not pinned: {pin.get('error', '')}" if pin.get("state") == "failed" else ""
    return True, (f"{phase}, pid {st['pid']}, {st['blocks']['ready']} blocks ready, "
                  f"pool {used:.0%} used, {len(st['clients'])} clients{note}")


def cmd_health(args: argparse.Namespace) -> int:
    try:
        with _client(args) as c:
            st = fetch_status(c)
    except AdminError as e:
        state = "down" if e.exit_code == EXIT_DOWN else "unhealthy"
        ok, why, code = False, str(e), e.exit_code
    else:
        ok, why = health_of(st, args.live)
        state, code = ("ok", EXIT_OK) if ok else ("unhealthy", EXIT_FAIL)
    why = why.replace("\n", " ")
    if args.json:
        print(json.dumps({"healthy": ok, "state": state, "reason": why}))
    else:
        print(f"{state}: {why}")
    return code


def cmd_top(args: argparse.Namespace) -> int:
    tty = sys.stdout.isatty() and not args.json
    prev: dict[str, Any] | None = None
    prev_t = 0.0
    n = 0
    with _client(args) as c:
        st = fetch_status(c)  # unreachable at the start: fail with the usual exit code
        try:
            while True:
                now = time.monotonic()
                r = render.rates(prev, st, now - prev_t)
                prev, prev_t = st, now
                stamp = time.strftime("%H:%M:%S")
                if args.json:
                    print(json.dumps({"time": time.time(), "phase": st.get("phase"),
                                      "pool_used_bytes": st["pool"]["used_bytes"],
                                      "clients": len(st["clients"]),
                                      "tenants": len(st["tenants"]), **r}), flush=True)
                else:
                    screen = render.top_text(st, r, stamp)
                    print(("\x1b[H\x1b[2J" if tty else "\n") + screen, flush=True)
                n += 1
                if args.iterations and n >= args.iterations:
                    return EXIT_OK
                time.sleep(args.interval)
                try:
                    st = fetch_status(c)
                except AdminError as e:  # show the outage, keep watching
                    print(f"{stamp} {e}", file=sys.stderr, flush=True)
                    c.close()
                    st = prev
        except KeyboardInterrupt:
            print()
            return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": cmd_status, "tenants": cmd_tenants, "clients": cmd_clients, "top": cmd_top,
    "evict": cmd_evict, "flush": cmd_flush, "config": cmd_config, "health": cmd_health,
    "reload": cmd_reload,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        from kvd.cli import simulate

        return simulate.run(args)
    try:
        args.socket_path = resolve_socket(args)
    except ValueError as e:  # an explicit --config that does not load
        print(f"kvdctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.command == "events":
            return tail.run(args, _client(args))
        return COMMANDS[args.command](args)
    except AdminError as e:
        print(f"kvdctl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # the reader left (`kvdctl status | head -1`): what it took went out
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return EXIT_OK
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # An answer of another shape than this kvdctl reads (a kvd of another version).
        print(f"kvdctl: kvd's answer on {args.socket_path} is not what this kvdctl reads "
              f"({type(e).__name__}: {e}): a kvd of another version?", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
