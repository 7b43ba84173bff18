"""deploy/kubernetes (issue 32, item 3): every manifest validates against the Kubernetes
schemas (kubernetes-validate, offline: the schemas ship in the package), the ServiceMonitor
against the Prometheus Operator's required fields, and the pod wires what kvtierd needs: the
socket and arena volumes shared with vLLM, the SSD claim, gRPC probes on the daemon's health
port, a grace period covering the shutdown flush, and a daemon config that loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks._support.daemon_proc import REPO
from kvtierd.config import load_daemon_config
from kvtierd.server.app import GRACE_S

MANIFESTS = sorted((REPO / "deploy" / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.30.0"  # native sidecars (restartPolicy: Always) are on by default


def _documents() -> list[dict[str, Any]]:
    return [d for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]


def _by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _documents() if d["kind"] == kind]
    return doc


# The fields of monitoring.coreos.com/v1 ServiceMonitor this deployment uses, from the
# Prometheus Operator's CRD (a CRD's schema is not among Kubernetes' own).
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(manifest: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="the dev extra: run scripts/setup")
    import jsonschema

    for doc in yaml.safe_load_all(manifest.read_text()):
        if doc["kind"] == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR_SCHEMA)
        else:
            kv.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_wrong_field() -> None:
    """The check above can fail: a misspelt field of a Deployment is refused."""
    kv = pytest.importorskip("kubernetes_validate", reason="the dev extra: run scripts/setup")
    deployment = _by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, KUBERNETES_VERSION, strict=True)


def _config() -> Any:
    return yaml.safe_load(_by_kind("ConfigMap")["data"]["kvtierd.yaml"])


def test_pod_shares_socket_and_arena_and_probes_health(tmp_path: Path) -> None:
    pod = _by_kind("Deployment")["spec"]["template"]["spec"]
    (daemon,) = pod["initContainers"]
    vllm, _ = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert (
        volumes["ssd"]["persistentVolumeClaim"]["claimName"]
        == _by_kind("PersistentVolumeClaim")["metadata"]["name"]
    )
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
              for c in (daemon, vllm)}  # fmt: skip
    config = _config()
    # A folder below the mount: the daemon makes it 0700 (the emptyDir is root's, 0777).
    socket_dir = str(Path(config["socket_path"]).parent.parent)
    arena_dir = config["tiers"][0]["options"]["arena_dir"]
    for name in ("kvtierd", "vllm"):
        assert mounts[name]["socket"] == socket_dir
        assert arena_dir == mounts[name]["shm"]  # the CPU tier does not make the directory
    assert config["tiers"][1]["path"].startswith(mounts["kvtierd"]["ssd"] + "/")
    health_port = int(config["health_address"].rpartition(":")[2])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["grpc"]["port"] == health_port
    assert pod["terminationGracePeriodSeconds"] >= GRACE_S + config["shutdown_flush_s"] + 10
    assert daemon["resources"]["requests"] and vllm["resources"]["requests"]
    # The config as the daemon reads it (paths made local: they need not exist to load).
    local = tmp_path / "kvtierd.yaml"
    local.write_text(yaml.safe_dump(config))
    assert load_daemon_config(local).health_address == "0.0.0.0:8081"
    lmcache = yaml.safe_load(_by_kind("ConfigMap")["data"]["lmcache.yaml"])
    assert lmcache["extra_config"]["kvtierd.socket_path"] == config["socket_path"]


def test_service_monitor_scrapes_the_metrics_port() -> None:
    monitor = _by_kind("ServiceMonitor")
    service = _by_kind("Service")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert ports[endpoint["port"]]["port"] == _config()["metrics_port"]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


def test_router_probes_split_liveness_from_readiness() -> None:
    """Issue 41: the router is live while it answers and ready while vLLM does; the daemon's
    state is a field of /readyz, never its status (probes.py). The probes need no token."""
    from kvtierd.integrations.router.probes import PROBE_PATHS

    pod = _by_kind("Deployment")["spec"]["template"]["spec"]
    vllm, router = pod["containers"]
    assert router["name"] == "router"
    args = router["args"]
    port = int(args[args.index("--port") + 1])
    assert router["livenessProbe"]["httpGet"] == {"path": "/livez", "port": port}
    assert router["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert {"/livez", "/readyz"} == set(PROBE_PATHS)
    assert (
        args[args.index("--upstream") + 1]
        == f"http://127.0.0.1:{vllm['ports'][0]['containerPort']}"
    )
    assert args[args.index("--socket") + 1] == _config()["socket_path"]
    lmcache = yaml.safe_load(_by_kind("ConfigMap")["data"]["lmcache.yaml"])
    assert int(args[args.index("--chunk-size") + 1]) == lmcache["chunk_size"]
    assert "--token-file" in args  # bound beyond loopback: never without a token
    mounts = {m["name"]: m["mountPath"] for m in router["volumeMounts"]}
    assert args[args.index("--token-file") + 1].startswith(mounts["router-token"] + "/")
    service_ports = {p["name"]: p["port"] for p in _by_kind("Service")["spec"]["ports"]}
    assert service_ports["router"] == port
