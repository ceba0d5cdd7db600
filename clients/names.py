"""Every Redis name of the protocol (docs/protocol.md), on a single Redis and on a Redis Cluster."""

from __future__ import annotations

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Names:
    """Every Redis name the protocol uses. Defaults derive from `prefix`; each can be overridden.

    On a Redis Cluster (`cluster=True`) names carry hash tags, so that what one script touches sits in
    one slot: the keys of one request share the tag `{id}` (`llm:events:{id}` with real braces, spread
    over the whole cluster), the shared keys the tag `{llm}` (`{llm}:requests`, `{llm}:heartbeats`).
    `shards` > 1 spreads the requests over that many streams (`request_streams`), each in a slot of
    its own on a cluster; a job goes to the stream `stream_for(id)` names."""

    prefix: str = "llm"
    requests: str = ""
    group: str = ""
    cancel: str = ""
    dead: str = ""
    traces: str = ""  # capped stream of slow-step traces, one JSON entry per slow step
    heartbeats: str = ""  # sorted set: member = consumer name, score = its last heartbeat (ms)
    cluster: bool = False
    shards: int = 1

    def __post_init__(self) -> None:
        shared = f"{{{self.prefix}}}" if self.cluster else self.prefix
        for name, base, suffix in (("requests", shared, "requests"), ("group", self.prefix, "workers"),
                                   ("cancel", self.prefix, "cancel"), ("dead", shared, "dead"),
                                   ("traces", shared, "traces"),
                                   ("heartbeats", shared, "heartbeats")):
            if not getattr(self, name):
                object.__setattr__(self, name, f"{base}:{suffix}")
        if self.shards < 1:
            raise ValueError("shards must be at least 1")

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
