"""`streamer dead list|show|requeue|purge`: the dead letters, for operators (docs/protocol.md#dead-letters).

A dead letter is an entry of the stream PREFIX:dead that a worker wrote for a job it could not serve:
the reason, the request id when it could be read, and the first --dead-payload-bytes of the payload
(`payload_bytes` holds the whole size when some was cut). `requeue` pushes a whole payload back onto
the requests stream, exactly as it was, and removes the dead letter; a cut one cannot be requeued.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import time
from typing import Any

import redis

from clients.errors import ProtocolError
from clients.protocol import ENCODINGS, Limits, Names, decode_job, decode_payload
from clients.redis_client import KEY_TTL_MS, SUBMIT_SCRIPT
from clients.routing import lane_route
from workers.errors import UserError
from workers.redis_options import add_redis_arguments, check_redis, names_from_args, sync_client

ACTIONS = ("list", "show", "requeue", "purge")
_DEAD_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
# What requeue checks a payload against: the protocol's shape rules, not this machine's size limit
# (the worker that reads it applies its own --max-payload-bytes).
_CHECK_LIMITS = Limits(max_payload_bytes=1 << 62)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS,
                        help="list: the newest dead letters; show ID: one, whole; requeue ID: push its "
                             "payload back onto the requests stream; purge all|AGE: remove all, or those "
                             "older than AGE (e.g. 7d, 12h, 30m, 90s)")
    parser.add_argument("target", nargs="?", default=None,
                        help="the dead letter's id (show, requeue; from `list`), or all|AGE (purge)")
    parser.add_argument("--count", type=int, default=20, help="list: how many dead letters, newest first")
    add_redis_arguments(parser)
    parser.add_argument("--dead-stream", default="", help="dead-letter stream (default PREFIX:dead)")


def run(args: argparse.Namespace) -> int:
    if args.action in ("show", "requeue", "purge") and not args.target:
        what = "all or an age such as 7d" if args.action == "purge" else "a dead letter's id (see `streamer dead list`)"
        raise UserError(f"`streamer dead {args.action}` needs {what}")
    if args.action == "list" and args.target:
        raise UserError("`streamer dead list` takes no id: use `streamer dead show ID` for one dead letter")
    args.cluster = check_redis(args.redis)
    names = names_from_args(args)
    client = sync_client(args.redis, cluster=args.cluster)
    try:
        action = {"list": _list, "show": _show, "requeue": _requeue, "purge": _purge}[args.action]
        action(client, names, args)
    finally:
        client.close()
    return 0


# --- reading ----------------------------------------------------------------------------------

def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _fields(raw: dict[Any, Any]) -> dict[str, bytes]:
    return {_text(k): v if isinstance(v, bytes) else str(v).encode() for k, v in raw.items()}


def _payloads(fields: dict[str, bytes]) -> dict[str, bytes]:
    """The entry's fields as the dead letter kept them (payload_json -> json, ...)."""
    return {k[len("payload_"):]: v for k, v in fields.items() if k.startswith("payload_") and k != "payload_bytes"}


def _when(fields: dict[str, bytes], dead_id: str) -> str:
    try:
        ms = int(fields.get("time_ms") or dead_id.split("-", 1)[0])
    except ValueError:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000))


def _payload_summary(fields: dict[str, bytes]) -> str:
    kept = sum(len(v) for v in _payloads(fields).values())
    if "payload_bytes" in fields:
        return f"{kept} of {_text(fields['payload_bytes'])} B (cut)"
    return f"{kept} B"


def _get(client: redis.Redis, names: Names, dead_id: str) -> dict[str, bytes]:
    if not _DEAD_ID.match(dead_id):
        raise UserError(f"{dead_id!r} is not a dead letter id (ids look like 1712345678901-0; see "
                        "`streamer dead list`)")
    found = client.xrange(names.dead, min=dead_id, max=dead_id, count=1)
    if not found:
        raise UserError(f"no dead letter {dead_id} in {names.dead} (see `streamer dead list`)")
    return _fields(found[0][1])


def _list(client: redis.Redis, names: Names, args: argparse.Namespace) -> None:
    if args.count < 1:
        raise UserError("--count must be at least 1")
    entries = client.xrevrange(names.dead, count=args.count)
    total = client.xlen(names.dead)
    if not entries:
        print(f"no dead letters in {names.dead}")
        return
    rows = [("ID", "TIME (UTC)", "REASON", "REQUEST", "WORKER", "PAYLOAD")]
    for dead_id, raw in entries:
        fields, did = _fields(raw), _text(dead_id)
        rows.append((did, _when(fields, did), _text(fields.get("reason", b"?")), _text(fields.get("id", b"-")),
                     _text(fields.get("worker", b"-")), _payload_summary(fields)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    print(f"{len(entries)} newest of {total} dead letter(s) in {names.dead}; "
          "`streamer dead show ID` prints one whole")


def _show(client: redis.Redis, names: Names, args: argparse.Namespace) -> None:
    fields = _get(client, names, args.target)
    shown: dict[str, Any] = {}
    for key, value in fields.items():
        try:
            shown[key] = value.decode("utf-8")
        except UnicodeDecodeError:
            shown[key] = {"base64": base64.b64encode(value).decode()}
    out: dict[str, Any] = {"dead_letter": args.target, "fields": shown}
    payloads = _payloads(fields)
    if "payload_bytes" not in fields and len(payloads) == 1:
        encoding, raw = next(iter(payloads.items()))
        if encoding in ENCODINGS:
            try:
                out["payload"] = decode_payload(encoding, raw, _CHECK_LIMITS)
            except ProtocolError as e:
                out["payload_error"] = e.message
    print(json.dumps(out, indent=2, ensure_ascii=False, default=_text))


# --- changing ---------------------------------------------------------------------------------

def _requeue(client: redis.Redis, names: Names, args: argparse.Namespace) -> None:
    dead_id = args.target
    fields = _get(client, names, dead_id)
    payloads = _payloads(fields)
    if "payload_bytes" in fields:
        kept = sum(len(v) for v in payloads.values())
        raise UserError(f"dead letter {dead_id} kept only {kept} of its {_text(fields['payload_bytes'])} "
                        "payload bytes (the worker's --dead-payload-bytes): it cannot be requeued")
    if len(payloads) != 1 or next(iter(payloads)) not in ENCODINGS:
        raise UserError(f"dead letter {dead_id} has no single json or msgpack payload "
                        f"(fields: {', '.join(sorted(payloads)) or 'none'}): requeued, it would only be "
                        "refused again")
    encoding, raw = next(iter(payloads.items()))
    try:
        job = decode_job({encoding: raw}, _CHECK_LIMITS)
    except ProtocolError as e:
        raise UserError(f"dead letter {dead_id}: its payload still fails the protocol checks ({e.code}: "
                        f"{e.message}); requeued, it would only be refused again") from e
    in_use = [key for key in (names.job(job.id), names.events(job.id)) if client.exists(key)]
    if in_use:
        ttl_s = max(0, max(client.pttl(key) for key in in_use)) / 1000
        raise UserError(f"request id {job.id!r} is still in use ({', '.join(in_use)}; they expire in "
                        f"{ttl_s:.0f}s): a copy pushed now would be refused as duplicate_id; requeue it "
                        "once they are gone")
    # Back into its lane (and tenant's queue), as a submitter would push it.
    route = lane_route(names, {"id": job.id, "priority": job.priority, "tenant": job.tenant})
    stream = route.stream
    if names.cluster:  # the stream, the id's key and the dead letters sit in different slots
        entry = client.xadd(stream, {encoding: raw})
        client.set(names.job(job.id), entry, nx=True, px=KEY_TTL_MS)
        client.xdel(names.dead, dead_id)
    else:
        submit = client.register_script(SUBMIT_SCRIPT)
        with client.pipeline(transaction=True) as pipe:  # pushed and removed from the dead letters together
            submit(keys=[stream, names.job(job.id), names.streams],
                   args=[encoding, raw, KEY_TTL_MS, "" if route.rank is None else route.rank, names.group],
                   client=pipe)
            pipe.xdel(names.dead, dead_id)
            (entry, _ordinal), _ = pipe.execute()
    print(f"requeued dead letter {dead_id} (request {job.id}) as entry {_text(entry)} of {stream}")


def parse_age(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s`, `2w` or plain seconds -> seconds."""
    m = _AGE.match(text.strip().lower())
    if m is None:
        raise UserError(f"purge takes `all` or an age such as 7d, 12h, 30m or 90s, not {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _purge(client: redis.Redis, names: Names, args: argparse.Namespace) -> None:
    before = client.xlen(names.dead)
    if args.target == "all":
        client.delete(names.dead)
        print(f"removed {before} dead letter(s) from {names.dead}")
        return
    age_ms = int(parse_age(args.target) * 1000)
    seconds, micros = client.time()  # dead letter ids carry the Redis server's clock
    min_id = f"{max(0, seconds * 1000 + micros // 1000 - age_ms)}-0"
    removed = client.xtrim(names.dead, minid=min_id, approximate=False)
    print(f"removed {removed} dead letter(s) older than {args.target} from {names.dead}; "
          f"{before - removed} left")
