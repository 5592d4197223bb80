"""``kvdctl``: the admin CLI. Human tables by default, ``--json`` for machines.

Exit codes: 0 ok, 1 unhealthy or refused, 2 usage error, 3 daemon unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvd.config import default_socket

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvdctl", description="Administer the local kvd.")
    p.add_argument("--socket", default=os.environ.get("KVD_SOCKET") or default_socket(),
                   help="daemon socket (KVD_SOCKET; default %(default)s)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for kvd")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="pool, blocks, clients, tenants and counters")
    s.add_argument("--json", action="store_true")
    h = sub.add_parser("health", help="exit 0 when kvd answers and is healthy, else 1")
    h.add_argument("--json", action="store_true")
    e = sub.add_parser("evict", help="drop READY unpinned blocks")
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--tenant", type=int, metavar="ID")
    g.add_argument("--all", action="store_true")
    e.add_argument("--json", action="store_true")
    try:
        from kvd.cli import simulate
    except ImportError:  # pragma: no cover - simulate ships with kvd
        pass
    else:
        simulate.add_parser(sub)
    return p


def _connect(args: argparse.Namespace):
    from kvd_client import Connection

    conn = Connection(args.socket, name="kvdctl", timeout=args.timeout)
    if not conn.wait_up(args.timeout):
        conn.close()
        return None
    return conn


def _request(args: argparse.Namespace, make) -> Any:
    """Send one request; returns the reply, or an exit code when kvd is unreachable."""
    from kvd_client import KvdClientError

    conn = _connect(args)
    if conn is None:
        print(f"kvdctl: kvd is not answering on {args.socket}", file=sys.stderr)
        return EXIT_DOWN
    try:
        return conn.request(make(conn.next_req()), args.timeout)
    except KvdClientError as e:
        print(f"kvdctl: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        conn.close()


def fetch_status(args: argparse.Namespace) -> dict | int:
    from kvd_proto import messages as m

    reply = _request(args, m.Stats)
    return reply if isinstance(reply, int) else json.loads(reply.status)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def print_status(st: dict) -> None:
    pool, blocks, c = st["pool"], st["blocks"], st["counters"]
    used = pool["used_bytes"] / max(1, pool["capacity_bytes"])
    hit = c["hit_blocks"] / max(1, c["lookup_keys"])
    print(f"kvd pid {st['pid']}  up {st['uptime_s']:.0f}s  policy {st['policy']}")
    print(f"pool     {_size(pool['used_bytes'])} of {_size(pool['capacity_bytes'])} "
          f"({used:.1%})  {pool['path']}")
    print(f"blocks   ready {blocks['ready']}  pending {blocks['pending']}  "
          f"pinned {blocks['pinned']}  leases {blocks['leases']}")
    print(f"traffic  lookups {c['lookups']}  hit {c['hit_blocks']}/{c['lookup_keys']} "
          f"blocks ({hit:.1%})  stored {c['stored_blocks']}  loaded {c['loaded_blocks']}  "
          f"evicted {c['evicted_blocks']}  errors {c['errors']}")
    if st["tenants"]:
        print()
        print(_table([[t["id"], t["model"], t["tp_size"], _size(t["slot_bytes"]), t["blocks"],
                       _size(t["bytes"]), t["clients"]] for t in st["tenants"]],
                     ["TENANT", "MODEL", "TP", "BLOCK", "BLOCKS", "BYTES", "CLIENTS"]))
    if st["clients"]:
        print()
        print(_table([[cl["id"], cl["pid"], cl["name"], cl["tenant"], cl["rank"],
                       cl["inflight"], cl["requests"]] for cl in st["clients"]],
                     ["CLIENT", "PID", "NAME", "TENANT", "RANK", "INFLIGHT", "REQUESTS"]))


def cmd_status(args: argparse.Namespace) -> int:
    st = fetch_status(args)
    if isinstance(st, int):
        return st
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print_status(st)
    return EXIT_OK


def health_of(st: dict) -> tuple[bool, str]:
    pool = st["pool"]
    if pool["capacity_bytes"] <= 0:
        return False, "pool has no capacity"
    return True, (f"ok: pid {st['pid']}, {st['blocks']['ready']} blocks ready, "
                  f"{len(st['clients'])} clients")


def cmd_health(args: argparse.Namespace) -> int:
    st = fetch_status(args)
    if isinstance(st, int):
        ok, why = False, f"kvd is not answering on {args.socket}"
    else:
        ok, why = health_of(st)
    if args.json:
        print(json.dumps({"healthy": ok, "reason": why}))
    else:
        print(why if ok else f"unhealthy: {why}")
    return EXIT_OK if ok else EXIT_FAIL


def cmd_evict(args: argparse.Namespace) -> int:
    from kvd_proto import messages as m

    tenant = -1 if args.all else args.tenant
    reply = _request(args, lambda req: m.Evict(req, tenant))
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps({"evicted_blocks": reply.count}))
    else:
        print(f"evicted {reply.count} blocks")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "simulate":
        from kvd.cli import simulate

        return simulate.run(args)
    handler = {"status": cmd_status, "health": cmd_health, "evict": cmd_evict}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
