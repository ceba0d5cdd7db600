"""Ctrl-C on `streamer up` while answers stream (issue 42): an OpenAI SSE stream and a /ws stream are
open mid-answer; both end at once (a final SSE event saying why, a 1001 close frame), `up` exits
within 2 s, and nothing it prints is a traceback. Real processes throughout: `up`, its redis-server,
worker and gateway, an HTTP client and a WebSocket client in threads."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
from redis_worker_helpers import long_context_checkpoint
from test_up import Up, children_of
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from workers.redis_server import free_port

LONG = {"max_tokens": 15_000, "ignore_eos": True, "temperature": 0}  # minutes of tokens: never done here
EXIT_WITHIN_S = 2.0


class Reader(threading.Thread):
    """One streaming client: `first` is set once a token arrived; `ended_at` when its stream ended."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.last = ""  # the SSE stream's last data line, or the close frame's code and reason

    def ended(self) -> None:
        self.ended_at = time.monotonic()


class SSEReader(Reader):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def run(self) -> None:
        body = {"model": "long", "prompt": "hello", "stream": True, **LONG}
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.last = line
                    self.first.set()
        self.ended()


class WSReader(Reader):
    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port

    def run(self) -> None:
        with connect(f"ws://127.0.0.1:{self.port}/ws", origin=f"http://127.0.0.1:{self.port}") as ws:
            ws.send(json.dumps({"type": "generate", "prompt": "hello", "params": LONG}))
            try:
                while True:
                    if json.loads(ws.recv(timeout=60)).get("type") == "token":
                        self.first.set()
            except ConnectionClosed as e:
                self.last = f"{e.rcvd.code if e.rcvd else None} {e.rcvd.reason if e.rcvd else ''}"
        self.ended()


def test_ctrl_c_with_open_streams_ends_them_at_once_and_exits_quietly(cpu_kernels: None, tmp_path: Path) -> None:
    ckpt = long_context_checkpoint(tmp_path / "long")  # served as "long", its directory's name
    port = free_port()
    up = Up("--port", str(port), "--device", "cpu", "--model", str(ckpt), "--dtype", "float32", env={})
    try:
        up.wait_for(r"Press Ctrl-C to stop", 180)
        readers = [SSEReader(port), WSReader(port)]
        for reader in readers:
            reader.start()
        for reader in readers:
            assert reader.first.wait(60), f"{type(reader).__name__}: no token within 60 s\n{up.text()}"
        pressed = time.monotonic()
        assert up.ctrl_c(timeout=30) == 0, up.text()
        took = time.monotonic() - pressed
        for reader in readers:
            reader.join(10)
        out = up.text()
        assert took <= EXIT_WITHIN_S, f"up took {took:.1f}s to exit\n{out}"
        assert "Traceback" not in out and "CancelledError" not in out and "ERROR" not in out, out
        sse, ws = readers
        # The SSE client is told why its stream ends (it may resume elsewhere), at once.
        assert sse.ended_at is not None and sse.ended_at - pressed < EXIT_WITHIN_S
        assert json.loads(sse.last.removeprefix("data: "))["error"]["code"] == "shutting_down", sse.last
        assert ws.ended_at is not None and ws.ended_at - pressed < EXIT_WITHIN_S
        assert ws.last == "1001 gateway shutting down", ws.last
        assert not children_of(up.proc.pid)
    finally:
        up.kill()
