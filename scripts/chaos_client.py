"""Kill -9 clients in the middle of transfers; nothing may leak.

Each round a client process takes a lease, allocates 1,024 slots, starts a 16 MiB
store and is killed with SIGKILL. The daemon must release its leases, pins and PENDING
blocks (within 2 s: it watches client pids with pidfds) and free every slot.

    python scripts/chaos_client.py --rounds 50 [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import DaemonProc, emit  # noqa: E402
from _chaos import kill_clients  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    d = DaemonProc("--pool-size", "256M", "--extent-size", "16M", "--log-level", "warning")
    try:
        d.start()
        rows = kill_clients(d.socket, args.rounds, d.status)
    finally:
        d.cleanup()
    leaks = [r for r in rows if r["pending"] or r["pinned"] or r["leases"]
             or r["used_bytes"] != r["ready_bytes"]]
    summary = {
        "rounds": len(rows),
        "rounds_with_leaks": len(leaks),
        "max_release_s": round(max(r["released_s"] for r in rows), 3),
    }
    emit(rows[-5:], [("released_s", "released s", ".3f"), ("pending", "pending", "d"),
                     ("pinned", "pinned", "d"), ("leases", "leases", "d"),
                     ("used_bytes", "used B", "d"), ("ready_bytes", "ready B", "d")],
         args.json, summary)
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
