#!/usr/bin/env python3
"""Derive a JSON Schema of KServe's ServingRuntime, ClusterServingRuntime and InferenceService
from the KServe Python SDK, for validating deploy/kserve offline (tests/deploy).

Source: the SDK's model classes (`kserve/models/*.py`), which KServe generates with
openapi-generator from its own OpenAPI document (pkg/openapi/swagger.json, itself generated from
the Go API types the CRDs come from). Each class lists its fields (`attribute_map`: Python name
-> JSON name), their types (`openapi_types`) and, in its setters, which ones must not be None.
The classes are read as text (ast), never imported: the SDK's package imports a model server.

What the schema says, for every KServe object reachable from the three kinds:
  * exactly the fields the SDK lists (additionalProperties: false, as `kubectl apply
    --validate=strict` does), with their JSON types; required fields are required;
  * fields of Kubernetes types (V1Container, V1ObjectMeta, ...) are $refs into Kubernetes'
    own definitions (kubernetes-validate's `_definitions.json`, strict), resolved when validating;
  * types the SDK names but does not define (KEDA, Knative, a few KServe ones) are left
    unchecked ({}), and listed under x-kvmesh-source.unchecked_types.

  python deploy/kserve/schema/generate.py                 # pip-downloads kserve==VERSION
  python deploy/kserve/schema/generate.py --wheel W.whl   # or reads this wheel
  python deploy/kserve/schema/generate.py --check         # fails if the committed file differs
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

KSERVE_VERSION = "0.21.0"
HERE = Path(__file__).resolve().parent
OUTPUT = HERE / f"kserve-{KSERVE_VERSION}.schema.json"
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
"""The $id of kubernetes-validate's `_definitions.json` (every Kubernetes version's file)."""

ROOTS = {
    "serving.kserve.io/v1alpha1/ServingRuntime": "V1alpha1ServingRuntime",
    "serving.kserve.io/v1alpha1/ClusterServingRuntime": "V1alpha1ClusterServingRuntime",
    "serving.kserve.io/v1beta1/InferenceService": "V1beta1InferenceService",
}
SCALARS: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "object": {},
    "datetime": {"type": "string", "format": "date-time"},
}
K8S_GROUPS = ("io.k8s.api.core", "io.k8s.apimachinery.pkg.apis.meta")
"""Where a plain `V1Foo` of the SDK lives, in this order (the SDK names them like the
`kubernetes` client does)."""
QUALIFIED = re.compile(r"^K8sIoApi([A-Z][a-z]+)(V\d+(?:(?:alpha|beta)\d+)?)([A-Z]\w*)$")
SETTER_REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")


class SdkModels:
    """The SDK's model classes: name -> (attribute_map, openapi_types, required Python names)."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.classes: dict[str, tuple[dict[str, str], dict[str, str], set[str]]] = {}
        for text in sources.values():
            for node in ast.parse(text).body:
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name] = _read_class(node, text)


def _read_class(node: ast.ClassDef, text: str) -> tuple[dict[str, str], dict[str, str], set[str]]:
    found: dict[str, dict[str, str]] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            if stmt.targets[0].id in ("attribute_map", "openapi_types"):
                found[stmt.targets[0].id] = ast.literal_eval(stmt.value)
    segment = ast.get_source_segment(text, node) or ""
    return found["attribute_map"], found["openapi_types"], set(SETTER_REQUIRED.findall(segment))


class SchemaBuilder:
    def __init__(self, models: SdkModels, k8s_defs: dict[str, Any]) -> None:
        self.models = models
        self.k8s_defs = k8s_defs
        self.defs: dict[str, Any] = {}
        self.unchecked: set[str] = set()

    def type_schema(self, spec: str) -> dict[str, Any]:
        if spec in SCALARS:
            return dict(SCALARS[spec])
        if m := re.fullmatch(r"list\[(.+)\]", spec):
            return {"type": "array", "items": self.type_schema(m.group(1))}
        if m := re.fullmatch(r"dict\(str, (.+)\)", spec):
            return {"type": "object", "additionalProperties": self.type_schema(m.group(1))}
        if spec in self.models.classes:
            self.define(spec)
            return {"$ref": f"#/$defs/{spec}"}
        k8s = self.k8s_name(spec)
        if k8s is not None:
            return {"$ref": f"{K8S_DEFS}#/$defs/{k8s}"}
        self.unchecked.add(spec)
        return {}

    def k8s_name(self, spec: str) -> str | None:
        """The Kubernetes definition an SDK type name stands for; None if it names none."""
        if spec == "ResourceQuantity":
            return "io.k8s.apimachinery.pkg.api.resource.Quantity"
        if m := QUALIFIED.fullmatch(spec):
            name = f"io.k8s.api.{m.group(1).lower()}.{m.group(2).lower()}.{m.group(3)}"
            return name if name in self.k8s_defs else None
        if m := re.fullmatch(r"(V\d+(?:(?:alpha|beta)\d+)?)([A-Z]\w*)", spec):
            for group in K8S_GROUPS:
                name = f"{group}.{m.group(1).lower()}.{m.group(2)}"
                if name in self.k8s_defs:
                    return name
        return None

    def define(self, cls: str) -> None:
        if cls in self.defs:
            return
        self.defs[cls] = {}  # placeholder: recursive types
        attribute_map, openapi_types, required = self.models.classes[cls]
        schema: dict[str, Any] = {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                attribute_map[attr]: self.type_schema(spec)
                for attr, spec in sorted(openapi_types.items())
            },
        }
        if required:
            schema["required"] = sorted(attribute_map[a] for a in required)
        self.defs[cls] = schema


def build(sources: dict[str, str], k8s_defs: dict[str, Any], source: dict[str, Any]) -> Any:
    builder = SchemaBuilder(SdkModels(sources), k8s_defs)
    kinds: dict[str, str] = {}
    for key, cls in ROOTS.items():
        builder.define(cls)
        group_version, kind = key.rsplit("/", 1)
        root = builder.defs[cls]
        root["properties"]["apiVersion"] = {"const": group_version}
        root["properties"]["kind"] = {"const": kind}
        root["required"] = sorted({*root.get("required", []), "apiVersion", "kind", "metadata"})
        kinds[key] = f"#/$defs/{cls}"
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://kvmesh.invalid/kserve-{KSERVE_VERSION}.schema.json",
        "x-kvmesh-source": {**source, "unchecked_types": sorted(builder.unchecked)},
        "x-kvmesh-kinds": kinds,
        "$defs": dict(sorted(builder.defs.items())),
    }


def k8s_definitions() -> tuple[dict[str, Any], str]:
    """Kubernetes' definitions from kubernetes-validate (its newest version), and their label."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    version = latest_version()
    path = root / f"v{version}-local-strict" / "_definitions.json"
    defs = json.loads(path.read_text())["$defs"]
    return defs, f"kubernetes-validate {kubernetes_validate.__version__}, v{version}-local-strict"


def read_wheel(wheel: Path) -> tuple[dict[str, str], str]:
    """The SDK's model sources in `wheel`, and the wheel's sha256."""
    with zipfile.ZipFile(wheel) as zf:
        sources = {
            name: zf.read(name).decode()
            for name in zf.namelist()
            if name.startswith("kserve/models/") and name.endswith(".py")
        }
    return sources, hashlib.sha256(wheel.read_bytes()).hexdigest()


def download_wheel(dest: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(dest), f"kserve=={KSERVE_VERSION}"],
        check=True,
    )  # fmt: skip
    return next(dest.glob(f"kserve-{KSERVE_VERSION}-*.whl"))


def render(wheel: Path) -> str:
    sources, sha256 = read_wheel(wheel)
    k8s, k8s_label = k8s_definitions()
    source = {
        "package": f"kserve=={KSERVE_VERSION} (PyPI), kserve/models/*.py",
        "wheel": wheel.name,
        "wheel_sha256": sha256,
        "kubernetes_definitions": k8s_label,
        "generated_by": "deploy/kserve/schema/generate.py",
    }
    return json.dumps(build(sources, k8s, source), indent=1, sort_keys=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path, help="kserve wheel (default: pip download)")
    parser.add_argument("--check", action="store_true", help="compare with the committed file")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = render(args.wheel or download_wheel(Path(tmp)))
    if args.check:
        if args.output.read_text() != text:
            print(f"{args.output} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
