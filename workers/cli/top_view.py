"""`streamer top`'s frame: a snapshot (top_data.py, a plain dict) in, one rich renderable out.

Pure: no Redis, no clock (ages are taken against the snapshot's own `time_ms`), so a frame can be
rendered and checked from a dict alone.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 10


def kv_bar(used: int, total: int, width: int = BAR_WIDTH) -> Text:
    """`████░░░░░░  38% 48/128`: the share of the KV cache's blocks in use (styled by how full it is)."""
    share = min(1.0, max(0.0, used / total)) if total > 0 else 0.0
    filled = round(share * width)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    bar = Text("█" * filled, style=style)
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {share:4.0%} {used}/{total}")
    return bar


def ago(now_ms: int, then_ms: int) -> str:
    seconds = max(0.0, (now_ms - then_ms) / 1000)
    if seconds < 60:
        return f"{seconds:.0f}s ago" if seconds >= 10 else f"{seconds:.1f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def breakdown(parts: dict[str, Any]) -> str:
    """`schedule 1.0 ms, execute 120.3 ms, process 0.2 ms` (whatever parts the trace names)."""
    shown = []
    for key, value in parts.items():
        try:
            shown.append(f"{key.removesuffix('_s')} {ms(float(value))}")
        except (TypeError, ValueError):
            shown.append(f"{key} {value}")
    return ", ".join(shown) or "-"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _table(title: str, *columns: str, right: tuple[str, ...] = ()) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  header_style="bold", show_edge=False, pad_edge=False, expand=False)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", no_wrap=column != "BREAKDOWN")
    return table


def workers_table(snap: dict[str, Any]) -> Table:
    workers = snap.get("workers", [])
    table = _table(f"Workers ({len(workers)})", "WORKER", "MODEL", "DEVICE", "RUN", "WAIT", "JOBS", "KV CACHE",
                   "TOKENS/S", "BEAT", right=("RUN", "WAIT", "JOBS", "TOKENS/S"))
    for w in workers:
        table.add_row(w["name"], w["model"], w["device"], str(w["running"]), str(w["waiting"]), str(w["jobs"]),
                      kv_bar(w["kv_blocks_used"], w["kv_blocks_total"]), rate(w["tokens_per_s"]),
                      ago(snap["time_ms"], w["updated_ms"]) if w["updated_ms"] else "-")
    if not workers:
        table.add_row(Text("no live worker", style="yellow"), *[""] * 8)
    return table


def streams_table(snap: dict[str, Any]) -> Table:
    table = _table("Request streams", "STREAM", "BACKLOG", "GROUP", "CONSUMERS", "PENDING", "LAG",
                   right=("BACKLOG", "CONSUMERS", "PENDING", "LAG"))
    for s in snap.get("streams", []):
        groups = s["groups"] or [None]
        for i, g in enumerate(groups):
            first = (s["name"], str(s["length"])) if i == 0 else ("", "")
            if g is None:
                table.add_row(*first, Text("no group yet", style="dim"), "-", "-", "-")
            else:
                lag = "-" if g["lag"] is None else str(g["lag"])
                table.add_row(*first, g["name"], str(g["consumers"]), str(g["pending"]), lag)
    return table


def traces_table(snap: dict[str, Any]) -> Table:
    traces = snap.get("traces", [])
    table = _table(f"Slow steps (newest of {snap.get('traces_stream', 'llm:traces')})", "WHEN (UTC)", "WORKER",
                   "STEP", "TOTAL", "BREAKDOWN", right=("STEP", "TOTAL"))
    for t in traces:
        when = time.strftime("%H:%M:%S", time.gmtime(t["at_ms"] / 1000)) if t["at_ms"] else "?"
        table.add_row(f"{when} ({ago(snap['time_ms'], t['at_ms'])})" if t["at_ms"] else when, t["worker"],
                      "-" if t["step"] is None else str(t["step"]), ms(t["total_s"]), breakdown(t["breakdown"]))
    if not traces:
        table.add_row(Text("none", style="dim"), "", "", "", "")
    return table


def batches_table(snap: dict[str, Any]) -> Table:
    batches = snap.get("batches", [])
    table = _table(f"Batches running ({len(batches)})", "BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED", "TOTAL",
                   right=("DONE", "FAILED", "TOTAL"))
    for b in batches:
        table.add_row(b["id"], b["status"], b["endpoint"], str(b["completed"]), str(b["failed"]), str(b["total"]))
    if not batches:
        table.add_row(Text("none", style="dim"), "", "", "", "", "")
    return table


def header(snap: dict[str, Any]) -> Text:
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snap["time_ms"] / 1000))
    line = Text("streamer top", style="bold")
    line.append(f"  {snap.get('redis', '')}  {now}  ")
    dead = snap.get("dead", 0)
    line.append(f"dead letters: {dead}", style="red" if dead else "")
    line.append(f" ({snap.get('dead_stream', 'llm:dead')})", style="dim")
    if snap.get("error"):
        line.append(f"\n{snap['error']}", style="bold red")
    return line


def render(snap: dict[str, Any]) -> RenderableType:
    return Group(header(snap), "", workers_table(snap), "", streams_table(snap), "", batches_table(snap), "",
                 traces_table(snap))
