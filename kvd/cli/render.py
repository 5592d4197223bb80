"""kvdctl's human output: tables and summaries from the daemon's status document.

Kept apart from the commands so that every view (status, tenants, clients, top) draws
from the same few functions and the JSON schema stays the daemon's own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    mi, s = divmod(s, 60)
    return (f"{d}d{h}h" if d else f"{h}h{mi}m" if h else f"{mi}m{s}s" if mi else f"{s}s")


def printable(text: str) -> str:
    """``text`` safe for an operator's terminal: model and client names come from
    clients, and a newline or an escape sequence in one would forge table rows or drive
    the terminal (its title, the screen). Escaped as Python writes it, so it still reads."""
    return text if text.isprintable() else repr(text)[1:-1]


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[printable(str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def tenants_table(tenants: list[dict[str, Any]]) -> str:
    if not tenants:
        return "no tenants"
    return table([[t["id"], t["model"], t["tp_size"], size(t["slot_bytes"]), t["blocks"],
                   size(t["bytes"]), t["clients"], t.get("digest", "")] for t in tenants],
                 ["TENANT", "MODEL", "TP", "BLOCK", "BLOCKS", "BYTES", "CLIENTS", "DIGEST"])


def by_kind(clients: list[dict[str, Any]]) -> str:
    """`` (scheduler 1, worker0 1, admin 1)``: engines told apart from kvdctl itself."""
    kinds = Counter(c.get("kind", "-") for c in clients)
    return f" ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})" if kinds else ""


def clients_table(clients: list[dict[str, Any]]) -> str:
    if not clients:
        return "no clients"
    return table([[c["id"], c["pid"], c.get("kind", "-"), c["name"] or "-",
                   "-" if c["tenant"] is None else c["tenant"],
                   "-" if c["tenant"] is None else "sched" if c["rank"] < 0 else c["rank"],
                   c["inflight"], c["requests"]]
                  for c in clients],
                 ["CLIENT", "PID", "KIND", "NAME", "TENANT", "RANK", "INFLIGHT", "REQUESTS"])


def pinning(st: dict[str, Any]) -> str:
    pin = st.get("pinning", {})
    state = pin.get("state", "unavailable")
    if state == "running":
        return f"pinning {pin.get('fraction', 0):.0%}"
    if state == "failed":
        return "pinning failed (serving unpinned)"
    return {"done": "pinned", "unavailable": "not pinned (no GPU)"}.get(state, state)


def status_text(st: dict[str, Any]) -> str:
    pool, blocks, c = st["pool"], st["blocks"], st["counters"]
    used = pool["used_bytes"] / max(1, pool["capacity_bytes"])
    hit = c["hit_blocks"] / max(1, c["lookup_keys"])
    errors = ", ".join(f"{k} {v}" for k, v in sorted(c.get("errors_by_code", {}).items()))
    sized = f" for {blocks['capacity']} blocks" if "capacity" in blocks else ""
    if leader := st.get("policy_state", {}).get("leader"):
        sized += f" (leading: {leader})"
    lines = [
        f"kvd pid {st['pid']}  {st.get('phase', 'serving')}  up {duration(st['uptime_s'])}  "
        f"policy {st['policy']}{sized}  protocol {st['version']}",
        f"pool     {size(pool['used_bytes'])} of {size(pool['capacity_bytes'])} ({used:.1%})  "
        f"{pool['path']}  {pinning(st)}",
        f"blocks   ready {blocks['ready']}  pending {blocks['pending']}  "
        f"pinned {blocks['pinned']}  leases {blocks['leases']}  "
        f"transfers in flight {st.get('transfers', {}).get('inflight', 0)}",
        f"traffic  lookups {c['lookups']}  hit {c['hit_blocks']}/{c['lookup_keys']} blocks "
        f"({hit:.1%})  stored {c['stored_blocks']} ({size(c['stored_bytes'])})  "
        f"loaded {c['loaded_blocks']} ({size(c['loaded_bytes'])})  "
        f"evicted {c['evicted_blocks']}",
        f"errors   {c['errors']}" + (f" ({errors})" if errors else ""),
        f"clients  {len(st['clients'])}{by_kind(st['clients'])}  tenants {len(st['tenants'])}"
        + (f"  metrics {st['metrics']}" if st.get("metrics") else ""),
        *tiers_lines(st),
    ]
    return "\n".join(lines)


# A tier's breaker state, as an operator reads it ("closed" reads as "off").
TIER_STATES = {"closed": "up", "open": "down", "half_open": "retrying",
               "unconnected": "not connected yet"}


def tier_state(tier: dict[str, Any]) -> str:
    state = tier.get("state", "?")
    return TIER_STATES.get(state, state)


def tiers_lines(st: dict[str, Any]) -> list[str]:
    """One line per tier below the pool, and what moved between them."""
    tiers, c = st.get("tiers") or {}, st["counters"]
    lines = []
    if "disk" in tiers:
        d = tiers["disk"]
        bad = f"  bad slots {d['bad_slots']}" if d.get("bad_slots") else ""
        lines.append(f"disk     {tier_state(d)}  {size(d.get('bytes', 0))} of "
                     f"{size(d.get('capacity_bytes', 0))}  {d.get('blocks', 0)} blocks{bad}"
                     f"  {d.get('path', '')}" + _last_error(d))
    if "remote" in tiers:
        r = tiers["remote"]
        refused = f"  refused {r['rejected_blocks']}" if r.get("rejected_blocks") else ""
        down = r.get("masters_down") or []
        masters = f"  masters down: {' '.join(down)}" if down else ""
        lines.append(f"remote   {tier_state(r)}{masters}  written "
                     f"{r.get('written_blocks', 0)}  read {r.get('read_blocks', 0)}  corrupt "
                     f"{r.get('corrupt_blocks', 0)}{refused}  errors {r.get('errors', 0)}  "
                     f"{r.get('urls', '')}" + _last_error(r))
    if tiers:
        lines.append(f"tiering  demoted {c.get('demoted_blocks', 0)} (dropped "
                     f"{c.get('demote_dropped', 0)})  written behind "
                     f"{c.get('written_behind_blocks', 0)} (dropped "
                     f"{c.get('write_behind_dropped', 0)})  promoted disk "
                     f"{c.get('disk_hit_blocks', 0)} remote {c.get('remote_hit_blocks', 0)}"
                     f" (failed {c.get('promote_failed', 0)})")
    return lines


def _last_error(tier: dict[str, Any]) -> str:
    """A failing tier's last error (while it is failing), so the operator sees why."""
    failing = tier.get("consecutive_failures") or tier.get("masters_down")
    if failing and tier.get("last_error"):
        return f"\n         last error: {tier['last_error']}"
    return ""


def rates(prev: dict[str, Any] | None, cur: dict[str, Any], seconds: float) -> dict[str, float]:
    """Per-second rates between two status documents (zeros on the first)."""
    c = cur["counters"]
    p = prev["counters"] if prev and prev.get("instance") == cur.get("instance") else c
    dt = max(seconds, 1e-6)

    def rate(key: str) -> float:
        return (c.get(key, 0) - p.get(key, 0)) / dt

    asked = c["lookup_keys"] - p["lookup_keys"]
    return {
        "lookups_per_s": rate("lookups"),
        "hit_rate": (c["hit_blocks"] - p["hit_blocks"]) / asked if asked else 0.0,
        "stored_bytes_per_s": rate("stored_bytes"),
        "loaded_bytes_per_s": rate("loaded_bytes"),
        "evicted_blocks_per_s": rate("evicted_blocks"),
        "errors_per_s": rate("errors"),
    }


def top_text(st: dict[str, Any], r: dict[str, float], when: str) -> str:
    pool = st["pool"]
    used = pool["used_bytes"] / max(1, pool["capacity_bytes"])
    bar = "#" * int(used * 30)
    head = [
        f"kvd pid {st['pid']}  {st.get('phase', 'serving')}  up {duration(st['uptime_s'])}  "
        f"policy {st['policy']}  {when}  (Ctrl-C quits)",
        f"pool  [{bar:<30}] {used:.1%} of {size(pool['capacity_bytes'])}  {pinning(st)}",
        f"rate  {r['lookups_per_s']:.0f} lookups/s  hit {r['hit_rate']:.1%}  "
        f"store {size(r['stored_bytes_per_s'])}/s  load {size(r['loaded_bytes_per_s'])}/s  "
        f"evict {r['evicted_blocks_per_s']:.0f}/s  errors {r['errors_per_s']:.0f}/s",
        f"now   ready {st['blocks']['ready']}  pending {st['blocks']['pending']}  "
        f"leases {st['blocks']['leases']}  in flight "
        f"{st.get('transfers', {}).get('inflight', 0)}",
        "",
        tenants_table(st["tenants"]),
        "",
        clients_table(st["clients"]),
    ]
    return "\n".join(head)
