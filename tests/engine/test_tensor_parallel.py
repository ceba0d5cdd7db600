"""Tensor parallelism on CPU with real rank processes (gloo): greedy tokens equal one device's and
transformers', under preemption, prefix caching and copy-on-write; a rank that dies or fails
ends the engine with a clear error and leaves no process behind."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
from parity import hf_greedy
from redis_worker_helpers import NAMES, offline_tokens, tokens_of, wait_for, worker_process

from clients.redis_client import AsyncClient
from streamer import LLM, AsyncEngine, EngineConfig, SamplingParams
from streamer.distributed.rank_procs import RankProcesses
from streamer.errors import EngineDeadError, TensorParallelError
from streamer.random_checkpoint import TinyModelSpec, build_checkpoint

# Many short prompts that all grow: 12 blocks of 16 slots cannot hold them, so some are preempted.
PROMPT_LENGTHS = [1, 3, 14, 15, 15, 30, 40, 70]
MAX_TOKENS = [20, 16, 24, 14, 18, 16, 12, 10]
SHARED = 35  # later prompts start with the longest prompt's first 35 tokens



@pytest.fixture(scope="module")
def qwen2_odd_vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 (QKV bias, tied embeddings), one KV head (replicated on every rank), and a vocab
    of 510 that 4 ranks cannot split evenly (the last shard is padded)."""
    spec = TinyModelSpec(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=1, vocab_size=510)
    return build_checkpoint(tmp_path_factory.mktemp("qwen2_odd"), spec, seed=5)


def _is_rank(pid: str) -> bool:
    try:
        return b"streamer.distributed.rank_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def child_processes(parent: int | None = None) -> list[tuple[int, str]]:
    """(pid, state) of the tensor-parallel rank processes among the children of `parent`
    (default: this process) that are still running (zombies excluded). Other children, such as
    the session's redis-server, are not the engine's."""
    parent = os.getpid() if parent is None else parent
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent and stat[0] != "Z" and _is_rank(entry):
            found.append((int(entry), stat[0]))
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def two_rounds(ckpt: Path, tp: int, prompts: list[list[int]], **engine_kwargs):
    """Generate the prompts (the cache is small: preemption); then a prompt that samples n=2
    (forked: copy-on-write of the shared last block, which every rank must copy); then prompts
    sharing its prefix (prefix-cache hits)."""
    second = [prompts[-1][:SHARED] + p[:20] for p in prompts[:3]]
    with LLM(str(ckpt), dtype="float32", tensor_parallel_size=tp, block_size=16, **engine_kwargs) as llm:
        copies = count_block_copies(llm)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
        stats = llm.stats()
        params = SamplingParams(temperature=0, max_tokens=6)
        forked = llm.generate({"prompt_token_ids": second[0]}, SamplingParams(temperature=0, max_tokens=6, n=2))
        # Right after the first of them, the shared prefix is still in the cache.
        again = llm.generate([{"prompt_token_ids": p} for p in second[1:]], params)
    assert child_processes() == []  # clean shutdown joined every rank
    assert copies
    tokens = [[c.token_ids for c in o.outputs] for o in first + forked + again]
    return tokens, second, stats, sum(o.num_cached_tokens for o in again)


def count_block_copies(llm: LLM) -> list[tuple[int, int]]:
    """Record the block copies the engine hands its executor (the executor still does them)."""
    runner, seen = llm.engine.executor, []
    execute = runner.execute

    def recording(scheduled, block_copies=None):
        seen.extend(block_copies or [])
        return execute(scheduled, block_copies)

    runner.execute = recording
    return seen


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("ckpt_name", ["llama_ckpt", "qwen2_odd_vocab_ckpt"])
def test_greedy_tokens_match_one_device_and_transformers(request, ckpt_name, tp):
    ckpt = request.getfixturevalue(ckpt_name)
    vocab = 510 if "odd" in ckpt_name else 512
    rng = random.Random(7)
    # Skip the first ids: the specials (BOS/EOS) would end generation arbitrarily.
    prompts = [[rng.randrange(8, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    kwargs = dict(num_kv_blocks=12, max_num_batched_tokens=128)
    got, second, stats, cached = two_rounds(ckpt, tp, prompts, **kwargs)
    one, _, stats_one, cached_one = two_rounds(ckpt, 1, prompts, **kwargs)
    assert got == one
    assert stats["num_preemptions"] > 0 and stats["num_preemptions"] == stats_one["num_preemptions"]
    assert cached > 0 and cached == cached_one
    assert stats["kv_blocks_total"] == 12
    all_prompts = prompts + second
    budgets = MAX_TOKENS + [6] * len(second)
    reference = hf_greedy(ckpt, tuple(map(tuple, all_prompts)), tuple(budgets))
    assert [samples[0] for samples in got] == reference
    assert got[len(prompts)][0] == got[len(prompts)][1]  # both samples of the forked request


@pytest.mark.anyio
async def test_killed_rank_ends_the_engine_with_an_error_and_no_process_left(llama_ckpt):
    config = EngineConfig(model=str(llama_ckpt), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    engine = AsyncEngine(config)
    pids = engine.engine.executor.pids
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    seen = 0
    async with engine:
        with pytest.raises(EngineDeadError) as failed:
            async for out in engine.generate([11, 12, 13, 14], params, "victim"):
                seen += len(out.outputs[0].token_ids)
                if seen == 5:
                    killed_at = time.monotonic()
                    os.kill(pids[0], signal.SIGKILL)
        assert time.monotonic() - killed_at < 10
        assert seen < 400
        assert f"rank 1 (pid {pids[0]}) was killed by SIGKILL" in str(failed.value)
        with pytest.raises(EngineDeadError):  # stays dead
            async for _ in engine.generate([1, 2], params, "after"):
                pass
    assert child_processes() == []


def test_the_rank_that_died_is_blamed_not_its_peers(llama_ckpt):
    """At TP=4 a dead rank's peers fail too ("connection reset by peer"): the error names the
    rank that died."""
    llm = LLM(str(llama_ckpt), dtype="float32", tensor_parallel_size=4, num_kv_blocks=64)
    engine = llm.engine
    try:
        pids = engine.executor.pids
        for i in range(4):
            engine.add_request(f"r{i}", [10, 20, 30 + i] * 5,
                               SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        for _ in range(3):
            engine.step()
        threading.Timer(0.2, os.kill, (pids[1], signal.SIGKILL)).start()  # while steps run
        deadline = time.monotonic() + 30
        with pytest.raises(TensorParallelError) as failed:
            while engine.has_unfinished_requests() and time.monotonic() < deadline:
                engine.step()
        assert str(failed.value).startswith(f"tensor-parallel rank 2 (pid {pids[1]}) was killed by SIGKILL")
    finally:
        llm.shutdown()
    assert child_processes() == []


def test_engine_process_killed_takes_its_ranks_along(llama_ckpt, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(
        "import json, sys, time\n"
        "from streamer import LLM\n"
        f"llm = LLM({str(llama_ckpt)!r}, tensor_parallel_size=2, num_kv_blocks=32, dtype='float32')\n"
        "print(json.dumps(llm.engine.executor.pids), flush=True)\n"
        "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        started, _, _ = select.select([proc.stdout], [], [], 120)
        assert started, "the engine process did not start its ranks within 120 s"
        pids = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(p) for p in pids)


def test_rank_that_raises_reports_its_traceback():
    procs = RankProcesses(2, lambda rank: ["--rank", str(rank), "--size", "2", "--port", "1", "--device", "cpu",
                                           "--config", json.dumps({"no_such_option": 1}),
                                           "--parent-pid", str(os.getpid())], dict(os.environ))
    try:
        failure = procs.wait_for_failure(60)
    finally:
        procs.kill_all()
    assert failure is not None
    assert "rank 1" in failure and "exited with code 1" in failure
    assert "no_such_option" in failure  # the rank's own traceback
    assert child_processes() == []


def test_model_that_does_not_split_is_refused_before_any_process_starts(llama_ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split this model"):
        LLM(str(llama_ckpt), dtype="float32", tensor_parallel_size=3, num_kv_blocks=16)
    assert child_processes() == []


def test_step_after_failure_raises_at_once(llama_ckpt):
    """A rank that dies while the engine is idle: the next step fails fast, naming the rank."""
    llm = LLM(str(llama_ckpt), dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        pid = llm.engine.executor.pids[0]
        os.kill(pid, signal.SIGTERM)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=f"rank 1 \\(pid {pid}\\) was killed by SIGTERM"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert child_processes() == []


@pytest.mark.anyio
async def test_worker_cli_tp_flag_serves_jobs_and_stops_its_ranks(llama_ckpt, redis_url, tmp_path):
    """`streamer worker --tp 2`: the same tokens through Redis as one device offline; SIGTERM
    stops the worker cleanly and its rank with it."""
    log = tmp_path / "worker.log"
    proc = worker_process(llama_ckpt, redis_url, "--tp", "2", log_path=log)
    r = redis.Redis.from_url(redis_url)
    try:
        params = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        expected = offline_tokens(llama_ckpt, ["split over two ranks"], SamplingParams(**params))[0]
        await wait_for(lambda: len(r.keys(NAMES.worker("*"))) == 1 or proc.poll() is not None,
                       timeout=120, interval=0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        ranks = [pid for pid, _ in child_processes(proc.pid)]
        assert len(ranks) == 1
        async with AsyncClient(redis_url) as client:
            request_id = await client.submit("split over two ranks", params=params)
            events = [e async for e in client.stream(request_id, timeout=60)]
        assert tokens_of(events) == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        assert not any(running(pid) for pid in ranks)
    finally:
        r.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
