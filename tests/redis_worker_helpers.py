"""Helpers for the Redis worker tests: an in-process worker, subprocess workers, event checks."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import redis

from clients.protocol import Names, decode_event, seq_of_stream_id
from streamer import LLM, AsyncEngine, EngineConfig, SamplingParams
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint
from workers.worker.config import WorkerConfig
from workers.worker.redis_worker import Worker

ROOT = Path(__file__).resolve().parents[1]
NAMES = Names()
# float32: the answers are held against transformers in float32 (the CPU default may be bfloat16).
ENGINE = {"dtype": "float32", "num_kv_blocks": 128, "block_size": 16, "max_num_seqs": 32}


def long_context_checkpoint(directory: Path) -> Path:
    """Tiny Llama with a 16k context: room for a job that outlasts any timing in a test."""
    return build_checkpoint(directory, TinyModelSpec(arch="llama", max_position_embeddings=16384), seed=1)


def engine_config(ckpt: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(model=str(ckpt), **{**ENGINE, **overrides})


@asynccontextmanager
async def running_worker(ckpt: Path, redis_url: str, engine: dict | None = None,
                         **config: Any) -> AsyncIterator[Worker]:
    """A worker serving in this process (its own engine) until the block exits."""
    config.setdefault("heartbeat_s", 0.2)
    config.setdefault("claim_idle_s", 5.0)
    config.setdefault("grace_s", 5.0)
    async with AsyncEngine(engine_config(ckpt, **(engine or {}))) as eng:
        worker = Worker(eng, WorkerConfig(redis_url=redis_url, model_name=str(ckpt), **config))
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker.run)
            with anyio.fail_after(30):
                await worker.ready.wait()
            try:
                yield worker
            finally:
                worker.request_stop()


def worker_process(ckpt: Path, redis_url: str, *extra: str, log_path: Path | None = None,
                   program: tuple[str, ...] = ("-m", "workers.cli")) -> subprocess.Popen:
    """`streamer worker` as a real child process (`program`: what python runs instead of the CLI)."""
    args = [sys.executable, *program, "worker", "--model", str(ckpt), "--redis", redis_url,
            "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--dtype", ENGINE["dtype"], *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if log_path is None:
        return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    with open(log_path, "wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def kill_all(procs: dict[str, subprocess.Popen]) -> None:
    """The end of a test with worker processes: whichever still run are killed and reaped."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def offline_completions(ckpt: Path, prompts: list[Any], params: SamplingParams) -> list[tuple[list[int], str]]:
    """Sample-0 (tokens, text) of each prompt from the offline engine: what Redis must deliver."""
    llm = LLM(**{"model": str(ckpt), **ENGINE})
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in llm.generate(prompts, params)]


def offline_tokens(ckpt: Path, prompts: list[Any], params: SamplingParams) -> list[list[int]]:
    return [tokens for tokens, _ in offline_completions(ckpt, prompts, params)]


def text_of(events: list[dict[str, Any]], index: int = 0) -> str:
    return "".join(e["text"] for e in events if e["index"] == index)


def redis_now_ms(r: redis.Redis) -> int:
    """Redis's clock in ms: what heartbeats, entry ids and idle times are measured against."""
    seconds, micros = r.time()
    return seconds * 1000 + micros // 1000


def read_events(url: str, request_id: str, names: Names = NAMES) -> list[dict[str, Any]]:
    """Every stored event of a request, checking that stream ids and seq agree and are contiguous."""
    client = redis.Redis.from_url(url)
    try:
        entries = client.xrange(names.events(request_id))
    finally:
        client.close()
    events = [decode_event(fields) for _, fields in entries]
    seqs = [seq_of_stream_id(entry_id) for entry_id, _ in entries]
    assert seqs == list(range(len(entries))), f"{request_id}: stream ids {seqs}"
    assert [e["seq"] for e in events] == seqs, f"{request_id}: seq {[e['seq'] for e in events]}"
    return events


def tokens_of(events: list[dict[str, Any]], index: int = 0) -> list[int]:
    return [t for e in events if e["type"] == "token" and e["index"] == index for t in e["token_ids"]]


def check_complete(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Exactly one terminal event, and it is last; returns it."""
    terminal = [e for e in events if e["type"] in ("done", "error")]
    assert len(terminal) == 1 and events[-1] is terminal[0], [e["type"] for e in events]
    return terminal[0]


def has_ended(url: str, request_id: str, names: Names = NAMES) -> bool:
    """Whether the request's last stored event is `done` or `error`. Checks nothing: a condition to
    poll on (an assertion inside a polling loop fails when it reads before the end arrives)."""
    client = redis.Redis.from_url(url)
    try:
        last = client.xrevrange(names.events(request_id), count=1)
    finally:
        client.close()
    return bool(last) and decode_event(last[0][1])["type"] in ("done", "error")


def dead_letters(url: str, names: Names = NAMES) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        return [{k.decode(): v for k, v in fields.items()} for _, fields in client.xrange(names.dead)]
    finally:
        client.close()


async def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(interval)
