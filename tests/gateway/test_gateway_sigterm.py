"""A gateway SIGTERMed mid-answer, as in a rolling restart (issue 38 part 1): it closes its sockets with
1001 and ends its SSE streams with a `shutting_down` event, then exits 0; a new gateway comes up on the
same address, and clients carry on there. The JS client (clients/web/streamer-client.js, under Node)
reconnects and resumes by itself; a plain SSE reader resumes with `Last-Event-ID`. Every answer is the
uninterrupted greedy run's, with no event missed or seen twice."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from redis_worker_helpers import ROOT, offline_tokens, read_events, running_worker, wait_for
from test_gateway import node_command

from streamer import SamplingParams
from workers.redis_server import free_port

LONG = {"max_tokens": 160, "temperature": 0.0, "ignore_eos": True}
IDS = ["js-a", "js-b", "js-c"]

NODE_SCRIPT = """
import { StreamerClient } from %(client)s;
const client = new StreamerClient(process.argv[2], { maxBackoffMs: 500 });
const runs = %(ids)s.map(async (id) => {
  const seqs = [];
  const tokens = [];
  for await (const event of client.generate({ id, prompt: "count " + id, params: %(params)s })) {
    seqs.push(event.seq);
    if (event.type === "token") tokens.push(...event.token_ids);
  }
  console.log(JSON.stringify({ id, seqs, tokens }));
});
await Promise.all(runs);
client.close();
"""


def gateway(redis_url: str, port: int, log: Path) -> subprocess.Popen:
    args = [sys.executable, "-m", "workers.cli", "gateway", "--redis", redis_url, "--port", str(port),
            "--cancel-grace", "30"]
    with open(log, "ab") as out:
        return subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def ready(port: int) -> int | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code
    except httpx.HTTPError:
        return None


async def sigterm_and_replace(redis_url: str, port: int, old: subprocess.Popen, log: Path) -> subprocess.Popen:
    """SIGTERM the gateway; it must exit 0 within its close timeout. Its successor takes the address."""
    old.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = await asyncio.to_thread(old.wait, 30)
    assert code == 0, log.read_text()[-2000:]
    assert time.monotonic() - started < 20
    new = gateway(redis_url, port, log)
    await wait_for(lambda: ready(port) == 200, timeout=60, interval=0.2)
    return new


@pytest.mark.anyio
async def test_clients_carry_on_through_a_gateway_sigterm(llama_ckpt: Path, redis_url: str, tmp_path: Path) -> None:
    expected = offline_tokens(llama_ckpt, [f"count {i}" for i in IDS], SamplingParams(**LONG))
    port, log = free_port(), tmp_path / "gateway.log"
    script = tmp_path / "client.mjs"
    script.write_text(NODE_SCRIPT % {"client": json.dumps((ROOT / "clients/web/streamer-client.js").as_uri()),
                                     "ids": json.dumps(IDS), "params": json.dumps(LONG)})
    # A small engine budget: the answers take several seconds, so the SIGTERM lands mid-answer.
    async with running_worker(llama_ckpt, redis_url, engine={"max_num_seqs": 4}):
        proc = gateway(redis_url, port, log)
        node = None
        try:
            await wait_for(lambda: ready(port) == 200, timeout=60, interval=0.2)
            node = await asyncio.create_subprocess_exec(*node_command(), str(script), f"ws://127.0.0.1:{port}/ws",
                                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            sse = asyncio.create_task(asyncio.to_thread(sse_through_restart, port, str(llama_ckpt)))
            # Mid-answer for everyone: some tokens written, none finished.
            await wait_for(lambda: all(len(read_events(redis_url, i)) >= 5 for i in [*IDS, "sse-1"]),
                           timeout=60, interval=0.05)
            assert not any(read_events(redis_url, i)[-1]["type"] == "done" for i in [*IDS, "sse-1"])
            proc = await sigterm_and_replace(redis_url, port, proc, log)
            out, err = await asyncio.wait_for(node.communicate(), 120)
            assert node.returncode == 0, err.decode()
            sse_text, sse_ids, sse_resumes = await asyncio.wait_for(sse, 120)
        finally:
            if node is not None and node.returncode is None:
                node.kill()
            proc.kill()
            proc.wait()
    runs = {r["id"]: r for r in map(json.loads, out.decode().splitlines())}
    for i, rid in enumerate(IDS):
        assert runs[rid]["seqs"] == list(range(len(runs[rid]["seqs"]))), rid  # no gap, no duplicate
        assert runs[rid]["tokens"] == expected[i], rid
    stored = read_events(redis_url, "sse-1")
    assert sse_text == "".join(e["text"] for e in stored if e["type"] == "token")
    assert len(sse_ids) == len(set(sse_ids)) and sse_resumes >= 1, sse_ids  # resumed, nothing seen twice
    assert "stopping: open sockets are closed" in log.read_text()


def sse_through_restart(port: int, model: str) -> tuple[str, list[str], int]:
    """A plain line-by-line SSE reader of a streamed completion: on the `shutting_down` event it
    reconnects (to whatever gateway now answers on the address) with its Last-Event-ID. Returns the
    text, the event ids it saw and how many times it resumed."""
    # Longer than the JS client's answers: still running when they are all mid-answer.
    body = {"model": model, "prompt": "count sse", "max_tokens": 3 * LONG["max_tokens"], "temperature": 0,
            "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "sse-1", "X-Resumable-Stream": "true"}
    text, ids, resumes, last_id, ended = "", [], 0, None, False
    deadline = time.monotonic() + 120
    while not ended and time.monotonic() < deadline:
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                request = (http.stream("POST", "/v1/completions", json=body, headers=headers) if last_id is None else
                           http.stream("GET", "/v1/streams/sse-1", headers={"Last-Event-ID": last_id}))
                with request as resp:
                    assert resp.status_code == 200, resp.read()
                    for line in resp.iter_lines():
                        if line.startswith("id: "):
                            last_id = line[4:]
                            ids.append(last_id)
                        elif line == "data: [DONE]":
                            ended = True
                        elif line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            if "error" in chunk:
                                assert chunk["error"]["code"] == "shutting_down", chunk
                                resumes += 1
                                break
                            text += chunk["choices"][0]["text"]
        except httpx.HTTPError:
            time.sleep(0.3)  # the old gateway is gone and the new one not up yet
    assert ended, "the SSE stream never finished"
    return text, ids, resumes
