"""Worker metrics (workers/worker/metrics.py, queue_metrics.py, docs/observability.md): a real
Prometheus server scraping a `streamer worker --metrics-port` process, then each metric against what
the test made a worker do, read from the worker's /metrics page with prometheus_client's parser:
tokens, requests by finish reason, the latency histograms, preemptions, prefix-cache hits, a dead
letter, a reclaim after its worker was killed, the queue's backlog, lag and pending exported by one
of two workers, Redis reconnects, and a taken --metrics-port refused before the model loads."""

import json
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections import Counter

import anyio
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from redis_worker_helpers import (
    NAMES,
    ROOT,
    check_complete,
    dead_letters,
    long_context_checkpoint,
    read_events,
    running_worker,
    tokens_of,
    wait_for,
    worker_process,
)

from clients.heartbeats import live_workers
from clients.redis_client import AsyncClient
from workers.redis_server import RedisServer, free_port

GREEDY = {"temperature": 0, "ignore_eos": True}
LOCAL = {"metrics_host": "127.0.0.1"}


def scrape(port: int) -> dict:
    """(sample name, labels) -> value, from a worker's /metrics page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float | None:
    """The sum of the samples called `name` whose labels include `labels`; None when there is none."""
    found = [v for (n, have), v in samples.items() if n == name and set(labels.items()) <= have]
    return sum(found) if found else None


def queue_of(samples: dict) -> tuple:
    stream = {"stream": NAMES.requests}
    return tuple(value(samples, f"streamer_queue_{k}", **stream) for k in ("backlog", "lag", "pending"))


def token_events(events: list[dict]) -> int:
    return sum(1 for e in events if e["type"] == "token")


def two_ports() -> tuple[int, int]:
    while (ports := (free_port(), free_port()))[0] == ports[1]:
        pass
    return ports


# --- a real Prometheus --------------------------------------------------------------------------


def prometheus_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())["data"]["result"]


def prometheus_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2) as reply:
            targets = json.loads(reply.read())["data"]["activeTargets"]
    except OSError:
        return False
    return bool(targets) and all(t["health"] == "up" for t in targets)


@pytest.mark.anyio
async def test_prometheus_scrapes_a_worker_process(llama_ckpt, redis_url, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "no prometheus server: `bash .ci/install` installs it (Debian: apt-get install prometheus)"
    metrics_port, prom_port = two_ports()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "worker", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}]}))
    worker = worker_process(llama_ckpt, redis_url, "--metrics-port", str(metrics_port), "--metrics-host",
                            "127.0.0.1", log_path=tmp_path / "worker.log")
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: prometheus_up(prom_port), timeout=60, interval=0.2)
        async with AsyncClient(redis_url) as client:
            answers = [await client.generate(prompt_token_ids=[5, 6, 7 + i], params={**GREEDY, "max_tokens": 5 + i})
                       for i in range(3)]
        generated = sum(len(a.token_ids[0]) for a in answers)

        def scalar(query: str) -> float | None:
            result = prometheus_query(prom_port, query)
            return float(result[0]["value"][1]) if result else None

        await wait_for(lambda: scalar("sum(vllm:generation_tokens_total)") == generated
                       and scalar("sum(vllm:time_to_first_token_seconds_count)") == 3, timeout=20, interval=0.25)
        [series] = prometheus_query(prom_port, "vllm:generation_tokens_total")
        assert series["metric"]["model_name"] == llama_ckpt.name  # the served model name, as vLLM labels it
        assert scalar('sum(vllm:request_success_total{finished_reason="length"})') == 3
    finally:
        for proc in (prom, worker):
            proc.kill()
            proc.wait()


# --- each metric against what the worker did ----------------------------------------------------


@pytest.mark.anyio
async def test_each_metric_counts_what_the_worker_did(llama_ckpt, redis_url):
    port = free_port()
    prefix = list(range(10, 58))  # 48 tokens: three full KV blocks of 16
    r = redis.Redis.from_url(redis_url)
    async with (running_worker(llama_ckpt, redis_url, engine={"num_kv_blocks": 16}, metrics_port=port, **LOCAL)
                as worker, AsyncClient(redis_url) as client):
        first = await client.generate(prompt_token_ids=[*prefix, 1], params={**GREEDY, "max_tokens": 4})
        before = scrape(port)
        second = await client.generate(prompt_token_ids=[*prefix, 2], params={**GREEDY, "max_tokens": 4})
        after = scrape(port)
        # Every token is a stop token: it stops at its first.
        stopped = await client.generate(prompt_token_ids=[3, 4], params={**GREEDY, "stop_token_ids": list(range(512))})
        cancelled = await client.submit(prompt_token_ids=[3, 4, 5, 6], params={**GREEDY, "max_tokens": 200})
        await wait_for(lambda: read_events(redis_url, cancelled), timeout=10, interval=0.01)
        await client.cancel(cancelled)
        await wait_for(lambda: read_events(redis_url, cancelled)[-1]["type"] == "done", timeout=10)
        # Four jobs that need 7 blocks each by their end, in a cache of 16: some are preempted.
        burst = [await client.submit(prompt_token_ids=[7 + i] * 8, params={**GREEDY, "max_tokens": 100})
                 for i in range(4)]
        await wait_for(lambda: all(read_events(redis_url, b)[-1:] and read_events(redis_url, b)[-1]["type"] == "done"
                                   for b in burst), timeout=60)
        r.xadd(NAMES.requests, {"json": "{not json"})
        await wait_for(lambda: dead_letters(redis_url), timeout=10)
        stats = worker.engine.stats()
        await wait_for(lambda: value(scrape(port), "vllm:iteration_tokens_total_count") == stats["num_steps"],
                       timeout=5)  # the step records are drained every 0.25 s
        samples = scrape(port)
        round_trips = worker.writer.round_trips
    r.close()

    assert value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total") == 48
    assert value(after, "vllm:prefix_cache_queries_total") - value(before, "vllm:prefix_cache_queries_total") == 49
    assert value(samples, "vllm:prefix_cache_hits_total") == stats["prefix_cache_hit_tokens"]
    assert value(samples, "vllm:num_preemptions_total") == stats["num_preemptions"] > 0

    ids = [first.id, second.id, stopped.id, cancelled, *burst]
    events = {rid: read_events(redis_url, rid) for rid in ids}
    prompts = {first.id: 49, second.id: 49, stopped.id: 2, cancelled: 4, **dict.fromkeys(burst, 8)}
    reasons = Counter(check_complete(ev)["finish_reason"] for ev in events.values())
    assert reasons == {"length": 6, "stop": 1, "abort": 1}
    labels = {"model_name": str(llama_ckpt), "engine": "0"}
    for reason in ("length", "stop", "abort", "error"):
        assert value(samples, "vllm:request_success_total", finished_reason=reason, **labels) == reasons[reason]
    assert value(samples, "vllm:generation_tokens_total", **labels) == sum(len(tokens_of(ev)) for ev in events.values())
    assert value(samples, "vllm:prompt_tokens_total") == sum(prompts.values())
    assert value(samples, "vllm:request_prompt_tokens_sum") == sum(prompts.values())
    # One inter-token gap per token event after a job's first.
    assert value(samples, "vllm:inter_token_latency_seconds_count") == sum(token_events(ev) - 1
                                                                           for ev in events.values())
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_inference_time_seconds"):
        assert value(samples, f"vllm:{histogram}_count") == len(ids), histogram
        assert value(samples, f"vllm:{histogram}_bucket", le="+Inf") == len(ids), histogram
    ttft = value(samples, "vllm:time_to_first_token_seconds_sum")
    assert 0 < ttft < value(samples, "vllm:e2e_request_latency_seconds_sum")
    assert value(samples, "vllm:num_requests_running") == value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:kv_cache_usage_perc") == 0

    [dead] = dead_letters(redis_url)
    reason = dead["reason"].decode()
    assert value(samples, "streamer_worker_dead_letters_total", reason=reason) == 1
    assert value(samples, "streamer_worker_dead_letters_total") == 1
    assert value(samples, "streamer_worker_event_write_seconds_count") == round_trips
    assert value(samples, "streamer_worker_reclaims_total") == 0
    assert value(samples, "streamer_worker_redis_reconnects_total") == 0


@pytest.mark.anyio
async def test_queue_metrics_come_from_one_worker(redis_url, tmp_path):
    ckpt = long_context_checkpoint(tmp_path / "ckpt")
    pa, pb = two_ports()
    engine = {"max_num_seqs": 1}  # one job each: a third waits in the stream, unread
    r = redis.Redis.from_url(redis_url)
    async with (running_worker(ckpt, redis_url, engine=engine, consumer="wa", metrics_port=pa, **LOCAL),
                running_worker(ckpt, redis_url, engine=engine, consumer="wb", metrics_port=pb, **LOCAL),
                AsyncClient(redis_url) as client):
        await wait_for(lambda: sorted(live_workers(r, NAMES)) == ["wa", "wb"], timeout=10)
        running = [await client.submit(prompt_token_ids=[5, 6, 7, i], params={**GREEDY, "max_tokens": 10_000})
                   for i in range(2)]
        await wait_for(lambda: all(read_events(redis_url, rid) for rid in running), timeout=20)
        waiting = await client.submit(prompt_token_ids=[9, 9, 9], params={**GREEDY, "max_tokens": 2})
        await wait_for(lambda: queue_of(scrape(pa)) == (3, 1, 2), timeout=10)
        a, b = scrape(pa), scrape(pb)
        # Only the first live worker by name exports the stream's gauges: summed over both, each job once.
        assert queue_of(b) == (None, None, None)
        assert value(a, "streamer_queue_exporter", worker="wa") == 1
        assert value(b, "streamer_queue_exporter", worker="wb") == 0
        for rid in running:
            await client.cancel(rid)
        await wait_for(lambda: read_events(redis_url, waiting)[-1:] and read_events(redis_url, waiting)[-1]["type"]
                       == "done", timeout=20)
        await wait_for(lambda: queue_of(scrape(pa)) == (0, 0, 0), timeout=10)
    r.close()


@pytest.mark.anyio
async def test_a_job_reclaimed_from_a_killed_worker_counts_there(llama_ckpt, redis_url, tmp_path):
    r = redis.Redis.from_url(redis_url)
    dead = worker_process(llama_ckpt, redis_url, "--consumer", "w-killed", log_path=tmp_path / "killed.log")
    try:
        await wait_for(lambda: live_workers(r, NAMES) == ["w-killed"], timeout=60, interval=0.1)
        async with AsyncClient(redis_url) as client:
            rid = await client.submit(prompt_token_ids=[5, 6, 7, 8], params={**GREEDY, "max_tokens": 900})
        await wait_for(lambda: len(read_events(redis_url, rid)) >= 3, timeout=30, interval=0.01)
    finally:
        dead.kill()
        dead.wait()
    before = read_events(redis_url, rid)
    assert before[-1]["type"] == "token", "the job ended before its worker was killed"
    port = free_port()
    async with running_worker(llama_ckpt, redis_url, claim_idle_s=1.0, metrics_port=port, **LOCAL) as worker:
        await wait_for(lambda: read_events(redis_url, rid)[-1]["type"] == "done", timeout=30)
        samples = scrape(port)
    r.close()
    events = read_events(redis_url, rid)
    assert check_complete(events)["finish_reason"] == "length" and len(tokens_of(events)) == 900
    assert value(samples, "streamer_worker_reclaims_total", worker=worker.cfg.consumer) == 1
    # Only what this worker generated; the first token and the time in the queue were the dead one's.
    assert value(samples, "vllm:generation_tokens_total") == 900 - len(tokens_of(before))
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 0
    assert value(samples, "vllm:request_queue_time_seconds_count") == 0
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="length") == 1


@pytest.mark.anyio
async def test_redis_reconnects_are_counted(llama_ckpt):
    with RedisServer() as server:
        port = free_port()
        # Beats (and queue polls) every second: an outage much shorter than that still counts, once.
        async with running_worker(llama_ckpt, server.url, heartbeat_s=1.0, metrics_port=port, **LOCAL):
            assert value(scrape(port), "streamer_worker_redis_reconnects_total") == 0
            await anyio.to_thread.run_sync(server.restart, 0.1)
            await wait_for(lambda: value(scrape(port), "streamer_worker_redis_reconnects_total") == 1, timeout=15,
                           interval=0.1)
            await anyio.sleep(1.5)
            assert value(scrape(port), "streamer_worker_redis_reconnects_total") == 1
            async with AsyncClient(server.url) as client:  # and it serves on
                answer = await client.generate(prompt_token_ids=[5, 6], params={**GREEDY, "max_tokens": 3})
            assert len(answer.token_ids[0]) == 3


def test_a_taken_metrics_port_is_refused_before_the_model_loads(llama_ckpt, redis_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "workers.cli", "worker", "--model", str(llama_ckpt), "--redis",
                              redis_url, "--metrics-host", "127.0.0.1", "--metrics-port", str(port)],
                             cwd=ROOT, capture_output=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"port {port} is already in use on 127.0.0.1".encode() in out.stderr
    assert b"--metrics-port" in out.stderr and b"Traceback" not in out.stderr


@pytest.mark.anyio
async def test_heartbeat_kv_usage_is_the_share_of_blocks_in_use(llama_ckpt, redis_url):
    """`kv_usage` in a worker's stats hash (and so /readyz) is blocks in use / blocks in the cache, what
    vLLM calls kv_cache_usage_perc; how full those blocks are is `kv_block_fill`."""
    async with running_worker(llama_ckpt, redis_url) as worker, AsyncClient(redis_url) as client:
        rid = await client.submit("Keep going for a while", params={**GREEDY, "max_tokens": 300})
        await wait_for(lambda: worker.engine.stats()["kv_blocks_used"] >= 2, timeout=30)
        stats = worker.stats()
        await client.cancel(rid)
    assert 0 < stats["kv_usage"] < 1
    assert stats["kv_usage"] == stats["kv_blocks_used"] / stats["kv_blocks_total"]
    assert 0 < stats["kv_block_fill"] <= 1 and stats["kv_block_fill"] != stats["kv_usage"]
