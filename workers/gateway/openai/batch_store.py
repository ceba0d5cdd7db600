"""A batch's state in Redis (the Batch API, docs/openai.md), so that it survives any gateway and any
gateway can answer for it: routes (batches.py) create, read and cancel batches, the runner
(batch_runner.py) advances them, and `streamer top` shows them.

Per batch: `batch:{id}` (a hash: the fixed object as JSON, `status` and its timestamps, `next` = lines
pushed so far, the output files), `batch-lines:{id}` (the lines' jobs, in input order), `batch-out:{id}`
and `batch-err:{id}` (custom_id -> output line, written once each with HSETNX: whoever writes a line
first wins, so no restart can duplicate or change one), `batch-lease:{id}` (which gateway drives it).
Indexes: each tenant's batches by creation time, and the set of batches not finished.
"""

from __future__ import annotations

import json
import time
from typing import Any

from clients.protocol import Names
from workers.gateway.openai.file_store import NO_TENANT, keyed

WINDOW_S = 24 * 3600  # the one completion window OpenAI offers ("24h")
TERMINAL = ("completed", "failed", "cancelled", "expired")
# When each status began: OpenAI's object names these fields `{status}_at`.
_STAMPED = ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")

# KEYS[1] = the batch; ARGV[1] = new status, ARGV[2] = now (s), ARGV[3..] = the statuses it may leave.
# The status moves only from one it was in when the caller decided (a cancel and the runner's own
# step never overwrite each other).
_MOVE = """
local current = redis.call('HGET', KEYS[1], 'status')
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return 1
  end
end
return 0
"""
# KEYS[1] = lease; ARGV[1] = holder, ARGV[2] = ms. Take a free lease or renew our own.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def active_batches_key(names: Names) -> str:
    """The set of batches not finished yet (the runners' work list; `streamer top` shows them)."""
    return f"{names.shared}:batches:active"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BatchStore:
    def __init__(self, redis: Any, names: Names) -> None:
        self.redis, self.names = redis, names
        self._move = redis.register_script(_MOVE)
        self._lease = redis.register_script(_LEASE)

    def key(self, kind: str, batch_id: str) -> str:
        return keyed(self.names, kind, batch_id)

    def _index(self, tenant: str) -> str:
        return f"{self.names.shared}:batches:{tenant or NO_TENANT}"

    @property
    def active_key(self) -> str:
        return active_batches_key(self.names)

    # --- creating and reading ------------------------------------------------------------------------

    async def create(self, fixed: dict[str, Any], lines: list[str], status: str,
                     errors: dict[str, Any] | None = None) -> None:
        batch_id, now = fixed["id"], int(time.time())
        ttl_ms = (fixed["expires_at"] + WINDOW_S - now) * 1000  # kept one window past its end
        fields = {"obj": json.dumps(fixed), "status": status, "next": 0}
        if status == "failed":
            fields["failed_at"] = now
        if errors is not None:
            fields["errors"] = json.dumps(errors)
        async with self.redis.pipeline(transaction=not self.names.cluster) as pipe:
            pipe.hset(self.key("batch", batch_id), mapping=fields)
            pipe.pexpire(self.key("batch", batch_id), ttl_ms)
            if lines:
                pipe.rpush(self.key("batch-lines", batch_id), *lines)
                pipe.pexpire(self.key("batch-lines", batch_id), ttl_ms)
            pipe.zadd(self._index(fixed["tenant"]), {batch_id: fixed["created_at"]})
            if status not in TERMINAL:
                pipe.sadd(self.active_key, batch_id)
            await pipe.execute()

    async def state(self, batch_id: str) -> dict[str, str] | None:
        raw = await self.redis.hgetall(self.key("batch", batch_id))
        return {_text(k): _text(v) for k, v in raw.items()} if raw else None

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self.key("batch-out", batch_id))
            pipe.hlen(self.key("batch-err", batch_id))
            done, failed = await pipe.execute()
        return int(done), int(failed)

    async def public(self, batch_id: str) -> dict[str, Any] | None:
        """OpenAI's batch object, with its tenant beside it (`_tenant`, removed before it is shown)."""
        state = await self.state(batch_id)
        if state is None:
            return None
        fixed = json.loads(state["obj"])
        completed, failed = await self.counts(batch_id)
        obj = {"id": batch_id, "object": "batch", "endpoint": fixed["endpoint"],
               "errors": json.loads(state["errors"]) if "errors" in state else None,
               "input_file_id": fixed["input_file_id"], "completion_window": fixed["completion_window"],
               "status": state["status"], "output_file_id": state.get("output_file_id"),
               "error_file_id": state.get("error_file_id"), "created_at": fixed["created_at"],
               "expires_at": fixed["expires_at"],
               **{f"{s}_at": int(state[f"{s}_at"]) if f"{s}_at" in state else None for s in _STAMPED},
               "request_counts": {"total": fixed["total"], "completed": completed, "failed": failed},
               "metadata": fixed.get("metadata"), "_tenant": fixed["tenant"]}
        return obj

    async def list(self, tenant: str, after: str | None, limit: int) -> list[str]:
        """A tenant's batch ids, newest first, after the batch `after`; one more than `limit` when
        there are more."""
        ids = [_text(i) for i in await self.redis.zrange(self._index(tenant), 0, -1, desc=True)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        return ids[:limit + 1]

    async def lines(self, batch_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in await self.redis.lrange(self.key("batch-lines", batch_id), 0, -1)]

    # --- advancing -----------------------------------------------------------------------------------

    async def move(self, batch_id: str, to: str, *from_statuses: str) -> bool:
        return bool(await self._move(keys=[self.key("batch", batch_id)], args=[to, int(time.time()), *from_statuses]))

    async def set(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(self.key("batch", batch_id), mapping=fields)

    async def lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        return bool(await self._lease(keys=[self.key("batch-lease", batch_id)], args=[holder, ttl_ms]))

    async def active(self) -> list[str]:
        return sorted(_text(i) for i in await self.redis.smembers(self.active_key))

    async def finished(self, batch_id: str) -> None:
        """Out of the runner's set; its results kept as long as the batch object."""
        ttl_ms = await self.redis.pttl(self.key("batch", batch_id))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.srem(self.active_key, batch_id)
            for kind in ("batch-out", "batch-err", "batch-lines"):
                if ttl_ms and ttl_ms > 0:
                    pipe.pexpire(self.key(kind, batch_id), ttl_ms)
                else:  # the batch object expired (no gateway ran for its whole retention): nothing reads these
                    pipe.delete(self.key(kind, batch_id))
            pipe.delete(self.key("batch-lease", batch_id))
            await pipe.execute()

    async def record(self, batch_id: str, custom_id: str, line: dict[str, Any], failed: bool) -> bool:
        """A line's result, once: False when it was written already (by this or another gateway)."""
        kind = "batch-err" if failed else "batch-out"
        return bool(await self.redis.hsetnx(self.key(kind, batch_id), custom_id, json.dumps(line)))

    async def done_ids(self, batch_id: str) -> set[str]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hkeys(self.key("batch-out", batch_id))
            pipe.hkeys(self.key("batch-err", batch_id))
            out, err = await pipe.execute()
        return {_text(i) for i in [*out, *err]}

    async def results(self, batch_id: str) -> tuple[dict[str, str], dict[str, str]]:
        """(output lines, error lines) by custom_id, as written."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.key("batch-out", batch_id))
            pipe.hgetall(self.key("batch-err", batch_id))
            out, err = await pipe.execute()
        return ({_text(k): _text(v) for k, v in out.items()}, {_text(k): _text(v) for k, v in err.items()})
