"""`streamer generate "..."`: push one prompt through Redis and stream the answer to the terminal.

Needs a running worker (`streamer worker` or `streamer up`). Ctrl-C cancels the request.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

import anyio

from clients.backoff import TRANSIENT
from clients.errors import NoWorker
from clients.redis_client import AsyncClient
from workers.arg_types import refresh_seconds
from workers.errors import UserError
from workers.progress_display import task
from workers.redis_options import add_redis_arguments, check_redis, names_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message, rendered with the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", dest="sample_seed", type=int, default=None, help="sampling seed of this request")
    parser.add_argument("--params", default="{}",
                        help='more sampling parameters as JSON, e.g. \'{"top_p":0.9}\'')
    parser.add_argument("--encoding", choices=("json", "msgpack"), default="json", help="wire encoding")
    parser.add_argument("--lora", default=None,
                        help="run under this registered LoRA adapter (`streamer lora add`; docs/lora.md)")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for the next token (s)")
    parser.add_argument("--status-interval", type=refresh_seconds, default=1.0,
                        help="seconds between refreshes of where the prompt waits (shown on a terminal until "
                             "the first token)")
    parser.add_argument("--wait", action="store_true",
                        help="queue the prompt even when no worker is alive, and wait for one (default: "
                             "say so within 2 s)")
    add_redis_arguments(parser)


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    try:
        extra = json.loads(args.params)
    except json.JSONDecodeError as e:
        raise UserError(f"--params is not valid JSON: {e}") from e
    if not isinstance(extra, dict):
        raise UserError("--params must be a JSON object")
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, **extra}
    if args.sample_seed is not None:
        params["seed"] = args.sample_seed
    return params


async def _generate(args: argparse.Namespace) -> int:
    chat = [{"role": "user", "content": args.prompt}]
    prompt = {"messages": chat} if args.chat else {"prompt": args.prompt}
    async with AsyncClient(args.redis, encoding=args.encoding, names=names_from_args(args)) as client:
        if not args.wait:
            await _require_worker(client)
        request_id = await client.submit(**prompt, params=sampling_params(args), lora=args.lora)
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_on_signal, stop, tg.cancel_scope)
            first = FirstEvent()
            tg.start_soon(_show_status, client, request_id, first, args.status_interval)
            try:
                return await _print_stream(client, request_id, args, stop, first)
            finally:
                tg.cancel_scope.cancel()
    return 0


async def _require_worker(client: AsyncClient, patience_s: float = 2.0) -> None:
    """Say at once that nobody will answer, instead of waiting silently (a worker that is starting
    has `patience_s` to show up)."""
    deadline = anyio.current_time() + patience_s
    while not await client.live_workers():
        if anyio.current_time() > deadline:
            raise UserError(client.no_worker_message("or pass --wait to queue the prompt until one starts"))
        await anyio.sleep(0.25)


async def _on_signal(stop: anyio.Event, scope: anyio.CancelScope) -> None:
    # Ctrl-C as a flag the loop checks, not only a cancellation: a cancel that lands inside a Redis read
    # can be swallowed there, and the answer would then go on streaming.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            scope.cancel()
            return


class FirstEvent:
    """Set when the request's first event arrives; the status display is gone once `cleared` is."""

    def __init__(self) -> None:
        self.arrived, self.cleared = anyio.Event(), anyio.Event()

    async def announce(self) -> None:
        if not self.arrived.is_set():
            self.arrived.set()
            await self.cleared.wait()


async def _show_status(client: AsyncClient, request_id: str, first: FirstEvent, every_s: float) -> None:
    """Until the first event, on a terminal: where the request is (its place in the queue, its
    prompt's progress on a worker), refreshed every `every_s` (clients/progress.py)."""
    try:
        with task("waiting for the answer", summary=False) as shown:
            while shown.drawn and not first.arrived.is_set():
                try:
                    status = await client.status(request_id)
                    shown.update(description=status.describe(), completed=status.computed or 0,
                                 total=status.total)
                except TRANSIENT:
                    pass  # only a display: the stream itself reports a lost Redis
                with anyio.move_on_after(every_s):
                    await first.arrived.wait()
            await first.arrived.wait()
    finally:
        first.cleared.set()  # the bar is erased: the answer may be printed


async def _print_stream(client: AsyncClient, request_id: str, args: argparse.Namespace, stop: anyio.Event,
                        first_event: FirstEvent) -> int:
    sent, first, tokens, text = time.monotonic(), None, 0, ""
    try:
        async for event in client.stream(request_id, timeout=args.timeout, wait_for_worker=args.wait):
            await first_event.announce()
            if stop.is_set():
                break
            if event["type"] == "error":
                print(f"\nerror: {event.get('code')}: {event.get('message')}", file=sys.stderr)
                return 1
            first = first or time.monotonic()
            tokens += len(event.get("token_ids", []))
            text = event.get("text", "") or text[-1:]  # only whether it ends a line matters
            sys.stdout.write(event.get("text", ""))
            sys.stdout.flush()
            if event["type"] == "done":
                # The answer ends its line on stdout itself: a pipe or a file gets a whole last line.
                if text and not text.endswith("\n"):
                    print(flush=True)
                print(_summary(event, sent, first, tokens), file=sys.stderr)
                return 0
    except anyio.get_cancelled_exc_class():
        if not stop.is_set():
            raise
    except NoWorker as e:
        with anyio.CancelScope(shield=True):
            await client.cancel(request_id)
        raise UserError(client.no_worker_message("the prompt was withdrawn; --wait waits for a worker")) from e
    except TimeoutError:
        with anyio.CancelScope(shield=True):
            await client.cancel(request_id)
        print(f"\nerror: no answer within {args.timeout}s: is a worker running?", file=sys.stderr)
        return 1
    with anyio.CancelScope(shield=True):  # interrupted (Ctrl-C)
        await client.cancel(request_id)
    print("\n[cancelled]", file=sys.stderr)
    return 130


def _summary(done: dict[str, Any], sent: float, first: float | None, tokens: int) -> str:
    usage = done.get("usage", {})
    line = (f"[{done.get('finish_reason')}; {usage.get('prompt_tokens')} prompt + "
            f"{usage.get('completion_tokens')} generated tokens")
    if first is not None:
        end = time.monotonic()
        rate = (tokens - 1) / (end - first) if tokens > 1 and end > first else 0.0
        line += f"; first token after {first - sent:.2f}s, {rate:.1f} tokens/s after it"
    return line + "]"


def run(args: argparse.Namespace) -> int:
    args.cluster = check_redis(args.redis)
    try:
        return anyio.run(_generate, args, backend="asyncio")
    except KeyboardInterrupt:
        return 130
