"""``shoal status ADDR``: a run's state, as the master's ``/status`` serves it, as tables."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence


def fetch(addr: str, timeout: float = 5.0) -> dict[str, Any]:
    """The master's ``/status`` at ``addr`` (``host:port`` of its HTTP endpoints, or a URL)."""
    url = addr if "://" in addr else f"http://{addr}"
    url = url.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            result: dict[str, Any] = json.load(r)
            return result
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise SystemExit(f"shoal status: cannot read {url}: {reason} (is the master started with --http?)") from None


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def catch_up_bar(c: dict[str, Any], width: int = 30) -> str:
    """A catch-up's progress as ``/status`` reports it, drawn as a bar."""
    total = c["total_bytes"]
    share = c["done_bytes"] / total if total else 1.0
    eta = c["eta_s"]
    left = "?" if eta is None or eta > 1e9 else f"{eta:.0f} s"
    return (f"catching up [{'#' * int(share * width):<{width}}] {share:4.0%} "
            f"{size(c['done_bytes'])} of {size(total)}, {left} left")


def render(s: dict[str, Any]) -> str:
    """The tables ``shoal status`` prints."""
    peers = s["peers"]
    accepted = sum(1 for p in peers if p["state"] == "accepted")
    catching_up = sum(1 for p in peers if p["state"] == "catching_up")
    c = s["counters"]
    out = [
        f"run {s['session']}: {len(s['groups'])} groups, last topology issued {s['epoch']}",
        f"peers: {accepted} accepted, {len(peers) - accepted - catching_up} registered, {catching_up} catching up; "
        f"since start {c['joins']} joined, {c['left']} left, {c['lost']} lost, {c['expelled']} expelled",
        "",
    ]
    rows = []
    for p in peers:
        ops = p.get("operations", {}).values()
        rows.append([
            f"p{p['id']}", p["group"], "-" if p["rank"] is None else p["rank"], p["state"], p["addr"],
            sum(o["succeeded"] for o in ops), sum(o["failed"] for o in ops), size(sum(o["tx_bytes"] for o in ops)),
            len(p.get("running", [])), f"{p['silent_s']:.1f} s",
        ])
    out.append(table(["peer", "group", "rank", "state", "address", "ok", "failed", "sent", "running", "silent"], rows))
    for g in s["groups"]:
        members = [f"p{m}" for m in g["ring"]]
        ring = " -> ".join(members + members[:1]) if members else "(empty)"
        line = f"ring of group {g['group']} (topology {g['ring_epoch']}, {g['phase']}): {ring}"
        if g["revision"] is not None:
            line += f"; shared state at revision {g['revision']} ({len(g['hashes'])} tensors)"
        if g.get("snapshot"):
            snap = g["snapshot"]
            holders = ", ".join(f"p{p}" for p in snap["held_by"]) or "nobody yet"
            line += f"; a copy of revision {snap['revision']} kept for newcomers by {holders}"
        out += ["", line]
    for p in peers:
        if p.get("catch_up"):
            out.append(f"p{p['id']} " + catch_up_bar(p["catch_up"]))
    if s["operations"]:
        rows = []
        for kind, o in s["operations"].items():
            ended = o["succeeded"] + o["failed"]
            mean = f"{1000 * o['seconds'] / ended:.2f} ms" if ended else "-"
            rows.append([kind, o["started"], o["succeeded"], o["failed"], size(o["tx_bytes"]), mean])
        out += ["", table(["operation", "started", "succeeded", "failed", "sent", "mean"], rows)]
    if s["failures"]:
        out.append("failures by cause: " + ", ".join(f"{k} {v}" for k, v in s["failures"].items()))
    if s.get("stragglers"):
        rows = [[f"p{t['peer']}", t["group"], f"{t['recent_last']} of {t['recent_ops']}",
                 f"{1000 * t['recent_median_late_s']:.1f} ms", "yes" if t["straggler"] else "no"]
                for t in s["stragglers"]]
        out += ["", table(["last to call", "group", "recent", "median late", "holds others up"], rows)]
    if s["running"]:
        rows = [[f"p{r['peer']}", r["kind"], size(r["bytes"]), f"{r['elapsed_s']:.1f} s"] for r in s["running"]]
        out += ["", table(["running on", "operation", "bytes", "for"], rows)]
    for g in s["groups"]:
        m = g["matrix"]
        if not m:
            continue
        names = [f"p{p}" for p in m["peers"]]
        rows = []
        for i, name in enumerate(names):
            row: list[object] = [name]
            for j in range(len(names)):
                bw, rtt = m["bytes_per_s"][i][j], m["rtt_us"][i][j]
                row.append("-" if bw is None else f"{size(bw)}/s {rtt / 1000:.1f} ms")
            rows.append(row)
        heading = f"links measured by optimize_topology in group {g['group']} (row to column):"
        out += ["", heading, table(["", *names], rows)]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="shoal status", description="Print a run's state from its master.")
    parser.add_argument("addr", help="HOST:PORT the master serves HTTP on (shoal master --http)")
    parser.add_argument("--json", action="store_true", help="print /status as it is")
    parser.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="print again every SECONDS")
    args = parser.parse_args(argv)
    while True:
        s = fetch(args.addr)
        text = json.dumps(s, indent=2) if args.json else render(s)
        if args.watch:
            text = "\x1b[H\x1b[2J" + text
        print(text, flush=True)
        if not args.watch:
            return
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            sys.exit(0)
