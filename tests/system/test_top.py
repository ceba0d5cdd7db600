"""`streamer top`: the live view on a pseudo-terminal against a real worker, one plain frame when piped
(backlog, consumer-group lag, dead letters, slow steps), tokens/s from successive heartbeats, and a
friendly line when Redis is down. The frame itself is rendered from plain dicts, no Redis."""

from __future__ import annotations

import fcntl
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import redis
from redis_worker_helpers import worker_process
from rich.console import Console
from test_progress_display import ANSI, read_pty, screen, terminal_env

from clients.heartbeats import live_workers
from clients.protocol import Names, encode_job
from workers.cli.top_data import TOKENS_FIELD, Gatherer, Rates
from workers.cli.top_view import render
from workers.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKS = re.compile(r"top-worker-1 .*%\s+\d+/128\s+[1-9][\d.,]*\s")  # the row, with a non-zero tokens/s after the KV bar
NAMES = Names()


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in terminal_env(**extra).items() if not k.startswith("STREAMER_")}


def top(*args: str) -> subprocess.CompletedProcess:
    """`streamer top` with its output piped (not a terminal)."""
    env = {k: v for k, v in _env().items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "workers.cli", "top", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT, env=env)


def _wait_for_worker(url: str, name: str, log: Path, timeout: float = 60) -> None:
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout
        while name not in live_workers(client, NAMES):
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        client.close()


def test_live_view_on_a_terminal_until_ctrl_c(llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    worker = worker_process(llama_ckpt, redis_url, "--device", "cpu", "--consumer", "top-worker-1",
                            "--claim-idle", "2", log_path=log)
    try:
        _wait_for_worker(redis_url, "top-worker-1", log)
        # Work during the view: its tokens/s comes from the heartbeats' generation_tokens counter.
        client = redis.Redis.from_url(redis_url)
        client.xadd(NAMES.requests, encode_job({"id": "busy", "prompt": "count", "params": {
            "max_tokens": 900, "temperature": 0, "ignore_eos": True}}))
        client.close()
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "top", "--redis", redis_url, "--interval", "0.2"],
                                stdin=slave, stdout=slave, stderr=slave, env=_env(COLUMNS="160"), cwd=ROOT)
        os.close(slave)
        chunks: list[bytes] = []
        read_pty(master, chunks, time.monotonic() + 20, lambda raw: raw.count(b"Workers (1)") >= 4 and TOKS.search(
            ANSI.sub("", raw.decode(errors="replace"))) is not None)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        read_pty(master, chunks, time.monotonic() + 10)
        os.close(master)
        status = proc.wait(10)
    finally:
        worker.terminate()
        worker.wait(30)
    raw = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    text = ANSI.sub("", raw)
    assert status == 0, raw[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert raw.count("Workers (1)") >= 4, text[-3000:]  # refreshed, several times
    assert TOKS.search(text), text[-3000:]  # a frame showed the worker generating, at a measured rate
    shown = screen(raw)  # drawn in place: what the terminal shows at the end is one frame
    rows = [line for line in shown if line.startswith("top-worker-1")]
    assert len(rows) == 1, shown
    row = rows[0].split()
    assert row[1:3] == [llama_ckpt.name, "cpu"], rows[0]  # model (served name), device
    assert re.search(r"[█░]{10}\s+\d+% \d+/128", rows[0]), rows[0]  # the KV bar, of 128 blocks
    assert any(re.match(r"llm:requests\s+\d+\s+llm:workers\s+\d+\s", line) for line in shown), "\n".join(shown)


def test_once_piped_shows_backlog_lag_and_dead_letters(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.xadd(NAMES.requests, {"json": json.dumps({"v": 1, "id": "nobody-reads-me"})})
        client.xadd(NAMES.dead, {"reason": "bad_json", "payload_json": b"{"})
        first = top("--redis", redis_url, "--once")
        client.xgroup_create(NAMES.requests, NAMES.group, id="0")
        client.xadd(NAMES.requests, {"json": json.dumps({"v": 1, "id": "second"})})
        client.xreadgroup(NAMES.group, "reader-1", {NAMES.requests: ">"}, count=1)  # read one, not acked
        second = top("--redis", redis_url)  # piped: one frame even without --once
    finally:
        client.close()
    for done in (first, second):
        assert done.returncode == 0, done.stderr
        assert "\x1b" not in done.stdout and done.stderr == "", done
        assert "dead letters: 1 (llm:dead)" in done.stdout and "no live worker" in done.stdout, done.stdout
    assert re.search(r"^llm:requests\s+1\s+no group yet\s", first.stdout, re.M), first.stdout  # backlog 1
    # backlog 2; the group: 1 consumer, 1 entry read but not acked, 1 not read yet
    assert re.search(r"^llm:requests\s+2\s+llm:workers\s+1\s+1\s+1\s*$", second.stdout, re.M), second.stdout


def test_a_slow_step_trace_shows_under_slow_steps(redis_url: str) -> None:
    at_ms = int(time.time() * 1000) - 5000
    trace = {"worker": "w-slow", "step": 4321, "at_ms": at_ms, "total_s": 0.4321, "threshold_s": 0.09,
             "p99_s": 0.03, "breakdown": {"schedule_s": 0.0012, "execute_s": 0.43, "process_s": 0.0009}, "steps": []}
    client = redis.Redis.from_url(redis_url)
    try:
        client.xadd(NAMES.traces, {"json": "not json"})  # skipped, not a crash
        client.xadd(NAMES.traces, {"json": json.dumps(trace, separators=(",", ":"))})
    finally:
        client.close()
    done = top("--redis", redis_url, "--once")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Slow steps"))
    hhmmss = time.strftime("%H:%M:%S", time.gmtime(at_ms / 1000))
    row = next(line for line in lines[start:] if "w-slow" in line)
    assert re.match(rf"{hhmmss} \(\d\.\ds ago\)\s+w-slow\s+4321\s+432\.1 ms\s+", row), row
    assert "schedule 1.2 ms, execute 430.0 ms, process 0.9 ms" in row, row


def test_redis_down_is_one_friendly_line() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    for args in (("--once",), ()):
        done = top("--redis", url, *args)
        assert done.returncode == 2, done
        assert "Traceback" not in done.stderr and done.stdout == "", done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"streamer top: error: cannot reach Redis at {url}"), lines


class CountingRedis(redis.Redis):
    """Counts pipelines: one per round trip of the gatherer."""

    pipelines = 0

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        self.pipelines += 1
        return super().pipeline(*args, **kwargs)


def test_tokens_per_s_from_successive_heartbeats_in_one_round_trip(redis_url: str) -> None:
    """A worker's stats hash as the heartbeat writes it, counter included; the gatherer reads a joining
    worker's hash in a second round trip, then everything in one, and never scans keys."""
    client = CountingRedis.from_url(redis_url)

    def beat(updated_ms: int, tokens: int) -> None:
        client.hset(NAMES.worker("w-fake"), mapping={"model": "/m/tiny", "served_model_name": "tiny",
                                                     "device": "cuda:0", "running": 3, "waiting": 1, "jobs": 4,
                                                     "kv_usage": 0.5, "kv_blocks_used": 64, "kv_blocks_total": 128,
                                                     "updated_ms": updated_ms, TOKENS_FIELD: tokens})
        client.zadd(NAMES.heartbeats, {"w-fake": updated_ms})

    try:
        client.config_resetstat()
        gather = Gatherer(client, NAMES, redis_url)
        beat(1_000_000, 100)
        snaps, trips = [gather.snapshot()], [client.pipelines]
        beat(1_002_000, 350)  # 250 tokens in 2 s
        for _ in range(2):  # the second sees the same beat again
            snaps.append(gather.snapshot())
            trips.append(client.pipelines)
        stats = client.info("commandstats")
    finally:
        client.close()
    assert trips == [2, 3, 4], trips  # a worker joins: 2 round trips; then 1 per refresh
    assert [s["workers"][0]["tokens_per_s"] for s in snaps] == [None, 125.0, 125.0]
    worker = snaps[1]["workers"][0]
    assert (worker["name"], worker["model"], worker["device"], worker["running"], worker["waiting"]) == \
        ("w-fake", "tiny", "cuda:0", 3, 1)
    assert not {"cmdstat_scan", "cmdstat_keys"} & set(stats), sorted(stats)


def _frame(snap: dict[str, Any]) -> str:
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(render(snap))
    return console.export_text()


def test_frame_from_a_plain_dict() -> None:
    snap = {"redis": "redis://h:1/0", "time_ms": 1_767_225_600_000, "dead": 0, "dead_stream": "llm:dead",
            "traces_stream": "llm:traces", "traces": [],
            "workers": [{"name": "w1", "model": "tiny", "device": "cuda:0", "running": 3, "waiting": 1, "jobs": 4,
                         "kv_usage": 0.5, "kv_blocks_used": 64, "kv_blocks_total": 128,
                         "updated_ms": 1_767_225_598_500, "tokens_per_s": 1234.56}],
            "streams": [{"name": "llm:requests", "length": 5,
                         "groups": [{"name": "llm:workers", "consumers": 2, "pending": 4, "lag": None}]}]}
    text = _frame(snap)
    assert "2026-01-01 00:00:00 UTC" in text and "dead letters: 0 (llm:dead)" in text, text
    assert re.search(r"^w1\s+tiny\s+cuda:0\s+3\s+1\s+4\s+█████░░░░░\s+50% 64/128\s+1234\.6\s+1\.5s ago", text, re.M)
    assert re.search(r"^llm:requests\s+5\s+llm:workers\s+2\s+4\s+-\s*$", text, re.M), text  # lag unknown
    assert re.search(r"^Slow steps.*\n.*\n.*\n\s*none", text, re.M), text
    lost = _frame({**snap, "workers": [], "error": "cannot reach Redis (gone): retrying"})
    assert "no live worker" in lost and "cannot reach Redis (gone): retrying" in lost, lost


def test_rates_start_over_when_a_worker_restarts() -> None:
    rates = Rates()
    assert rates.update("w", 1000, 10) is None  # one beat: no rate yet
    assert rates.update("w", 2000, 30) == 20.0
    assert rates.update("w", 2000, 30) == 20.0  # the same beat again
    assert rates.update("w", 3000, 5) is None  # counter went back: a new process
    assert rates.update("w", 3500, 15) == 20.0
    assert rates.update("x", 1000, None) is None  # a heartbeat without the counter
