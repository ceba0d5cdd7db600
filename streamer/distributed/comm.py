"""Process groups between tensor-parallel ranks, and the channel rank 0 sends each step on.

Two groups, built from one TCPStore without `init_process_group` (so an engine process can host
several engines, one after another or side by side):
- control (gloo, CPU): rank 0 broadcasts each step's batch. Ranks > 0 wait on it between steps,
  for as long as the engine stays idle, so its timeout is effectively infinite; a rank that dies
  is still noticed at once, because gloo fails pending operations when a peer's socket closes.
- model (NCCL on CUDA, gloo on CPU): the layers' all-reduces and the logits' all-gather.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from streamer.parallel_state import TPGroup
from streamer.step import HEADER_LEN, section_sizes

SETUP_TIMEOUT = timedelta(seconds=120)  # connecting the groups, once every rank has started
IDLE_TIMEOUT = timedelta(days=365)  # ranks > 0 waiting for the next step of an idle engine
_STEP, _STOP = 1, 0


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    # Loopback only: every rank is on this machine.
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta) -> object:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def connect(store: dist.Store, rank: int, size: int, device: torch.device, model_timeout: timedelta
            ) -> tuple[StepChannel, TPGroup]:
    """Build both groups (every rank calls this at the same point). `model_timeout`: how long a
    collective inside a step may wait for a rank that is alive but stuck (a dead rank fails it at
    once); weight loading of every rank also has to fit in it."""
    control = _gloo(dist.PrefixStore("control", store), rank, size, SETUP_TIMEOUT)
    control.set_timeout(IDLE_TIMEOUT)
    model_store = dist.PrefixStore("model", store)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        model = _nccl(model_store, rank, size, model_timeout)
    else:
        model = _gloo(model_store, rank, size, model_timeout)
    return StepChannel(control), TPGroup(rank, size, model)


def abort_group(pg: Any) -> None:
    """Make pending operations on `pg` fail now (NCCL waits on a dead peer until its timeout,
    where gloo fails as soon as the peer's sockets close)."""
    pg.abort()


def shutdown_group(pg: object) -> None:
    """Release a group's connections (NCCL communicators especially); best effort."""
    stop = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
    if stop is not None:
        with contextlib.suppress(Exception):  # already broken: nothing more to release
            stop()


class StepChannel:
    """Rank 0 -> all: a fixed-size header (kind + the step's sizes), then one flat int64 payload
    whose length the header gives. Two broadcasts per step, no pickling."""

    def __init__(self, pg: dist.ProcessGroupGloo) -> None:
        self.pg = pg
        self._header = torch.zeros(HEADER_LEN + 1, dtype=torch.long)

    def send(self, header: list[int], payload: torch.Tensor) -> None:
        self._header[0] = _STEP
        self._header[1:] = torch.tensor(header, dtype=torch.long)
        self.pg.broadcast(self._header, 0).wait()
        if payload.numel():
            self.pg.broadcast(payload, 0).wait()

    def send_stop(self) -> None:
        self._header.zero_()
        self._header[0] = _STOP
        self.pg.broadcast(self._header, 0).wait()

    def recv(self) -> tuple[list[int], torch.Tensor] | None:
        """The next step (header, CPU payload), or None when rank 0 says stop."""
        self.pg.broadcast(self._header, 0).wait()
        values = self._header.tolist()
        if values[0] == _STOP:
            return None
        header = values[1:]
        payload = torch.empty(sum(section_sizes(header)), dtype=torch.long)
        if payload.numel():
            self.pg.broadcast(payload, 0).wait()
        return header, payload

