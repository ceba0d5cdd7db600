"""`streamer lora add NAME PATH | list | remove NAME`: the LoRA adapters every worker serves
(docs/lora.md). The registry is a Redis hash (clients/loras.py): adding or removing one needs no
worker restart; a worker reads an adapter's files when a job first names it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clients.loras import check_name, decode_entry, encode_entry
from workers.errors import UserError
from workers.redis_options import add_redis_arguments, check_redis, names_from_args, sync_client

ACTIONS = ("add", "list", "remove")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="add NAME PATH: register an adapter (a PEFT folder: adapter_config.json and "
                             "adapter_model.safetensors, at a path every worker can read); list: the "
                             "registered adapters; remove NAME: unregister one")
    parser.add_argument("name", nargs="?", default=None, help="the adapter's name (jobs' `lora` field, "
                                                               "OpenAI model `NAME` or `BASE:NAME`)")
    parser.add_argument("path", nargs="?", default=None, help="add: the adapter's folder")
    parser.add_argument("--no-check", action="store_true",
                        help="add: register the path without reading its adapter_config.json here (the "
                             "workers see another file system than this machine)")
    add_redis_arguments(parser)


def _check_folder(path: Path) -> str:
    config = path / "adapter_config.json"
    if not config.is_file():
        raise UserError(f"{path} is not a PEFT adapter folder (no adapter_config.json); pass the folder "
                        "that `save_pretrained` wrote, or --no-check if only the workers can read it")
    try:
        cfg = json.loads(config.read_text())
    except ValueError as e:
        raise UserError(f"{config}: not JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type {cfg.get('peft_type')!r} is not a LoRA adapter")
    return f"rank {cfg.get('r')}, targets {', '.join(sorted(cfg.get('target_modules') or []))}"


def run(args: argparse.Namespace) -> int:
    if args.action in ("add", "remove") and not args.name:
        raise UserError(f"`streamer lora {args.action}` needs the adapter's NAME")
    if args.action == "add" and not args.path:
        raise UserError("`streamer lora add NAME PATH` needs the adapter folder's PATH")
    if args.name:
        try:
            check_name(args.name)
        except ValueError as e:
            raise UserError(str(e)) from e
    args.cluster = check_redis(args.redis)
    names = names_from_args(args)
    client = sync_client(args.redis, cluster=args.cluster)
    try:
        if args.action == "add":
            path = Path(args.path).expanduser()
            what = "not checked" if args.no_check else _check_folder(path)
            path_text = args.path if args.no_check else str(path.resolve())
            replaced = client.hset(names.loras, args.name, encode_entry(path_text)) == 0
            print(f"{'replaced' if replaced else 'added'} {args.name} -> {path_text} ({what})")
        elif args.action == "remove":
            if not client.hdel(names.loras, args.name):
                raise UserError(f"no LoRA adapter named {args.name!r} is registered (see `streamer lora list`)")
            print(f"removed {args.name} (workers that loaded it keep serving jobs already running)")
        else:
            entries = [decode_entry(k, v) for k, v in client.hgetall(names.loras).items()]
            for entry in sorted((e for e in entries if e is not None), key=lambda e: e.name):
                print(f"{entry.name}\t{entry.path}")
    finally:
        client.close()
    return 0
