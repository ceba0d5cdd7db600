"""Tensor parallelism across local devices, Megatron style, with ModelRunner's surface.

Rank 0 is the engine process: it keeps the one scheduler and block manager, and runs its own
shard of the model. Ranks 1..N-1 are processes this executor starts (`worker.py`). Each step,
rank 0 flattens the batch into plain integers (ModelRunner's `FlatStep`), broadcasts it on the
control group, and all ranks run the model on it; only rank 0 samples.

Failure handling: a rank that dies or raises makes rank 0's next (or current) collective fail
at once (its sockets close); the watchdog in RankProcesses records which rank and why and kills
the others; `execute` raises TensorParallelError with that story. No rank outlives the engine:
`shutdown()` stops and joins them, a finalizer kills them if the executor is dropped or the
interpreter exits, and each rank also exits when its parent process goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamer.config import EngineConfig
from streamer.distributed.comm import SETUP_TIMEOUT, abort_group, connect, shutdown_group
from streamer.distributed.rank_main import ready_key
from streamer.distributed.rank_procs import RankProcesses
from streamer.errors import TensorParallelError
from streamer.model_config import ModelConfig
from streamer.model_runner import ModelRunner
from streamer.request import Sequence
from streamer.sampler import Sampler, SamplerOutput
from streamer.scheduler_output import ScheduledSeq
from streamer.step import flatten_step, payload_tensor, unflatten_step

START_TIMEOUT_S = 300.0  # every rank must reach the rendezvous (imports, CUDA init) within this
STOP_TIMEOUT_S = 10.0


def check_divisible(model_config: ModelConfig, size: int) -> None:
    """Refuse before starting any process if the model cannot be split `size` ways."""
    hf = model_config.hf_config
    problems = []
    if hf.num_attention_heads % size:
        problems.append(f"{hf.num_attention_heads} attention heads")
    kv = model_config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads (they must divide, or be a multiple of, the parallel size)")
    if hf.intermediate_size % size:
        problems.append(f"intermediate size {hf.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {size} does not split this model: "
                         f"{'; '.join(problems)}")


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """One device per rank: CPU for all on CPU; on CUDA consecutive GPUs from the engine's."""
    if device.type == "cpu":
        return [device] * size
    if device.type != "cuda":
        raise ValueError(f"tensor parallelism runs on cpu or cuda, not {device.type}")
    first = device.index or 0
    available = torch.cuda.device_count()
    if first + size > available:
        raise ValueError(f"tensor_parallel_size {size} from cuda:{first} needs {first + size} GPUs; "
                         f"{available} visible")
    return [torch.device("cuda", first + r) for r in range(size)]


def _usable_cores() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def rank_environment(threads: int) -> dict[str, str]:
    """The ranks' environment: ours, their thread count, and this checkout's root on the path
    (the engine may have found `streamer` through a sys.path entry a new interpreter lacks)."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, OMP_NUM_THREADS=str(threads),
                PYTHONPATH=root if not path else os.pathsep.join([root, path]))


class TPExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 sampler: Sampler) -> None:
        self.size = size = config.tensor_parallel_size
        check_divisible(model_config, size)
        devices = rank_devices(device, size)
        self.device = devices[0]
        self._closed = False
        self._dead: str | None = None
        self._saved_threads = torch.get_num_threads()
        # CPU ranks share this machine's cores: give each its share, or they thrash.
        threads = max(1, _usable_cores() // size) if device.type == "cpu" else self._saved_threads
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=SETUP_TIMEOUT, wait_for_workers=False)
        env = rank_environment(threads)
        settings = json.dumps(dataclasses.asdict(config))

        def argv(rank: int) -> list[str]:
            return ["--rank", str(rank), "--size", str(size), "--port", str(store.port),
                    "--device", str(devices[rank]), "--threads", str(threads), "--config", settings,
                    "--parent-pid", str(os.getpid())]

        self.procs = RankProcesses(size, argv, env)
        self._finalizer = weakref.finalize(self, self.procs.kill_all)
        try:
            torch.set_num_threads(threads)
            self._wait_for_ranks(store)
            self.channel, self.group = connect(store, 0, size, self.device, timedelta(seconds=config.tp_timeout_s))
            if self.device.type == "cuda":  # (no reference to self: the watchdog outlives it)
                self.procs.on_failure = functools.partial(abort_group, self.group.pg)
            self.runner = ModelRunner(config, model_config, self.device, sampler, self.group)
        except BaseException as exc:
            failure = self.procs.wait_for_failure(1.0)
            self._stop_all()
            if failure is not None:
                raise TensorParallelError(f"tensor-parallel startup failed: {failure}") from exc
            raise
        self._store = store
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.backend = self.runner.backend

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return self.procs.pids

    def _wait_for_ranks(self, store: dist.TCPStore) -> None:
        """Wait until every rank has started and reached the store, watching for early deaths
        (a rank that fails to import would otherwise leave us waiting out a timeout)."""
        keys = [ready_key(r) for r in range(1, self.size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            if self.procs.failure is not None:
                raise TensorParallelError(self.procs.failure)
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], block_copies: list[tuple[int, int]] | None = None
                ) -> tuple[list[Sequence], SamplerOutput | None]:
        if self._dead is not None:
            raise TensorParallelError(self._dead)
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor was shut down")
        if self.procs.failure is not None:  # a rank died while the engine was idle
            raise self._fail(None)
        step = flatten_step(scheduled, block_copies, self.runner.block_size)
        try:
            payload = payload_tensor(step.payload)
            self.channel.send(step.header, payload)
            logits, pooled = self.runner.run(unflatten_step(step.header, payload.to(self.device, non_blocking=True)))
        except BaseException as exc:
            # The ranks may be inside this step's collectives: never run another step with them.
            error = self._fail(exc, wait_s=5.0 if isinstance(exc, Exception) else 0.0)
            if not isinstance(exc, Exception):  # KeyboardInterrupt and the like go on as they are
                raise
            raise error from exc
        # Sampling is rank 0's alone: an error there leaves the ranks in step, so it is not fatal.
        return self.runner.sample(step, logits, pooled)

    def _fail(self, exc: BaseException | None, wait_s: float = 5.0) -> TensorParallelError:
        """A step failed: find out which rank went (the watchdog may need a moment to see its
        exit), stop them all, stay dead."""
        failure = self.procs.wait_for_failure(wait_s)
        self._dead = failure or f"tensor-parallel step failed on rank 0: {exc!r}"
        self._stop_all()
        return TensorParallelError(self._dead)

    def shutdown(self) -> None:
        """Tell every rank to stop and join it; idempotent, and safe after a failure."""
        if self._closed:
            return
        if self._dead is None:
            self.procs.begin_close()
            with contextlib.suppress(Exception):  # a rank is gone: it is killed below
                self.channel.send_stop()
            self.procs.join(STOP_TIMEOUT_S)
        self._stop_all()

    def _stop_all(self) -> None:
        self._closed = True
        self.procs.begin_close()
        self.procs.kill_all()
        self._finalizer.detach()
        self._store = None
        for attr in ("channel", "group"):
            obj: Any = getattr(self, attr, None)
            if obj is not None:
                shutdown_group(obj.pg)
        torch.set_num_threads(self._saved_threads)

