"""A tensor-parallel rank > 0: `python -m streamer.distributed.rank_main ...`, started by TPExecutor.

It loads its shard of the weights, allocates the KV cache of its heads, then runs the model on
every step rank 0 broadcasts until told to stop. It never schedules or samples. If anything
fails it writes the traceback to its error pipe and exits non-zero; if rank 0's process goes
away it exits too (its sockets close, and a thread also watches the parent pid).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from streamer.config import EngineConfig
from streamer.distributed.comm import SETUP_TIMEOUT, connect
from streamer.model_config import ModelConfig
from streamer.model_runner import ModelRunner
from streamer.step import unflatten_step


def _exit_with_parent(parent_pid: int) -> None:
    """Never outlive the engine process, even if it was killed before it could stop us."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def ready_key(rank: int) -> str:
    return f"rank{rank}/started"


def serve(args: argparse.Namespace) -> None:
    config = EngineConfig(**json.loads(args.config))
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", args.port, args.size, False, timeout=SETUP_TIMEOUT)
    store.set(ready_key(args.rank), "1")
    channel, group = connect(store, args.rank, args.size, device, timedelta(seconds=config.tp_timeout_s))
    model_config = ModelConfig.load(config.model, config.dtype, device, config.max_model_len)
    runner = ModelRunner(config, model_config, device, None, group)
    while (step := channel.recv()) is not None:
        header, payload = step
        runner.run(unflatten_step(header, payload.to(device, non_blocking=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--error-fd", type=int, required=True)
    args = parser.parse_args()
    # Ctrl-C reaches the whole foreground process group; the engine decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    try:
        serve(args)
    except BaseException:
        text = f"rank {args.rank} failed:\n{traceback.format_exc()}"
        try:
            os.write(args.error_fd, text.encode()[-16000:])
            sys.stderr.write(text)
            sys.stderr.flush()
        finally:
            os._exit(1)
    os._exit(0)  # skip interpreter teardown: nothing to flush, and NCCL/gloo teardown can hang


if __name__ == "__main__":
    main()
