"""Shared fixtures: tiny random checkpoints and a private redis-server per test session."""

import os
import signal
import time

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
