"""Shared fixtures: tiny random checkpoints, the default model converted once and a private redis-server
per test session."""

import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

# The Triton interpreter must be chosen before any @triton.jit function is defined, and only
# where there is no GPU to run the kernels for real.
if not os.environ.get("STREAMER_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

from streamer.random_checkpoint import TinyModelSpec, build_checkpoint
from workers.redis_server import RedisServer

# A suite started in the background of a non-interactive shell (`... &`) inherits SIGINT ignored, and an
# ignored signal stays ignored across exec: every `streamer up`/`top` the tests start would then ignore
# the Ctrl-C they send it, and the tests would time out. Python's own handler is reset on exec.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (`@pytest.mark.anyio`) run on asyncio, like the worker and the gateway."""
    return "asyncio"


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama with GQA (4 query heads, 2 KV heads)."""
    return build_checkpoint(tmp_path_factory.mktemp("llama"), TinyModelSpec(arch="llama"), seed=1)


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2: QKV bias and tied embeddings."""
    spec = TinyModelSpec(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=1)
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), spec, seed=2)


@dataclass
class DefaultModel:
    """The default model converted in this session: its cache folder (STREAMER_CACHE) and its folder in
    it, what the conversion reported through its `progress` callback, and everything it wrote to stdout
    and stderr (not a terminal)."""

    cache: Path
    path: Path
    steps: list[str]
    printed: str


@pytest.fixture(scope="session")
def default_model(tmp_path_factory: pytest.TempPathFactory) -> DefaultModel:
    """SmolLM2 converted once per session (about 30 s) into the session's cache folder, for every test
    that needs it (test_default_model, test_up): the one conversion is also the one whose progress
    and output test_default_model checks, rather than a second conversion of its own."""
    from workers.default_model import ensure_default_model

    cache = tmp_path_factory.getbasetemp() / "streamer-cache"
    steps: list[str] = []
    with _unset_env("STREAMER_PROGRESS"), _captured_output() as printed:
        path = ensure_default_model(progress=steps.append, cache=cache)
    return DefaultModel(cache, path, steps, "".join(printed))


@contextlib.contextmanager
def _unset_env(name: str) -> Iterator[None]:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


@contextlib.contextmanager
def _captured_output() -> Iterator[list[str]]:
    """stdout and stderr into one file, at both levels (file descriptors 1 and 2, as C code or a
    subprocess writes, and sys.stdout/sys.stderr, which pytest's capture replaces): what a session
    fixture cannot get from capfd. The list holds the text once the block has ended."""
    printed: list[str] = []
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as sink:
        saved_fds, saved_sys = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
        for stream in saved_sys:
            stream.flush()
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        sys.stdout = sys.stderr = sink
        try:
            yield printed
        finally:
            sink.flush()
            sys.stdout, sys.stderr = saved_sys
            for fd, saved in zip((1, 2), saved_fds, strict=True):
                os.dup2(saved, fd)
                os.close(saved)
            sink.seek(0)
            printed.append(sink.read())


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """The compiled CPU kernels, built in the test process before a test starts a worker process:
    in a fresh clone the worker would spend minutes compiling them past the test's start-up wait,
    and a worker killed mid-build used to leave the build locked."""
    from streamer_kernels.cpu_extension import load

    assert load() is not None


@pytest.fixture(scope="session")
def redis_server() -> RedisServer:
    """A real redis-server on a free port, for the whole test session."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server, flushed before each test so tests don't see each other's keys."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def one_node_cluster() -> RedisServer:
    """A Redis Cluster of one redis-server holding every slot, for the session: the clients' cluster
    paths (plain EVALSHA without a preload, one script per slot, acks apart, shard channels) run as on
    a real cluster, and the server refuses a command whose keys span slots (CROSSSLOT) as every node
    does, for the cost of one server (a 3-master LocalCluster takes seconds to form)."""
    import redis

    with RedisServer(cluster=True) as server:
        client = redis.Redis(port=server.port)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 30
        # A fresh master stays unwritable for about 2 s after it starts (Redis's rejoin delay).
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node Redis Cluster did not come up"
            time.sleep(0.05)
        client.close()
        yield server
    server.remove_data()


@pytest.fixture
def one_node_cluster_url(one_node_cluster: RedisServer) -> str:
    """That cluster flushed before each test, its scripts too: each test starts on a fresh node,
    which answers NOSCRIPT to a script's first EVALSHA."""
    import redis

    client = redis.Redis(port=one_node_cluster.port)
    client.flushall()
    client.script_flush()
    client.close()
    return one_node_cluster.url
