"""Every Redis name of the protocol, spelled as docs/protocol.md's tables spell it, on a single Redis and
on a cluster: a client in another language builds these strings by hand, so each one is the contract,
not an implementation detail. Also the refused configurations, each with its message."""

from __future__ import annotations

import hashlib
import zlib

import pytest

from clients.names import Names

PLAIN = {
    "requests": "llm:requests", "group": "llm:workers", "cancel": "llm:cancel", "dead": "llm:dead",
    "traces": "llm:traces", "heartbeats": "llm:heartbeats", "streams": "llm:streams", "tenants": "llm:tenants",
    "service": "llm:tenants:service", "worker_streams": "llm:worker-streams", "loads": "llm:loads",
}
# Shared keys on a cluster: one slot, the tag `{llm}` (the group and the cancel channel are no keys).
CLUSTER = {**{k: v.replace("llm:", "{llm}:", 1) for k, v in PLAIN.items()},
           "group": "llm:workers", "cancel": "llm:cancel"}
PER_REQUEST = ("events", "tokens", "job", "fence", "cancelled", "progress")
PER_REQUEST_NAMED = {"openai_stream": "openai", "gateway_resumed": "gateway:resumed", "gateway_claim": "gateway:req"}


@pytest.mark.parametrize(("cluster", "shared"), [(False, PLAIN), (True, CLUSTER)], ids=["single", "cluster"])
def test_every_name_is_spelled_as_documented(cluster: bool, shared: dict[str, str]) -> None:
    n = Names(cluster=cluster)
    assert {key: getattr(n, key) for key in shared} == shared
    tag = "{r:1}" if cluster else "r:1"  # a request's keys share its own slot on a cluster
    for kind in PER_REQUEST:
        assert getattr(n, kind)("r:1") == f"llm:{kind}:{tag}"
    for method, kind in PER_REQUEST_NAMED.items():
        assert getattr(n, method)("r:1") == f"llm:{kind}:{tag}"
    base = "{llm}" if cluster else "llm"
    assert n.worker("w-1") == f"{base}:worker:w-1"
    assert n.worker_prefixes("w-1") == f"{base}:worker:w-1:prefixes"
    assert n.worker_requests("w-1") == f"{base}:requests:w:w-1"
    assert n.tenant_active("acme") == f"{base}:tenant:acme:active"
    assert n.tenant_tokens("acme") == f"{base}:tenant:acme:tokens"
    digest = hashlib.blake2b(b"chat-7", digest_size=12).hexdigest()  # 24 hex digits: sessions of any length
    assert n.session("chat-7") == f"{base}:session:{digest}" and len(digest) == 24
    assert n.session("chat-7") != n.session("chat-8")


def test_the_prefix_renames_every_shared_key() -> None:
    n = Names(prefix="p")
    assert {key: getattr(n, key) for key in PLAIN} == {k: "p" + v[3:] for k, v in PLAIN.items()}
    assert (n.worker("w"), n.events("r"), n.session("s").rsplit(":", 1)[0]) == ("p:worker:w", "p:events:r", "p:session")


@pytest.mark.parametrize(("cluster", "want"), [
    (False, ["llm:requests:0", "llm:requests:1", "llm:requests:2"]),
    (True, ["{llm.0}:requests", "{llm.1}:requests", "{llm.2}:requests"]),  # a slot each
])
def test_shards_and_the_stream_each_id_goes_to(cluster: bool, want: list[str]) -> None:
    n = Names(cluster=cluster, shards=3)
    assert n.request_streams == want
    for rid in ("a", "b", "job-17", "team:a:1"):  # crc32(id) mod N, as any client computes it
        assert n.stream_for(rid) == want[zlib.crc32(rid.encode()) % 3]
    assert {n.stream_for(f"id-{i}") for i in range(30)} == set(want)
    one = Names(cluster=cluster)
    assert one.request_streams == [one.requests] and one.stream_for("x") == one.requests


@pytest.mark.parametrize(("config", "message"), [
    ({"shards": 0}, "shards must be at least 1"),
    ({"lanes": (-1, -10)}, "priority lanes must be distinct negative cutoffs in ascending order"),
    ({"lanes": (-1, -1)}, "priority lanes must be distinct negative cutoffs in ascending order"),
    ({"lanes": (-1, 0)}, "priority lanes must be distinct negative cutoffs in ascending order"),  # 0: the default
    ({"lanes": (-1,), "shards": 2}, r"priority lanes need a single request stream \(shards 1\)"),
])
def test_refused_configurations_say_why(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        Names(**config)


def test_accepted_configurations_at_the_edges() -> None:
    assert Names(lanes=(-10, -1)).lanes == (-10, -1)  # -1: the least urgent cutoff allowed
    assert Names(lanes=(-1,), shards=1).lanes == (-1,)
    assert Names(shards=1).shards == 1 and Names(shards=2).shards == 2
