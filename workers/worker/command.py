"""`streamer worker`: serve jobs from the Redis stream with the engine (redis_worker.py).

Every engine option (`EngineConfig` field) is a flag, built from the dataclass so none is missed.
SIGTERM or Ctrl-C: stop reading, finish in-flight jobs within --grace seconds, then exit; a second
signal exits at once (what is left is reclaimed by another worker).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import types
import typing
from pathlib import Path
from typing import Any

import anyio

from clients.protocol import Limits
from streamer import EngineConfig
from workers.allocator import CHOICES, exec_with_allocator
from workers.arg_types import optional_port, priority_lanes
from workers.errors import UserError
from workers.redis_options import add_pool_arguments, add_redis_arguments, check_redis, names_from_args
from workers.worker.config import WorkerConfig
from workers.worker.metrics_server import check_port
from workers.worker.tool_parsers import FAMILIES

# Short aliases for the options people type most.
_ALIASES = {"tensor_parallel_size": ["--tp"]}
# Help for the engine options (a new EngineConfig field still gets a flag, with a generic help).
_HELP = {
    "dtype": "float32, bfloat16 or float16 (default: the checkpoint's on GPU; on CPU bfloat16 where it has "
             "AVX-512 BF16 or AMX, else float32)",
    "device": "cpu, cuda or cuda:N (default: cuda when available)",
    "block_size": "tokens per KV-cache block",
    "num_kv_blocks": "KV-cache blocks (default: sized from free memory)",
    "max_num_seqs": "most sequences running at once",
    "max_num_batched_tokens": "most tokens computed in one step",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "attention_backend": "auto, cpu, torch or triton",
    "tensor_parallel_size": "GPUs to split the model over",
    "seed": "engine random seed",
    "max_model_len": "longest prompt + output (default: the checkpoint's)",
    "max_waiting_requests": "bound of the engine's waiting queue",
    "max_waiting_tokens": "bound of queued prompt tokens",
    "kv_cache_memory_gb": "CPU KV-cache size when --num-kv-blocks is not given",
    "gpu_memory_utilization": "share of GPU memory the engine may use",
    "cpu_gemm": "CPU linear layers: onednn (weights packed once) or torch (F.linear)",
    "quantization": "quantize every linear layer at load: int8 (weight-only, per channel) or fp8 (e4m3; "
                    "docs/quantization.md)",
    "kv_cache_dtype": "auto (the model's dtype) or fp8 (e4m3: half the bytes, twice the blocks)",
    "calculate_kv_scales": "fp8 KV cache: each layer's k/v scales from the first forward, as vLLM's (else 1.0)",
    "tp_timeout_s": "seconds a tensor-parallel collective waits for a stuck rank (bounds weight loading too)",
    "grammar_mask_budget_s": "structured outputs: CPU seconds one token mask may take; past it the request "
                             "fails (invalid_params)",
    "grammar_request_budget_s": "structured outputs: CPU seconds all of a request's token masks may take; past "
                                "it the request fails (invalid_params)",
    "grammar_compile_timeout_s": "structured outputs: seconds a spec may take to compile; past it the compile is "
                                 "stopped and the request refused (invalid_params)",
    "grammar_compile_workers": "structured outputs: compiles run at once, each in a process of its own",
    "enforce_eager": "never capture CUDA graphs for decode steps (the CPU never does)",
    "speculative_config": "speculative decoding, as JSON (vLLM's keys), e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}' (docs/speculative_decoding.md)",
    "max_loras": "LoRA adapters held on the device at once, least recently used evicted (0: serve none; "
                 "docs/lora.md)",
    "max_lora_rank": "the largest LoRA adapter rank served (a higher one is refused as invalid_request)",
    "pooling": "embeddings of requests that name no pooling: last or mean (default: the checkpoint's "
               "sentence-transformers config, else last; docs/openai.md#embeddings)",
}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _flag_type(tp: Any) -> tuple[Any, bool]:
    """(argparse type, is_bool) for a dataclass field annotation such as `int | None`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if tp is bool:
        return None, True
    if typing.get_origin(tp) is dict:
        return _json_object, False
    return (tp if tp in (int, float) else str), False


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--model` required)."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flags = [f"--{f.name.replace('_', '-')}", *_ALIASES.get(f.name, [])]
        if f.name == "model":
            group.add_argument(*flags, required=True, help="model checkpoint directory")
            continue
        kind, is_bool = _flag_type(hints[f.name])
        if is_bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default,
                               help=_HELP.get(f.name, f"engine option {f.name}"))
        else:
            group.add_argument(*flags, type=kind, default=f.default,
                               help=_HELP.get(f.name, f"engine option {f.name}"))


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = [f.name for f in dataclasses.fields(EngineConfig)]
    return EngineConfig.from_kwargs(**{name: getattr(args, name) for name in names})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    add_redis_arguments(parser)
    add_pool_arguments(parser)
    w = parser.add_argument_group("worker")
    w.add_argument("--group", default="", help="consumer group (default PREFIX:workers)")
    w.add_argument("--dead-stream", default="", help="dead-letter stream (default PREFIX:dead)")
    w.add_argument("--consumer", default="", help="consumer name, unique per process (default host-pid-rand)")
    w.add_argument("--events-ttl", type=float, default=3600.0, help="seconds a request's events are kept")
    w.add_argument("--claim-idle", type=float, default=30.0,
                   help="seconds after which a job of a silent (dead) worker is taken over")
    w.add_argument("--max-deliveries", type=int, default=5, help="deliveries before a job is dead-lettered")
    w.add_argument("--priority-lanes", type=priority_lanes, default=(),
                   help="cutoffs of priority lanes, e.g. -10,-1 (docs/scheduling.md): registered at start, so that a "
                        "job pushed to the default lane with a priority at most a cutoff is moved into its lane "
                        "(lanes submitters push to are honoured without it)")
    w.add_argument("--grace", "--drain-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds to finish in-flight jobs; what is left then goes back to the queue at once, "
                        "for another worker to resume")
    w.add_argument("--max-payload-bytes", type=int, default=Limits.max_payload_bytes,
                   help="largest accepted job payload")
    w.add_argument("--dead-payload-bytes", type=int, default=4096,
                   help="bytes of a job's payload kept in its dead letter (a longer one is cut and "
                        "cannot be requeued)")
    w.add_argument("--dead-max-age", type=float, default=7 * 24 * 3600.0,
                   help="seconds dead letters are kept (7 days)")
    w.add_argument("--dead-max-len", type=int, default=10_000, help="most dead letters kept (about)")
    w.add_argument("--consumer-idle", type=float, default=0.0,
                   help="seconds after which a consumer holding no job and not reading (a crashed "
                        "worker) is removed from the group (0: 20 x --claim-idle)")
    w.add_argument("--served-model-name", default=None,
                   help="the model's name in the OpenAI API (`model`, /v1/models); default: the checkpoint "
                        "directory's name")
    w.add_argument("--tool-call-parser", default="auto", choices=["auto", *FAMILIES, "none"],
                   help="how tool calls are read from outputs with tool_choice auto: hermes, llama3_json, none, "
                        "or auto (default): the family the chat template writes (none when it is unknown)")
    w.add_argument("--metrics-port", type=optional_port, default=0,
                   help="serve Prometheus metrics (vLLM's names, and the queue's) on this port at /metrics "
                        "(0: off)")
    w.add_argument("--metrics-host", default="0.0.0.0", help="address the --metrics-port server listens on")
    w.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    w.add_argument("--malloc", choices=CHOICES, default="tcmalloc",
                   help="memory allocator of the worker process: tcmalloc where installed (faster steps), or "
                        "system (glibc's)")


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    try:
        names = dataclasses.replace(names_from_args(args), lanes=args.priority_lanes)
    except ValueError as e:  # lanes with sharded streams
        raise UserError(f"{e}: leave out --priority-lanes or --request-shards") from None
    return WorkerConfig(redis_url=args.redis, redis_max_connections=args.redis_max_connections,
                        redis_pool_timeout_s=args.redis_pool_timeout, names=names,
                        limits=Limits(max_payload_bytes=args.max_payload_bytes), consumer=args.consumer,
                        events_ttl_s=args.events_ttl, claim_idle_s=args.claim_idle,
                        max_deliveries=args.max_deliveries, grace_s=args.grace, model_name=args.model,
                        served_model_name=args.served_model_name or Path(args.model).name,
                        dead_payload_bytes=args.dead_payload_bytes, dead_max_age_s=args.dead_max_age,
                        dead_max_len=args.dead_max_len, consumer_idle_s=args.consumer_idle,
                        metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                        tool_call_parser=args.tool_call_parser)


async def serve(args: argparse.Namespace) -> None:
    # The engine (torch) loads only when a worker really starts, not for `--help`.
    from streamer import AsyncEngine
    from workers.worker.redis_worker import Worker

    async with AsyncEngine(engine_config(args)) as engine:
        worker = Worker(engine, worker_config(args))
        async with anyio.create_task_group() as tg:

            async def on_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        if not worker.stopping:
                            logging.getLogger("streamer.worker").info("%s: finishing in-flight jobs",
                                                                      signal.Signals(signum).name)
                            worker.request_stop()
                        else:  # second signal: leave now, other workers take over
                            tg.cancel_scope.cancel()

            tg.start_soon(on_signals)
            await worker.run()
            tg.cancel_scope.cancel()


def _is_worker_program() -> bool:
    """Started as `streamer worker` / `python -m workers.cli worker`: the process is the
    worker's alone (and not, say, a test calling the CLI's `main`), so it may re-execute itself."""
    program = Path(sys.argv[0])
    return program.name == "streamer" or program.parts[-3:] == ("workers", "cli", "__main__.py")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if _is_worker_program():
        exec_with_allocator(args.malloc)
    args.cluster = check_redis(args.redis)
    if args.metrics_port:  # before the model loads: a taken port is then reported at once
        check_port(args.metrics_host, args.metrics_port)
    anyio.run(serve, args, backend="asyncio")
    return 0
