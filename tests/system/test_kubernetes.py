"""The Kubernetes manifests (deploy/kustomization.yaml, deploy/kubernetes/) without a cluster: every
core object validates against the Kubernetes schemas (kubernetes-validate carries them offline, strict:
an unknown field is an error), KEDA's objects against the CRD schemas KEDA ships (tests/data/keda/:
keda.sh_scaledobjects.yaml and keda.sh_triggerauthentications.yaml from kedacore/keda
config/crd/bases at v2.20.2+, 2026-08-20), the kustomization lists exactly the files there, and the
lag KEDA's redis-streams trigger reads (XINFO GROUPS `lag`) is the backlog `streamer top` shows."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml

from clients.protocol import Names
from workers.cli.top_data import Gatherer

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"
CRDS = {kind: ROOT / "tests" / "data" / "keda" / f"keda.sh_{kind.lower()}s.yaml"
        for kind in ("ScaledObject", "TriggerAuthentication")}


def documents() -> list[tuple[str, dict]]:
    return [(f"{path.name}#{i}", doc) for path in MANIFESTS
            for i, doc in enumerate(yaml.safe_load_all(path.read_text())) if doc]


def crd_schema(kind: str) -> dict:
    crd = yaml.safe_load(CRDS[kind].read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return version["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize("name, doc", [d for d in documents() if not d[1]["apiVersion"].startswith("keda.sh/")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_core_objects_validate_against_the_kubernetes_schema(name: str, doc: dict) -> None:
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        error = None
    except kubernetes_validate.ValidationError as e:
        error = e.message
    assert error is None, error


@pytest.mark.parametrize("name, doc", [d for d in documents() if d[1]["apiVersion"].startswith("keda.sh/")],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_keda_objects_validate_against_kedas_crd(name: str, doc: dict) -> None:
    errors = [e.message for e in jsonschema.Draft7Validator(crd_schema(doc["kind"])).iter_errors(doc)]
    assert not errors, errors


def test_the_crd_schema_catches_a_wrong_object() -> None:
    """The KEDA schemas are strict enough to matter: a trigger without a type is refused."""
    bad = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
           "spec": {"scaleTargetRef": {"name": "w"}, "triggers": [{"metadata": {"stream": "s"}}]}}
    with pytest.raises(jsonschema.ValidationError, match="type"):
        jsonschema.validate(bad, crd_schema("ScaledObject"))


def test_kustomization_lists_every_manifest_and_its_targets_exist() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(f"kubernetes/{p.name}" for p in MANIFESTS)
    for generated in kustomization["configMapGenerator"]:
        for entry in generated["files"]:
            assert (DEPLOY / entry.split("=", 1)[-1]).is_file(), entry
    names = {(d["kind"], d["metadata"]["name"]) for _, d in documents()}
    for _, doc in documents():
        if doc["kind"] == "ScaledObject":
            assert ("Deployment", doc["spec"]["scaleTargetRef"]["name"]) in names
    overlay_dir = DEPLOY / "kubernetes" / "overlays" / "gpu"
    overlay = yaml.safe_load((overlay_dir / "kustomization.yaml").read_text())
    assert [(overlay_dir / r).resolve() for r in overlay["resources"]] == [DEPLOY.resolve()]
    for patch in overlay["patches"]:
        target = yaml.safe_load((overlay_dir / patch["path"]).read_text())
        assert (target["kind"], target["metadata"]["name"]) in names


def test_workers_outlive_their_drain_and_everything_reads_the_same_redis() -> None:
    docs = dict((d["metadata"]["name"], d) for _, d in documents() if d["kind"] == "Deployment")
    worker = docs["streamer-worker"]["spec"]["template"]["spec"]
    args = worker["containers"][0]["args"]
    drain = float(args[args.index("--drain-timeout") + 1])
    assert worker["terminationGracePeriodSeconds"] > drain
    scaled = next(d for _, d in documents() if d["kind"] == "ScaledObject" and
                  d["spec"]["triggers"][0]["type"] == "redis-streams")
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    names = Names()
    assert (trigger["stream"], trigger["consumerGroup"]) == (names.requests, names.group)


def test_the_lag_keda_reads_is_the_backlog_top_shows(redis_url: str) -> None:
    """KEDA's redis-streams trigger takes the group's `lag` from XINFO GROUPS (entries no worker has
    read): with jobs queued and none read it must equal what `streamer top` reports for the stream."""
    client = redis.Redis.from_url(redis_url)
    names = Names(prefix="k8s")
    client.xgroup_create(names.requests, names.group, id="0", mkstream=True)
    for i in range(7):
        client.xadd(names.requests, {"json": f'{{"id": "j{i}", "prompt": "hi"}}'})
    client.xreadgroup(names.group, "w", {names.requests: ">"}, count=2)  # two in flight, five waiting
    keda_lag = next(g["lag"] for g in client.xinfo_groups(names.requests) if g["name"].decode() == names.group)
    client.zadd(names.streams, {names.requests: 0})
    snapshot = Gatherer(client, names, redis_url).snapshot()
    stream = next(s for s in snapshot["streams"] if s["name"] == names.requests)
    group = next(g for g in stream["groups"] if g["name"] == names.group)
    assert keda_lag == group["lag"] == 5 and group["pending"] == 2 and stream["length"] == 7
    client.close()


def test_the_lag_keda_reads_is_the_backlog_top_shows_on_lanes_tenants_and_routed_streams(redis_url: str) -> None:
    """Lanes, tenant queues and a worker's own (routed) stream each hold part of the backlog: KEDA's
    redis-streams trigger reads one stream's lag, and for each the number equals `streamer top`'s; their
    sum is what the Prometheus trigger on streamer_queue_lag scales on (docs/running.md#kubernetes)."""
    client = redis.Redis.from_url(redis_url)
    names = Names(prefix="k8s-lanes", lanes=(-5,))
    lane, rank = names.lane_for(-10)
    streams = {names.requests: (4, 1), lane: (3, 0), names.tenant_stream(lane, "acme"): (5, 2),
               names.worker_requests("w-1"): (2, 1)}  # stream -> (jobs pushed, read by a worker)
    for stream, (pushed, read) in streams.items():
        client.xgroup_create(stream, names.group, id="0", mkstream=True)
        for i in range(pushed):
            client.xadd(stream, {"json": f'{{"id": "{stream}-{i}", "prompt": "hi"}}'})
        if read:
            client.xreadgroup(names.group, "w-1", {stream: ">"}, count=read)
    client.zadd(names.streams, {names.requests: 0, lane: rank, names.tenant_stream(lane, "acme"): rank})
    client.zadd(names.worker_streams, {"w-1": 0})
    gatherer = Gatherer(client, names, redis_url)
    gatherer.snapshot()  # as `streamer top` refreshes: the streams one refresh finds, the next one reads
    snapshot = gatherer.snapshot()
    top = {s["name"]: next(g for g in s["groups"] if g["name"] == names.group) for s in snapshot["streams"]}
    for stream, (pushed, read) in streams.items():
        keda_lag = next(g["lag"] for g in client.xinfo_groups(stream) if g["name"].decode() == names.group)
        assert keda_lag == top[stream]["lag"] == pushed - read, stream
        assert top[stream]["pending"] == read, stream
    assert sum(top[s]["lag"] for s in streams) == sum(p - r for p, r in streams.values()) == 10
    client.close()
