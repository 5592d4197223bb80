"""Kill -9 a persistent daemon under a load of real stores; restart; verify.

Writer processes store blocks whose bytes are a function of their key. After every
SIGKILL the daemon is started again (``persist = true``): every block a writer saw
committed must be back, and every block loaded must be byte-identical (corrupt = 0).

    python scripts/chaos_daemon.py --rounds 20 [--writers 2] [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import DaemonProc, emit  # noqa: E402
from _chaos import kill_daemon  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--pool-size", default="2G")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    d = DaemonProc("--pool-size", args.pool_size, "--extent-size", "16M",
                   "--log-level", "warning", env={"KVD_PERSIST": "true"})
    try:
        d.start()
        rows = kill_daemon(d, args.rounds, args.writers)
    finally:
        d.cleanup()
    last = rows[-1]
    summary = {
        "kills": len(rows),
        "blocks_committed": last["committed"],
        "blocks_restored_last_round": last["restored"],
        "missing_total": sum(r["missing"] for r in rows),
        "corrupt_loaded_total": sum(r["corrupt_loaded"] for r in rows),
        "max_restart_s": round(max(r["restart_s"] for r in rows), 2),
    }
    emit(rows, [("committed", "committed", "d"), ("restored", "restored", "d"),
                ("missing", "missing", "d"), ("corrupt_loaded", "corrupt", "d"),
                ("restart_s", "restart s", ".2f")], args.json, summary)
    return 1 if summary["missing_total"] or summary["corrupt_loaded_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
