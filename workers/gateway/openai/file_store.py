"""Where the Batch API's files live (`/v1/files`, docs/openai.md): one class, so a directory or an
S3-compatible store can take Redis's place later without the routes or the batch runner changing.

In Redis each file is one hash (`{prefix}:file:{id}`: its metadata as JSON and its bytes) with the
expiry its batch window implies, and each tenant has an index of its files (a sorted set by creation
time) that listing cleans of files that expired.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from clients.protocol import Names


def keyed(names: Names, kind: str, object_id: str) -> str:
    """`{prefix}:{kind}:{id}`; on a cluster the id is the hash tag, so one object's keys share a slot."""
    return f"{names.prefix}:{kind}:{{{object_id}}}" if names.cluster else f"{names.prefix}:{kind}:{object_id}"


NO_TENANT = "~"  # index name of files uploaded without a tenant (not a valid tenant name)


@dataclass
class StoredFile:
    """OpenAI's file object, plus the tenant that owns it (never shown)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None
    tenant: str = ""

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "expires_at": self.expires_at,
                "status": "processed", "status_details": None}


class RedisFileStore:
    """Files as Redis hashes with a TTL. Every method is one round trip or a small pipeline."""

    def __init__(self, redis: Any, names: Names) -> None:
        self.redis, self.names = redis, names

    def _key(self, file_id: str) -> str:
        return keyed(self.names, "file", file_id)

    def _index(self, tenant: str) -> str:
        return f"{self.names.shared}:files:{tenant or NO_TENANT}"

    async def put(self, meta: StoredFile, content: bytes, *, only_new: bool = False) -> bool:
        """Store a file until its `expires_at`. `only_new`: keep a file already stored under this id
        (a batch's output written again after a restart stays the first one). False when it was kept."""
        key = self._key(meta.id)
        if only_new and await self.redis.exists(key):
            return False
        ttl_ms = max(1000, int((meta.expires_at or time.time() + 86400) * 1000 - time.time() * 1000))
        async with self.redis.pipeline(transaction=not self.names.cluster) as pipe:
            pipe.hset(key, mapping={"meta": json.dumps(asdict(meta)), "content": content})
            pipe.pexpire(key, ttl_ms)
            pipe.zadd(self._index(meta.tenant), {meta.id: meta.created_at})
            await pipe.execute()
        return True

    async def meta(self, file_id: str) -> StoredFile | None:
        text = await self.redis.hget(self._key(file_id), "meta")
        return None if text is None else StoredFile(**json.loads(text))

    async def content(self, file_id: str) -> bytes | None:
        return await self.redis.hget(self._key(file_id), "content")

    async def extend(self, file_id: str, until: int) -> None:
        """Keep a file at least until `until` (epoch seconds): a batch still reading its input."""
        meta = await self.meta(file_id)
        if meta is None or (meta.expires_at or 0) >= until:
            return
        meta.expires_at = until
        key = self._key(file_id)
        await self.redis.hset(key, "meta", json.dumps(asdict(meta)))
        await self.redis.pexpireat(key, until * 1000)

    async def delete(self, meta: StoredFile) -> None:
        await self.redis.delete(self._key(meta.id))
        await self.redis.zrem(self._index(meta.tenant), meta.id)

    async def list(self, tenant: str, *, newest_first: bool, after: str | None, limit: int) -> list[StoredFile]:
        """A tenant's files in creation order, starting after the file `after`; expired ones are
        dropped from the index as they are met."""
        index = self._index(tenant)
        ids = [i.decode() if isinstance(i, bytes) else i
               for i in await self.redis.zrange(index, 0, -1, desc=newest_first)]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        out: list[StoredFile] = []
        for file_id in ids:
            meta = await self.meta(file_id)
            if meta is None:
                await self.redis.zrem(index, file_id)
                continue
            out.append(meta)
            if len(out) >= limit + 1:  # one more than asked: whether there are more
                break
        return out
