"""`streamer generate "..."`: push one prompt through Redis and stream the answer to the terminal.

Needs a running worker (`streamer worker` or `streamer up`). Ctrl-C cancels the request.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from clients.redis_client import AsyncClient
from workers.errors import UserError
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
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for the next token (s)")
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
        request_id = await client.submit(**prompt, params=sampling_params(args))
        try:
            async for event in client.stream(request_id, timeout=args.timeout):
                if event["type"] == "error":
                    print(f"\nerror: {event.get('code')}: {event.get('message')}", file=sys.stderr)
                    return 1
                sys.stdout.write(event.get("text", ""))
                sys.stdout.flush()
                if event["type"] == "done":
                    usage = event.get("usage", {})
                    print(f"\n[{event.get('finish_reason')}; {usage.get('prompt_tokens')} prompt + "
                          f"{usage.get('completion_tokens')} generated tokens]", file=sys.stderr)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await client.cancel(request_id)
            raise
        except TimeoutError:
            with anyio.CancelScope(shield=True):
                await client.cancel(request_id)
            print(f"\nerror: no answer within {args.timeout}s: is a worker running?", file=sys.stderr)
            return 1
    return 0


def run(args: argparse.Namespace) -> int:
    args.cluster = check_redis(args.redis)
    try:
        return anyio.run(_generate, args, backend="asyncio")
    except KeyboardInterrupt:
        return 130
