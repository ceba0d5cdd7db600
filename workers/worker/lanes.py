"""Priority lanes for jobs pushed without them (docs/scheduling.md): a job pushed with a plain
`XADD llm:requests` (redis-cli, any language) whose `priority` belongs in a more urgent lane is moved
there by the workers, so it overtakes the backlog as if its submitter had known the lanes.

The lanes are whatever the stream registry holds (submitters register the lanes they push to; a worker
started with `--priority-lanes` registers its own at start). Each worker's take script (streams.py)
first looks at the default lane's entries that arrived since the last look (a cursor shared by all
workers, so each entry is looked at once) and that no worker has read yet, and moves those whose
priority is at most a lane's cutoff into that lane: XADD there and XDEL here, in the one script, so
the job is in exactly one place at every moment. An entry some worker has already read is left alone.

The moved entry carries `moved_from` (the entry it was first pushed as): a submitter may have claimed
the request id for that entry (`Names.job`), and the claim passes to the moved one (intake.py).
Payloads are decoded in the script only when they contain the word `priority`, and at most
SORT_ENTRIES entries and SORT_BYTES of payloads are looked at per take, so the script stays short
however large the backlog and its jobs are (a burst larger than that is sorted over several takes).
"""

from __future__ import annotations

from typing import Any

from clients.names import Names
from clients.streams import StreamInfo

MOVED_FROM = "moved_from"  # the entry field naming the entry a moved job was first pushed as
SORT_ENTRIES = 1000  # most new entries looked at per take
SORT_BYTES = 2 << 20  # most payload bytes looked at per take (the first entry always is)

# A Lua function the take script calls before it reads (prepended to it in streams.py).
# sort_lane(lane, cursor, group, lanes): `lane` the default lane, `cursor` the key holding the last
# entry looked at, `lanes` {{cutoff, stream}...} most urgent first. Returns how many entries moved.
SORT_LUA = """
local function id_parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_before(a, b)
  local am, as = id_parts(a)
  local bm, bs = id_parts(b)
  return am < bm or (am == bm and as < bs)
end
local function delivered_upto(stream, group)
  local groups = redis.pcall('XINFO', 'GROUPS', stream)
  if type(groups) ~= 'table' or groups.err then return nil end
  for _, g in ipairs(groups) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then return info['last-delivered-id'] end
  end
  return nil
end
local function lane_of(fields, lanes)
  local encoding, payload
  for i = 1, #fields, 2 do
    if fields[i] == 'json' or fields[i] == 'msgpack' then encoding, payload = fields[i], fields[i + 1] end
  end
  if not payload then return nil, 0 end
  if not string.find(payload, 'priority', 1, true) then return nil, #payload end
  local decode = encoding == 'json' and cjson.decode or cmsgpack.unpack
  local ok, job = pcall(decode, payload)
  local p = ok and type(job) == 'table' and job['priority']
  if type(p) == 'number' then
    for _, lane in ipairs(lanes) do
      if p <= lane[1] then return lane[2], #payload end
    end
  end
  return nil, #payload
end
local function sort_lane(lane, cursor, group, lanes)
  if #lanes == 0 then return 0 end
  local start = delivered_upto(lane, group)
  if not start then return 0 end
  local seen = redis.call('GET', cursor)
  if seen and id_before(start, seen) then start = seen end
  local entries = redis.call('XRANGE', lane, '(' .. start, '+', 'COUNT', @ENTRIES@)
  local moved, bytes, last = 0, 0, nil
  for _, e in ipairs(entries) do
    if bytes > @BYTES@ then break end
    last = e[1]
    local fields = e[2]
    local target, size = lane_of(fields, lanes)
    bytes = bytes + size
    if target then
      local origin = false
      for i = 1, #fields, 2 do origin = origin or fields[i] == '@MOVED_FROM@' end
      if not origin then
        fields[#fields + 1] = '@MOVED_FROM@'
        fields[#fields + 1] = e[1]
      end
      redis.call('XADD', target, '*', unpack(fields))
      redis.call('XDEL', lane, e[1])
      moved = moved + 1
    end
  end
  if last then redis.call('SET', cursor, last) end
  return moved
end
""".replace("@ENTRIES@", str(SORT_ENTRIES)).replace("@BYTES@", str(SORT_BYTES)).replace("@MOVED_FROM@", MOVED_FROM)


def missing_lanes(names: Names, infos: list[StreamInfo]) -> dict[str, int]:
    """The lanes the registry knows a cutoff of (from a tenant's queue in it) without the lane itself:
    stream -> rank. A moved job goes to the lane, so it must be registered (and read) too."""
    present = {i.stream for i in infos}
    lanes = {names.lane(i.rank): i.rank for i in infos if i.rank < 0}
    return {stream: rank for stream, rank in lanes.items() if stream not in present}


def default_lane_index(names: Names, infos: list[StreamInfo]) -> int:
    """The 1-based index of the default lane in `infos` (0: not among them), which the take script
    sorts into the lanes before it (infos[1..index-1] of rank < 0 and no tenant)."""
    for k, info in enumerate(infos, 1):
        if info.stream == names.requests and not info.tenant:
            return k
    return 0


async def register_lanes(redis: Any, names: Names, lanes: dict[str, int]) -> None:
    """Add lanes to the stream registry (stream -> its cutoff), as a submitter pushing to them would;
    their consumer groups are created by the reader (StreamSet.ensure_groups)."""
    if lanes:
        await redis.zadd(names.streams, lanes, nx=True)


def moved_from(fields: Any) -> tuple[dict[Any, Any], str]:
    """An entry's fields without `moved_from`, and that field's value ('' when it was not moved)."""
    rest = dict(fields or {})
    origin = rest.pop(MOVED_FROM.encode(), None) or rest.pop(MOVED_FROM, None) or ""
    return rest, origin.decode(errors="replace") if isinstance(origin, bytes) else str(origin)
