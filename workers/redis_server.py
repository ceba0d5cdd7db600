"""Start and stop a private redis-server on a free port (used by `streamer up` and the tests)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.errors import RedisNotFound


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis-server on port {port} did not answer within {timeout}s")


def _parent_death_signal():
    """A preexec_fn asking the kernel for SIGTERM when our parent dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1

    def preexec() -> None:
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


@dataclass
class RedisServer:
    """A redis-server child process. `appendonly` keeps data across `restart()` (AOF on disk)."""

    port: int = 0
    appendonly: bool = False
    password: str | None = None
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="streamer-redis-")))
    proc: subprocess.Popen | None = None
    # In its own session the server does not get the terminal's Ctrl-C, so its owner (`streamer
    # up`) can stop it last, after the processes that use it.
    new_session: bool = False
    # Linux: the kernel stops the server when the process that started it dies, even by SIGKILL.
    # Only for a single-threaded owner (`streamer up` starts Redis first): it runs code between
    # fork and exec.
    die_with_parent: bool = False
    cluster: bool = False  # a node of a Redis Cluster (LocalCluster joins them)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisNotFound(
                "redis-server not found: install it (Debian/Ubuntu: `apt-get install redis-server`, "
                "macOS: `brew install redis`) or pass --redis URL of a running server"
            )
        self.port = self.port or free_port()
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.dir), "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always" if self.appendonly else "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            # The bus port is given: the default (port + 10000) does not exist for ports above 55535.
            # A 15 s node timeout: at 2 s a node starved of CPU by two busy workers on a 2-core
            # machine was marked failed, and with no replicas the whole cluster went down.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "15000", "--cluster-port", str(free_port())]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=self.new_session,
                                     preexec_fn=_parent_death_signal() if self.die_with_parent else None)
        try:
            _wait_ready(self.port, timeout) if not self.password else time.sleep(0.3)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def remove_data(self) -> None:
        """Delete the data directory (call after stop())."""
        shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self, down_for: float = 0.0) -> None:
        """Stop and start again on the same port; with AOF on, the data survives."""
        self.stop()
        time.sleep(down_for)
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LocalCluster:
    """A Redis Cluster of `masters` redis-server nodes on free loopback ports (no replicas), for
    tests and benchmarks: every node AOF-backed, slots spread by `redis-cli --cluster create`."""

    masters: int = 3
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Any node's URL: a cluster client discovers the others from it."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> LocalCluster:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RedisNotFound("redis-cli not found: it comes with redis-server (`apt-get install redis-server`)")
        self.nodes = [RedisServer(appendonly=True, cluster=True).start() for _ in range(self.masters)]
        try:
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
            self._wait_ok(cli, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, cli: str, timeout: float) -> None:
        """Until every node agrees the cluster is up (slots assigned and gossiped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [subprocess.run([cli, "-p", str(node.port), "cluster", "info"], capture_output=True,
                                     text=True).stdout for node in self.nodes]
            if all("cluster_state:ok" in state for state in states):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the local Redis Cluster was not ready within {timeout}s")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
            node.remove_data()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
