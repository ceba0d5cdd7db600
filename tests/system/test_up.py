"""`streamer up` as a real process on CPU, with the real SmolLM2 model: the page loads, a
WebSocket prompt gets a sensible answer, and Ctrl-C leaves no process or port behind."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from streamer_kernels.cpu_features import fast_bfloat16

from workers.allocator import find_tcmalloc
from workers.redis_server import free_port

if TYPE_CHECKING:
    from conftest import DefaultModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def smollm2_cache(default_model: DefaultModel) -> Path:
    """A cache folder holding the converted default model (conftest's `default_model`: converted once
    per session, test_default_model uses the same folder)."""
    return default_model.cache


class Up:
    """`streamer up` in its own process group, as a shell runs a foreground job."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMER_")}
        full_env.update(env)
        self.proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "up", *args], cwd=ROOT,
                                     env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.output.append(line)
            match = re.search(pattern, line)
            if match:
                return match
        pytest.fail(f"no line matching {pattern!r} within {timeout}s; output:\n{self.text()}")

    def text(self) -> str:
        while not self.lines.empty():
            self.output.append(self.lines.get())
        return "".join(self.output)

    def ctrl_c(self, timeout: float = 60) -> int:
        os.killpg(self.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Cleanup after a failed test: Ctrl-C first, so that up stops its children itself."""
        if self.proc.poll() is None:
            try:
                self.ctrl_c(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


async def ask(port: int, messages: list[dict], max_tokens: int) -> list[dict]:
    import websockets

    events = []
    async with websockets.connect(f"ws://127.0.0.1:{port}/ws", origin=f"http://127.0.0.1:{port}",
                                  open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "generate", "messages": messages,
                                  "params": {"max_tokens": max_tokens, "temperature": 0}}))
        while True:
            import anyio

            with anyio.fail_after(60):
                event = json.loads(await ws.recv())
            if event.get("type") in ("token", "done", "error"):
                events.append(event)
            if event.get("type") in ("done", "error"):
                return events


def readme_block(after: str, lang: str) -> str:
    """The first ```lang block after the line starting with `after` in README.md."""
    text = (ROOT / "README.md").read_text()
    begin = text.index(f"```{lang}\n", text.index("\n" + after)) + len(f"```{lang}\n")
    return text[begin:text.index("```", begin)]


def check_readme_examples(redis_url: str) -> None:
    """The README's Python and redis-cli examples, as written with R set, answer the chat question
    with the real model (tests/system/test_examples.py runs every example on the tiny one)."""
    import redis

    env = {**os.environ, "R": redis_url, "PYTHONPATH": str(ROOT)}
    python = readme_block("**Python**", "python")
    out = subprocess.run([sys.executable, "-c", python], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "Paris" in out.stdout, out.stdout + out.stderr

    # The id and the XADD only: the block's later lines read the first events and cancel.
    lines = readme_block("**redis-cli**", "sh").splitlines()
    submit = "\n".join([*(line for line in lines if line.startswith("id=") or " XADD " in line), 'echo "$id"'])
    rid = subprocess.run(["bash", "-euo", "pipefail", "-c", submit], env=env, check=True, timeout=30,
                         capture_output=True, text=True).stdout.split()[-1]
    client = redis.Redis.from_url(redis_url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            events = [json.loads(f[b"json"]) for _, f in client.xrange(f"llm:events:{rid}")]
            if events and events[-1]["type"] == "done":
                break
            time.sleep(0.2)
        assert events and events[-1]["type"] == "done", events
        assert "Paris" in "".join(e["text"] for e in events), events
    finally:
        client.close()


def test_up_serves_the_real_model_and_ctrl_c_stops_everything(cpu_kernels: None, smollm2_cache: Path) -> None:
    import anyio

    port = free_port()
    # The KV-cache size reaches the worker through the environment: `up` passes STREAMER_* on.
    # No --device: the worker picks it, and `up` shows the one from its heartbeat.
    up = Up("--port", str(port),
            env={"STREAMER_CACHE": str(smollm2_cache), "STREAMER_KV_CACHE_MEMORY_GB": "0.25"})
    pids: list[int] = []
    try:
        redis_port = int(up.wait_for(r"redis://127\.0\.0\.1:(\d+)/0", 30).group(1))
        up.wait_for(r"Press Ctrl-C to stop", 240)
        out = up.text()
        for phase in ("redis", "model", "worker", "gateway"):
            assert re.search(rf"{phase} ready in \d+\.\ds", out), out
        # The CPU's default dtype: bfloat16 where it multiplies bfloat16 in hardware.
        dtype = "bfloat16" if fast_bfloat16() else "float32"
        assert re.search(rf"^      on cpu, {dtype}$", out, re.M), out
        assert f"chat page:  http://127.0.0.1:{port}/" in out
        pids = children_of(up.proc.pid)
        assert len(pids) == 3, (pids, out)  # redis-server, worker, gateway

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.status == 200 and "<title>streamer" in page.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as health:
            assert len(json.load(health)["workers"]) == 1
        # compose.yaml's gateway healthcheck, run against a real gateway.
        check = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["gateway"]["healthcheck"]
        code = check["test"][3].replace(":8000/", f":{port}/")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

        events = anyio.run(ask, port, [{"role": "user", "content": "What is the capital of France?"}], 16)
        assert [e["seq"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "done", events[-1]
        answer = "".join(e["text"] for e in events)
        assert "Paris" in answer, answer

        check_readme_examples(f"redis://127.0.0.1:{redis_port}/0")

        # `generate` with no --redis finds the running `up` (its Redis is on a port of its own), and says so.
        state = smollm2_cache / "up.json"
        assert json.loads(state.read_text())["redis"] == f"redis://127.0.0.1:{redis_port}/0"
        env = {k: v for k, v in os.environ.items() if k != "STREAMER_REDIS"}
        asked = subprocess.run([sys.executable, "-m", "workers.cli", "generate", "--chat", "Say hi.", "--max-tokens",
                                "4"], env={**env, "STREAMER_CACHE": str(smollm2_cache)}, cwd=ROOT,
                               capture_output=True, text=True, timeout=120)
        assert asked.returncode == 0, asked.stderr
        assert f"using the Redis of the running `streamer up` (pid {up.proc.pid}): redis://127.0.0.1:{redis_port}/0" \
            in asked.stderr

        assert up.ctrl_c() == 0, up.text()
        assert "stopped" in up.text()
        assert not state.exists()  # a later `generate` does not look for this one
        assert not [p for p in pids if alive(p)], up.text()
        assert not port_open(port) and not port_open(redis_port)
    finally:
        up.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_itself_never_imports_torch(cpu_kernels: None, llama_ckpt: Path) -> None:
    """torch (a second to import) loads only in the worker, which picks the device: `up` checking the
    model and waiting for its children must not pay for it before the worker even starts."""
    code = ("import sys; from workers.cli import main, up; from workers.default_model import resolve_model; "
            "resolve_model(sys.argv[1]); print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code, str(llama_ckpt)], capture_output=True, text=True,
                         cwd=ROOT, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_worker_failing_at_startup_stops_everything(cpu_kernels: None, llama_ckpt: Path) -> None:
    """A worker that cannot start (here: a context longer than the model allows) ends `up` with one
    clear line, and the private Redis it had started is gone."""
    up = Up("--port", "0", "--device", "cpu", "--model", str(llama_ckpt),
            env={"STREAMER_MAX_MODEL_LEN": "1000000"})
    try:
        redis_port = int(up.wait_for(r"redis://127\.0\.0\.1:(\d+)/0", 30).group(1))
        assert up.proc.wait(120) == 2
        out = up.text()
        assert "streamer up: error: the worker exited with status" in out, out
        assert not port_open(redis_port)
        assert not children_of(up.proc.pid)
    finally:
        up.kill()


def test_up_with_an_existing_redis_leaves_it_running(cpu_kernels: None, llama_ckpt: Path, redis_server,
                                                     redis_url: str) -> None:
    """--redis URL: no private server; a worker already on that Redis does not count as ours (up waits
    for a new heartbeat); Ctrl-C stops only what up started; --prefix reaches worker and gateway;
    --metrics-port reaches the worker, whose Prometheus page the banner names."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.hset("pre:worker:someone-else", mapping={"model": "x", "running": 0})  # another worker's heartbeat
    client.expire("pre:worker:someone-else", 600)
    seconds, _ = client.time()  # its beat, dated ahead so that it stays live for the whole test
    client.zadd("pre:heartbeats", {"someone-else": (seconds + 600) * 1000})
    port, metrics_port = free_port(), free_port()
    up = Up("--redis", redis_url, "--prefix", "pre", "--model", str(llama_ckpt), "--port", str(port),
            "--device", "cpu", "--metrics-port", str(metrics_port), env={})
    try:
        up.wait_for(r"Press Ctrl-C to stop", 120)
        assert "private" not in up.text()
        assert f"metrics:    http://127.0.0.1:{metrics_port}/metrics" in up.text()
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
            assert "vllm:num_requests_running{" in page.read().decode()
        heartbeats = {k.decode() for k in client.scan_iter(match="pre:worker:*")}
        assert len(heartbeats) == 2, heartbeats
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as health:
            assert len(json.load(health)["workers"]) == 2
        assert up.ctrl_c() == 0, up.text()
        assert client.ping() and not port_open(port)
        assert {k.decode() for k in client.scan_iter(match="pre:worker:*")} == {"pre:worker:someone-else"}
        assert client.zrange("pre:heartbeats", 0, -1) == [b"someone-else"]  # ours left the set at exit
    finally:
        up.kill()
        client.close()


def test_killing_up_takes_its_children_along(cpu_kernels: None, llama_ckpt: Path) -> None:
    """SIGKILL cannot be handled, yet no worker, gateway or redis-server outlives `up`."""
    port = free_port()
    up = Up("--port", str(port), "--device", "cpu", "--model", str(llama_ckpt), env={})
    pids: list[int] = []
    try:
        redis_port = int(up.wait_for(r"redis://127\.0\.0\.1:(\d+)/0", 30).group(1))
        up.wait_for(r"Press Ctrl-C to stop", 120)
        pids = children_of(up.proc.pid)
        assert len(pids) == 3
        if find_tcmalloc():  # the worker has re-executed itself to preload it (allocator.py)
            assert any("tcmalloc" in Path(f"/proc/{pid}/maps").read_text() for pid in pids)
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and [p for p in pids if alive(p)]:
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)]
        assert not port_open(port) and not port_open(redis_port)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
