"""The request streams one worker reads, and the order it takes jobs in (docs/scheduling.md).

Order: its own stream (jobs routed to it), then the lanes from the most urgent; inside a lane, the
queues of its tenants by fair share. The share is kept in Redis for all workers together (one
service clock per tenant, `Names.service`): the queue whose tenant has received the least service
per unit of share goes next (weighted fair queuing; a tenant back from idle starts near the others'
clock, not with credit saved up). A job is charged `CHARGE_TOKENS` when it is taken and the
difference to its real tokens when it ends (accounting.py), so shares hold in tokens, not jobs.
The whole choice is one script: workers taking at the same moment cannot both take the same turn.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from clients.names import BATCH_LANE_RANK, Names
from clients.streams import StreamInfo, registered_streams
from workers.worker.lanes import SORT_LUA, default_lane_index, missing_lanes, register_lanes

log = logging.getLogger("streamer.worker")

CHARGE_TOKENS = 256  # a job's charge when taken, before its real size is known
BURST_TOKENS = 4096  # most service a tenant back from idle is behind the others' clock
OWN_RANK = -(2**62)  # the worker's own stream is read before every lane
NO_TENANT = "~"  # the service field of jobs without a tenant (not a valid tenant name)
REFRESH_S = 1.0

# KEYS[1] = service clock hash, KEYS[2] = shares hash, KEYS[3] = the stream registry, KEYS[4] = the
# default lane's sorting cursor (lanes.py), KEYS[5..] = streams in reading order; ARGV[1] = group,
# ARGV[2] = consumer, ARGV[3] = most entries, ARGV[4] = charge, ARGV[5] = burst, ARGV[6] = how many
# streams the registry held when the caller read it, ARGV[7] = the default lane's place among the
# streams (0: none), ARGV[8] = most entries in all once the batch lane is reached (its lines take only
# the engine's free room), ARGV[9..] = each stream's lane rank and tenant field, in pairs. Streams of one
# rank form a lane, read only once every more urgent lane is empty; first, the default lane's unread
# jobs that belong in a more urgent lane are moved there (lanes.py). Returns false, taking nothing,
# when the registry changed since (a new lane or tenant: the caller reads it again first); else
# {{stream, entry id, fields, tenant, charge}..., then the streams that had no group (to create)}.
_TAKE = SORT_LUA + """
if redis.call('ZCARD', KEYS[3]) ~= tonumber(ARGV[6]) then
  return false
end
local svc_key, share_key = KEYS[1], KEYS[2]
local want, charge, burst = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local n = #KEYS - 4
local clock = tonumber(redis.call('HGET', svc_key, '~clock') or '0')
local out, missing = {}, {}
local function rank(k) return ARGV[7 + 2 * k] end
local function tenant(k) return ARGV[8 + 2 * k] end
local default_lane = tonumber(ARGV[7])
if default_lane > 0 then
  local lanes = {}
  for k = 2, default_lane - 1 do
    if tenant(k) == '~' then lanes[#lanes + 1] = {tonumber(rank(k)), KEYS[k + 4]} end
  end
  sort_lane(KEYS[default_lane + 4], KEYS[4], ARGV[1], lanes)
end
local function served(t)
  local s = tonumber(redis.call('HGET', svc_key, t) or '0')
  if s < clock - burst then s = clock - burst end
  return s
end
local i = 1
while i <= n and #out < want do
  local limit = want
  if tonumber(rank(i)) >= @BATCH_RANK@ then limit = math.min(want, tonumber(ARGV[8])) end
  local lane = {}
  local j = i
  while j <= n and rank(j) == rank(i) do
    lane[#lane + 1] = j
    j = j + 1
  end
  while #lane > 0 and #out < limit do
    local best, best_served = 1, served(tenant(lane[1]))
    for idx = 2, #lane do
      local s = served(tenant(lane[idx]))
      if s < best_served then best, best_served = idx, s end
    end
    local k = lane[best]
    local reply = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[k + 4], '>')
    if type(reply) == 'table' and reply.err then
      missing[#missing + 1] = KEYS[k + 4]
      table.remove(lane, best)
    elseif not reply then
      table.remove(lane, best)
    else
      local entry = reply[1][2][1]
      local t = tenant(k)
      local share = tonumber(redis.call('HGET', share_key, t) or '1')
      if share <= 0 then share = 1 end
      redis.call('HSET', svc_key, t, best_served + charge / share)
      if best_served > clock then
        clock = best_served
        redis.call('HSET', svc_key, '~clock', clock)
      end
      out[#out + 1] = {KEYS[k + 4], entry[1], entry[2], t, charge}
    end
  end
  i = j
end
out[#out + 1] = missing
return out
""".replace("@BATCH_RANK@", str(BATCH_LANE_RANK))


@dataclass(frozen=True)
class Taken:
    stream: str
    entry_id: Any
    fields: Any
    tenant: str = NO_TENANT  # the service field it was charged to
    charged: float = 0.0  # tokens charged when taken
    deliveries: int = 1


class StreamSet:
    """The streams this worker reads, refreshed from the registry at most every REFRESH_S."""

    def __init__(self, redis: Redis, names: Names, consumer: str) -> None:
        self.redis, self.names, self.consumer = redis, names, consumer
        self.own = names.worker_requests(consumer)
        self.shared: list[StreamInfo] = []
        self.registered = 0  # streams the registry held when last read
        self._grouped: set[str] = set()
        self._refreshed = float("-inf")
        self._take = redis.register_script(_TAKE)

    @property
    def ordered(self) -> list[StreamInfo]:
        """Own stream first, then the lanes, most urgent first."""
        return [StreamInfo(self.own, OWN_RANK, ""), *self.shared]

    @property
    def names_read(self) -> list[str]:
        return [i.stream for i in self.ordered]

    async def refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._refreshed < REFRESH_S:
            return
        self.shared, self.registered = await registered_streams(self.redis, self.names)
        lanes = missing_lanes(self.names, self.shared)
        if lanes:  # a lane known only by its tenants' queues: jobs moved into it must be read too
            await register_lanes(self.redis, self.names, lanes)
            self.shared, self.registered = await registered_streams(self.redis, self.names)
        await self.ensure_groups([s for s in self.names_read if s not in self._grouped])
        self._refreshed = time.monotonic()

    def forget_groups(self) -> None:
        """Redis lost groups (or all its data): create them again at the next refresh."""
        self._grouped.clear()
        self._refreshed = float("-inf")

    async def ensure_groups(self, streams: list[str]) -> None:
        for stream in streams:
            # From id 0: jobs pushed before the first worker ever started are served too.
            with contextlib.suppress(ResponseError):  # BUSYGROUP: it exists
                await self.redis.xgroup_create(stream, self.names.group, id="0", mkstream=True)
            self._grouped.add(stream)

    async def take(self, count: int, batch: int | None = None) -> list[Taken]:
        """Up to `count` new entries, in the order described above, batch lines only while fewer than
        `batch` (None: `count`) were taken (one round trip; two when the registry changed since it was
        read)."""
        await self.refresh()
        batch = count if batch is None else batch
        reply = await self._take_once(count, batch)
        if reply is None:
            await self.refresh(force=True)
            reply = await self._take_once(count, batch)
        if reply is None:  # changing as we look: the next take reads it again
            return []
        *entries, missing = reply
        if missing:  # ensure_groups makes them and counts them as grouped again
            await self.ensure_groups([_text(s) for s in missing])
        return [Taken(_text(stream), entry_id, _pairs(fields), _text(tenant), float(charged))
                for stream, entry_id, fields, tenant, charged in entries]

    async def _take_once(self, count: int, batch: int) -> list[Any] | None:
        infos = self.ordered
        args: list[Any] = [self.names.group, self.consumer, count, CHARGE_TOKENS, BURST_TOKENS, self.registered,
                           default_lane_index(self.names, infos), batch]
        for info in infos:
            args += [info.rank, info.tenant or NO_TENANT]
        keys = [self.names.service, self.names.tenants, self.names.streams, self.names.lane_cursor,
                *(i.stream for i in infos)]
        return await self._take(keys=keys, args=args)

    async def wait_any(self, block_ms: int, batch: bool = True) -> list[Taken]:
        """Block until some stream (a batch lane only with `batch`) has an entry; take one (not charged:
        correct at its end)."""
        streams = [i.stream for i in self.ordered if batch or i.rank < BATCH_LANE_RANK]
        reply = await self.redis.xreadgroup(self.names.group, self.consumer, dict.fromkeys(streams, ">"),
                                            count=1, block=block_ms)
        tenants = {i.stream: i.tenant or NO_TENANT for i in self.ordered}
        return [Taken(_text(stream), entry_id, fields, tenants.get(_text(stream), NO_TENANT))
                for stream, entries in reply or [] for entry_id, fields in entries]


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    pairs = iter(flat)  # Redis replies with whole field/value pairs
    return dict(zip(pairs, pairs))


def _text(value: bytes) -> str:
    return value.decode(errors="replace")  # the worker's Redis client never decodes replies
