"""Every Redis name of the protocol (docs/protocol.md), on a single Redis and on a Redis Cluster."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass

# Rank of the default lane (`requests`) in the stream registry: after every priority lane.
DEFAULT_LANE_RANK = 2**31 + 1
# Jobs of at least this priority (the OpenAI Batch API's lines) wait in the batch lane, read only when
# every other lane is empty, so batch work uses only the capacity interactive traffic leaves.
BATCH_PRIORITY = 2**30
BATCH_LANE_RANK = DEFAULT_LANE_RANK + 1


@dataclass(frozen=True)
class Names:
    """Every Redis name the protocol uses. Defaults derive from `prefix`; each can be overridden.

    On a Redis Cluster (`cluster=True`) names carry hash tags, so that what one script touches sits in
    one slot: the keys of one request share the tag `{id}` (`llm:events:{id}` with real braces, spread
    over the whole cluster), the shared keys the tag `{llm}` (`{llm}:requests`, `{llm}:heartbeats`).
    `shards` > 1 spreads the requests over that many streams (`request_streams`), each in a slot of
    its own on a cluster; a job goes to the stream `stream_for(id)` names.

    `lanes` (ascending priority cutoffs, docs/scheduling.md) add urgent request streams: a job whose
    priority is at most a cutoff waits in that cutoff's lane, every other job in `requests`, where it
    always waited. Submitters register each stream they push to in `streams` (score = its lane's rank),
    so workers find lanes, tenants' queues and their order without being told."""

    prefix: str = "llm"
    requests: str = ""
    group: str = ""
    cancel: str = ""
    dead: str = ""
    traces: str = ""  # capped stream of slow-step traces, one JSON entry per slow step
    heartbeats: str = ""  # sorted set: member = consumer name, score = its last heartbeat (ms)
    cluster: bool = False
    shards: int = 1
    lanes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        shared = self.shared
        for name, base, suffix in (("requests", shared, "requests"), ("group", self.prefix, "workers"),
                                   ("cancel", self.prefix, "cancel"), ("dead", shared, "dead"),
                                   ("traces", shared, "traces"),
                                   ("heartbeats", shared, "heartbeats")):
            if not getattr(self, name):
                object.__setattr__(self, name, f"{base}:{suffix}")
        if self.shards < 1:
            raise ValueError("shards must be at least 1")
        if list(self.lanes) != sorted(set(self.lanes)) or any(c >= 0 for c in self.lanes):
            # Below 0: jobs of the default priority (0) keep waiting in `requests`.
            raise ValueError("priority lanes must be distinct negative cutoffs in ascending order")
        if self.lanes and self.shards > 1:
            raise ValueError("priority lanes need a single request stream (shards 1)")

    @property
    def shared(self) -> str:
        """Prefix of the keys every worker shares (hash-tagged into one slot on a cluster)."""
        return f"{{{self.prefix}}}" if self.cluster else self.prefix

    @property
    def handoff(self) -> str:
        """Pub/sub channel on which a draining worker says it handed jobs back (workers/worker/handoff.py):
        the other workers' reclaimers look at once instead of at their next period."""
        return f"{self.prefix}:handoff"

    @property
    def streams(self) -> str:
        """Sorted set of every request stream jobs were pushed to: member = stream, score = lane rank
        (the lane's priority cutoff; DEFAULT_LANE_RANK for `requests`). Lower ranks are read first."""
        return f"{self.shared}:streams"

    def lane_for(self, priority: int) -> tuple[str, int]:
        """(stream, rank) of the lane a job of this priority waits in."""
        if priority >= BATCH_PRIORITY and self.shards == 1:
            return self.lane(BATCH_LANE_RANK), BATCH_LANE_RANK
        for cutoff in self.lanes:
            if priority <= cutoff:
                return self.lane(cutoff), cutoff
        return self.requests, DEFAULT_LANE_RANK

    def lane(self, rank: int) -> str:
        """The lane of a registry rank, whatever lanes this Names was given: a cutoff's (negative) lane,
        the batch lane, or the default lane."""
        if rank == BATCH_LANE_RANK:
            return f"{self.requests}:batch"
        return f"{self.requests}:prio{rank}" if rank < 0 else self.requests

    @property
    def lane_cursor(self) -> str:
        """The last entry of the default lane whose priority the workers looked at (workers/worker/lanes.py:
        raw jobs that belong in a lane are moved there)."""
        return f"{self.requests}:sorted"

    @staticmethod
    def tenant_stream(lane: str, tenant: str) -> str:
        """A tenant's queue inside a lane (its jobs, in the order they came)."""
        return f"{lane}:t:{tenant}" if tenant else lane

    @property
    def tenants(self) -> str:
        """Hash tenant -> share (weight of its fair share), written by gateways from their keys file."""
        return f"{self.shared}:tenants"

    @property
    def service(self) -> str:
        """Hash tenant -> the service (tokens / share) its jobs were given, the fair-share clock."""
        return f"{self.shared}:tenants:service"

    def tenant_active(self, tenant: str) -> str:
        """Sorted set of a tenant's jobs not finished yet (member = id, score = expiry ms)."""
        return f"{self.shared}:tenant:{tenant}:active"

    def tenant_tokens(self, tenant: str) -> str:
        """Prefix of a tenant's tokens-per-minute counters."""
        return f"{self.shared}:tenant:{tenant}:tokens"

    def worker_requests(self, name: str) -> str:
        """A worker's own request stream: jobs routed to it (its cache or a session's KV is there)."""
        return f"{self.shared}:requests:w:{name}"

    @property
    def worker_streams(self) -> str:
        """Sorted set of workers that own a request stream (member = name, score = last beat ms)."""
        return f"{self.shared}:worker-streams"

    @property
    def loads(self) -> str:
        """Hash worker -> jobs it holds from the shared lanes (not its own stream), written by each worker
        several times a second (routing)."""
        return f"{self.shared}:loads"

    @property
    def loras(self) -> str:
        """Hash of the registered LoRA adapters: name -> JSON {"path": ...} (clients/loras.py)."""
        return f"{self.shared}:loras"

    def worker_prefixes(self, name: str) -> str:
        """Set of the prompt-prefix hashes a worker's cache holds (clients/routing.py), with a TTL."""
        return f"{self.worker(name)}:prefixes"

    def session(self, session: str) -> str:
        """The worker that last served a session (expires when the session goes quiet)."""
        digest = hashlib.blake2b(session.encode(), digest_size=12).hexdigest()
        return f"{self.shared}:session:{digest}"

    @property
    def request_streams(self) -> list[str]:
        """The streams jobs are pushed to: `requests` alone, or one per shard."""
        if self.shards == 1:
            return [self.requests]
        if self.cluster:  # a slot of its own per shard
            return [f"{{{self.prefix}.{i}}}:requests" for i in range(self.shards)]
        return [f"{self.requests}:{i}" for i in range(self.shards)]

    def stream_for(self, request_id: str) -> str:
        """The stream a job with this id is pushed to (the same for every client)."""
        streams = self.request_streams
        return streams[zlib.crc32(request_id.encode()) % len(streams)]

    def _of(self, kind: str, request_id: str) -> str:
        return f"{self.prefix}:{kind}:{{{request_id}}}" if self.cluster else f"{self.prefix}:{kind}:{request_id}"

    def events(self, request_id: str) -> str:
        """Stream holding every event of one request (replay for late or reconnecting readers)."""
        return self._of("events", request_id)

    def tokens(self, request_id: str) -> str:
        """Pub/sub channel carrying the same events live (a shard channel on a cluster)."""
        return self._of("tokens", request_id)

    def worker(self, name: str) -> str:
        return f"{{{self.prefix}}}:worker:{name}" if self.cluster else f"{self.prefix}:worker:{name}"

    def job(self, request_id: str) -> str:
        """Claim on a request id: holds the request-stream entry id that owns it (duplicate ids)."""
        return self._of("job", request_id)

    def fence(self, request_id: str) -> str:
        """Ownership epoch of a request: raised by every claim of its job (first read or takeover);
        event writes carrying an older epoch are refused, so a worker that lost the job cannot write."""
        return self._of("fence", request_id)

    def cancelled(self, request_id: str) -> str:
        """Marker set by clients on cancel, so a job cancelled before any worker read it is not run."""
        return self._of("cancelled", request_id)

    def progress(self, request_id: str) -> str:
        """How far a running job's prompt is (JSON, set by its worker every half second while the
        prompt is computed, expiring soon after): what "processing the prompt" displays show."""
        return self._of("progress", request_id)

    def openai_stream(self, request_id: str) -> str:
        """How the gateway formats an OpenAI-API request's stream (JSON), so any gateway can resume it."""
        return self._of("openai", request_id)

    def gateway_resumed(self, request_id: str) -> str:
        """When a gateway last resumed the request (ms): other gateways' grace cancels check it."""
        return self._of("gateway:resumed", request_id)

    def gateway_claim(self, request_id: str) -> str:
        """Set by a gateway when it pushes a job (duplicate ids refused before they reach a worker)."""
        return self._of("gateway:req", request_id)
