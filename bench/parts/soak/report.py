"""The soak's report: totals, latency percentiles, memory trends and the verdict (bench/soak.py)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import Counter
from typing import Any

from bench.harness.stats import percentile
from bench.parts.soak.system import System

# --- report ------------------------------------------------------------------------------------------

def slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 3:
        return float("nan")
    xs, ys = [p[0] / 60 for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else float("nan")


def trend(series: list[dict[str, Any]], get: Any, duration: float) -> dict[str, Any] | None:
    points = [(s["t"], v) for s in series if (v := get(s)) is not None]
    if not points:
        return None
    values = [v for _, v in points]
    second_half = [p for p in points if duration / 2 <= p[0] <= duration]
    return {"first": values[0], "last": values[-1], "max": max(values), "min": min(values),
            "slope_per_min": slope_per_min([p for p in points if p[0] <= duration]),
            "slope_per_min_2nd_half": slope_per_min(second_half), "samples": len(points)}


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"failed": Counter(), "unfinished": [], "samples": [], "client_crashes": [],
                             "ttft": {"websocket": [], "redis": []}, "latency": {"websocket": [], "redis": []},
                             "per_path": {"websocket": Counter(), "redis": Counter()}}
    for part in parts:
        for k, v in part.items():
            if k == "failed":
                total["failed"].update(v)
            elif k in ("ttft", "latency"):
                for path, values in v.items():
                    total[k][path].extend(values)
            elif k == "per_path":
                for path, counts in v.items():
                    total[k][path].update(counts)
            elif isinstance(v, list):
                total[k].extend(v)
            else:
                total[k] = total.get(k, 0) + v
    total["failed"] = dict(total["failed"])
    total["per_path"] = {path: dict(c) for path, c in total["per_path"].items()}
    return total


def mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f}"


def report(args: argparse.Namespace, res: dict[str, Any], series: list[dict[str, Any]], faults: list[dict],
           system: System, probes: list[dict], duration: float, wall: float,
           load: tuple[float, float]) -> tuple[dict[str, Any], bool]:
    def pct(values: list[float], q: float) -> float:
        return round(1e3 * percentile(values, q), 1)

    failed_total = sum(res["failed"].values())
    crashes = system.crashes
    ttft_all = res["ttft"]["websocket"] + res["ttft"]["redis"]
    latency_all = res["latency"]["websocket"] + res["latency"]["redis"]
    trends = {"redis_used_memory": trend(series, lambda s: s.get("redis_used_memory"), duration)}
    if args.workers:
        trends["worker0_rss"] = trend(series, lambda s: s["worker_rss"][0], duration)
        trends["workers_rss_sum"] = trend(series, lambda s: sum(v or 0 for v in s["worker_rss"]), duration)
    for i in range(args.gateways):
        trends[f"gateway{i}_rss"] = trend(series, lambda s, i=i: s["gateway_rss"][i], duration)
    kinds = Counter(f["fault"] for f in faults)
    summary = {
        "requests_completed": res.get("completed", 0),
        "requests_per_s": round(res.get("completed", 0) / duration, 2),
        "requests_failed": failed_total, "failed_by_code": res["failed"],
        "events_lost": res.get("lost", 0), "events_duplicated": res.get("duplicated", 0),
        "stray_frames": res.get("stray", 0),
        "streams_never_finished": len(res["unfinished"]),
        "wrong_token_count": res.get("wrong_count", 0), "wrong_greedy_tokens": res.get("wrong_tokens", 0),
        "ttft_p50_ms": pct(ttft_all, 0.5), "ttft_p99_ms": pct(ttft_all, 0.99),
        "latency_p50_ms": pct(latency_all, 0.5), "latency_p99_ms": pct(latency_all, 0.99),
        "latency_max_ms": round(1e3 * max(latency_all, default=float("nan")), 1),
        "per_path": {path: {**counts, "ttft_p50_ms": pct(res["ttft"][path], 0.5),
                            "ttft_p99_ms": pct(res["ttft"][path], 0.99),
                            "latency_p50_ms": pct(res["latency"][path], 0.5),
                            "latency_p99_ms": pct(res["latency"][path], 0.99)}
                     for path, counts in res["per_path"].items()},
        "planned_resumes": res.get("planned_resumes", 0), "unplanned_reconnects": res.get("unplanned_reconnects", 0),
        "submit_retries": res.get("submit_retries", 0), "clients_dropped": res.get("drops", 0),
        "faults": dict(kinds), "crashed_processes": len(crashes), "client_crashes": res["client_crashes"],
        "worker_starts_refused_redis_away": len(system.refused_starts),
        "served_after_soak": probes,
    }
    bad = bool(summary["events_lost"] or summary["events_duplicated"] or summary["streams_never_finished"]
               or summary["wrong_token_count"] or summary["wrong_greedy_tokens"] or summary["stray_frames"]
               or crashes or res["client_crashes"] or not all(p["ok"] for p in probes))
    ws_n = round(args.streams * args.ws_share)
    downs = [f["down_s"] for f in faults if f["fault"] == "restart_redis"]
    print(f"\nsoak: {args.streams} streams ({ws_n} WebSocket through {args.gateways} gateway(s), "
          f"{args.streams - ws_n} straight to Redis), {args.workers} workers (tiny random Llama, CPU), "
          f"{duration / 60:.1f} min of load, {wall / 60:.1f} min in all, {os.cpu_count()} CPUs "
          f"(load average {load[0]:.1f} before, {load[1]:.1f} at the end)")
    if faults:
        print(f"faults every {args.fault_every:g}s: {kinds.get('kill_worker', 0)} worker SIGKILLs, "
              f"{kinds.get('restart_redis', 0)} Redis restarts (down {statistics.median(downs) if downs else 0:.1f}s "
              f"median), {kinds.get('drop_clients', 0)} client drops ({summary['clients_dropped']} streams cut)")
    else:
        print("no faults injected")
    codes = ", ".join(f"{k}: {v}" for k, v in sorted(res["failed"].items())) or "-"
    rows = [
        ("requests completed", f"{summary['requests_completed']} ({summary['requests_per_s']}/s)"),
        ("requests failed", f"{failed_total} ({codes})"),
        ("events lost (seq gaps)", summary["events_lost"]),
        ("events duplicated (seq seen twice)", summary["events_duplicated"]),
        ("streams never finished", summary["streams_never_finished"]),
        ("wrong outputs (token count / greedy tokens)", f"{summary['wrong_token_count']} / "
                                                         f"{summary['wrong_greedy_tokens']}"),
        ("TTFT p50 / p99", f"{summary['ttft_p50_ms'] / 1e3:.2f} s / {summary['ttft_p99_ms'] / 1e3:.2f} s"),
        ("request latency p50 / p99 / max", f"{summary['latency_p50_ms'] / 1e3:.2f} s / "
                                            f"{summary['latency_p99_ms'] / 1e3:.2f} s / "
                                            f"{summary['latency_max_ms'] / 1e3:.2f} s"),
        ("resumes after a drop / unplanned reconnects", f"{summary['planned_resumes']} / "
                                                         f"{summary['unplanned_reconnects']}"),
        ("submits retried (Redis away)", summary["submit_retries"]),
        ("frames for a request after its final event", summary["stray_frames"]),
        ("processes that crashed by themselves", len(crashes)),
        ("worker restarts refused at start-up (Redis away)", len(system.refused_starts)),
        ("a fresh request served after the soak", ", ".join(
            f"{p['path']}: {'yes' if p['ok'] else 'NO'} ({p.get('seconds', '-')} s)" for p in probes)),
    ]
    print("\n| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("\n| path | completed | failed | lost | duplicated | never finished | TTFT p50 / p99 | latency p50 / p99 |\n"
          "|---|---|---|---|---|---|---|---|")
    for path, c in summary["per_path"].items():
        print(f"| {path} | {c.get('completed', 0)} | {c.get('failed', 0)} | {c.get('lost', 0)} | "
              f"{c.get('duplicated', 0)} | {c.get('unfinished', 0)} | {c['ttft_p50_ms'] / 1e3:.2f} s / "
              f"{c['ttft_p99_ms'] / 1e3:.2f} s | {c['latency_p50_ms'] / 1e3:.2f} s / "
              f"{c['latency_p99_ms'] / 1e3:.2f} s |")
    print("\n| over time (MB) | first | last | max | slope MB/min (all) | slope MB/min (2nd half) |\n"
          "|---|---|---|---|---|---|")
    for name, tr in trends.items():
        if tr:
            print(f"| {name} | {mb(tr['first'])} | {mb(tr['last'])} | {mb(tr['max'])} | "
                  f"{tr['slope_per_min'] / 2**20:+.2f} | {tr['slope_per_min_2nd_half'] / 2**20:+.2f} |")
    if res["samples"]:
        print("\nproblems seen (first of each kind):")
        for s in res["samples"][:30]:
            print("  ", json.dumps({k: v for k, v in s.items() if k != "trace"}))
    for p in probes:
        if not p["ok"]:
            print(f"  after the soak, {p['path']} did not serve a fresh request: {json.dumps(p)}")
    print("\nRESULT:", "FAIL (events lost or duplicated, streams unfinished, wrong output, a crash, or a "
          "part that no longer serves)" if bad
          else "OK (nothing lost, duplicated or left unfinished)")
    return {"summary": summary, "trends": trends, "ok": not bad}, bad
