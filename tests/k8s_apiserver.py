"""An emulation of the part of the Kubernetes API the planner's Kubernetes connector uses: apps/v1
Deployments and StatefulSets and their `scale` subresource (autoscaling/v1 Scale), over HTTP on
loopback. No real kube-apiserver can be built or fetched on this machine (no Debian package,
no Go toolchain from outside), so the connector is tested against this, written from the API's
documented contract:

  * GET  /apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}/{name}        -> the object
  * GET  /apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}/{name}/scale  -> a Scale
  * PATCH .../scale with Content-Type application/merge-patch+json (RFC 7386) or
    application/strategic-merge-patch+json (the same for a Scale) or application/json-patch+json
    (RFC 6902: test / replace / add); anything else is 415.
  * PUT  .../scale with a whole Scale.

Every write bumps the object's resourceVersion (a cluster-wide counter, as etcd's revision); a
write that carries metadata.resourceVersion other than the current one is 409 Conflict; a
negative or non-integer spec.replicas is 422 Invalid; an unknown object is 404; every request
needs `Authorization: Bearer TOKEN` (401 without), and a token may do only the (verb, resource)
pairs it was granted (403 Forbidden otherwise), as RBAC does. Errors are `Status` objects.
A simulated controller moves status.replicas and status.readyReplicas to spec.replicas after
`ready_delay_s`. `interfere(n)` makes the next n scale reads be followed by a change from
"someone else" (a new resourceVersion), to exercise conflict handling.
"""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

PATCH_TYPES = {
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/json-patch+json",
}
KINDS = {"deployments": "Deployment", "statefulsets": "StatefulSet"}


@dataclass
class Workload:
    resource: str
    namespace: str
    name: str
    replicas: int
    resource_version: int
    generation: int = 1
    status_replicas: int = 0
    ready: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "uid": f"uid-{self.resource}-{self.name}",
            "resourceVersion": str(self.resource_version),
            "generation": self.generation,
            "creationTimestamp": "2026-01-01T00:00:00Z",
        }

    def obj(self) -> dict[str, Any]:
        selector = {"matchLabels": self.labels}
        spec: dict[str, Any] = {
            "replicas": self.replicas,
            "selector": selector,
            "template": {
                "metadata": {"labels": self.labels},
                "spec": {"containers": [{"name": "worker", "image": "kvmesh:test"}]},
            },
        }
        if self.resource == "statefulsets":
            spec["serviceName"] = self.name
        return {
            "apiVersion": "apps/v1",
            "kind": KINDS[self.resource],
            "metadata": self.metadata(),
            "spec": spec,
            "status": {
                "observedGeneration": self.generation,
                "replicas": self.status_replicas,
                "readyReplicas": self.ready,
                "availableReplicas": self.ready,
                "updatedReplicas": self.status_replicas,
            },
        }

    def scale(self) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": self.metadata(),
            "spec": {"replicas": self.replicas},
            "status": {
                "replicas": self.status_replicas,
                "selector": ",".join(f"{k}={v}" for k, v in self.labels.items()),
            },
        }


def _status(code: int, reason: str, message: str) -> web.Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return web.json_response(body, status=code)


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge(out.get(k), v)
    return out


def _json_patch(doc: dict[str, Any], ops: Any) -> dict[str, Any] | str:
    """RFC 6902 (test, replace, add on object paths); an error message when an op fails."""
    if not isinstance(ops, list):
        return "a JSON patch must be a list of operations"
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "path" not in op:
            return "malformed operation"
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for p in parts[:-1]:
            if not isinstance(parent, dict) or p not in parent:
                return f"path {op['path']} not found"
            parent = parent[p]
        last = parts[-1]
        if op.get("op") == "test":
            if not isinstance(parent, dict) or parent.get(last) != op.get("value"):
                return f"test of {op['path']} failed"
        elif op.get("op") in ("replace", "add"):
            if op["op"] == "replace" and last not in parent:
                return f"path {op['path']} not found"
            parent[last] = op.get("value")
        else:
            return f"unsupported op {op.get('op')!r}"
    return doc


class FakeApiServer:
    """The emulated API (see the module doc). `grants`: token -> {(verb, resource), ...} where
    resource is e.g. "deployments" or "deployments/scale"."""

    def __init__(self, grants: dict[str, set[tuple[str, str]]], ready_delay_s: float = 0.0) -> None:
        self.grants = grants
        self.ready_delay_s = ready_delay_s
        self.objects: dict[tuple[str, str, str], Workload] = {}
        self.revision = 100
        self.requests: list[tuple[str, str, str]] = []
        """(method, path, content type) of every request."""
        self._interfere = 0
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, resource: str, namespace: str, name: str, replicas: int) -> Workload:
        self.revision += 1
        w = Workload(
            resource,
            namespace,
            name,
            replicas,
            self.revision,
            status_replicas=replicas,
            ready=replicas,
            labels={"app": name},
        )
        self.objects[(resource, namespace, name)] = w
        return w

    def interfere(self, times: int) -> None:
        """The next `times` scale reads are each followed by someone else's write."""
        self._interfere = times

    async def start(self) -> str:
        app = web.Application()
        base = "/apis/apps/v1/namespaces/{ns}/{resource}/{name}"
        app.router.add_get(base, self._get)
        app.router.add_get(base + "/scale", self._get_scale)
        app.router.add_patch(base + "/scale", self._write_scale)
        app.router.add_put(base + "/scale", self._write_scale)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, token: str) -> str:
        """A kubeconfig (YAML is a superset of JSON) for this server and `token`."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "emu", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}
                ],
                "users": [{"name": "planner", "user": {"token": token}}],
                "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "planner"}}],
                "current-context": "emu",
            }
        )

    # -- handlers ---------------------------------------------------------------------------

    def _auth(
        self, request: web.Request, verb: str, resource: str, name: str
    ) -> web.Response | None:
        header = request.headers.get("Authorization", "")
        token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if token not in self.grants:
            return _status(401, "Unauthorized", "Unauthorized")
        if (verb, resource) not in self.grants[token]:
            kind = resource.split("/")[0]
            return _status(
                403,
                "Forbidden",
                f'{kind}.apps "{name}" is forbidden: User "system:serviceaccount:'
                f'{request.match_info["ns"]}:planner" cannot {verb} resource "{resource}" in '
                f'API group "apps" in the namespace "{request.match_info["ns"]}"',
            )
        return None

    def _find(self, request: web.Request) -> Workload | web.Response:
        m = request.match_info
        if m["resource"] not in KINDS:
            return _status(404, "NotFound", "the server could not find the requested resource")
        w = self.objects.get((m["resource"], m["ns"], m["name"]))
        if w is None:
            return _status(404, "NotFound", f'{m["resource"]}.apps "{m["name"]}" not found')
        return w

    async def _get(self, request: web.Request) -> web.Response:
        m = request.match_info
        self.requests.append(("GET", request.path, ""))
        denied = self._auth(request, "get", m["resource"], m["name"])
        if denied is not None:
            return denied
        w = self._find(request)
        return w if isinstance(w, web.Response) else web.json_response(w.obj())

    async def _get_scale(self, request: web.Request) -> web.Response:
        m = request.match_info
        self.requests.append(("GET", request.path, ""))
        denied = self._auth(request, "get", f"{m['resource']}/scale", m["name"])
        if denied is not None:
            return denied
        w = self._find(request)
        if isinstance(w, web.Response):
            return w
        body = w.scale()
        if self._interfere > 0:  # someone else writes right after this read
            self._interfere -= 1
            self.revision += 1
            w.resource_version = self.revision
        return web.json_response(body)

    async def _write_scale(self, request: web.Request) -> web.Response:
        m = request.match_info
        ctype = request.content_type
        self.requests.append((request.method, request.path, ctype))
        verb = "patch" if request.method == "PATCH" else "update"
        denied = self._auth(request, verb, f"{m['resource']}/scale", m["name"])
        if denied is not None:
            return denied
        w = self._find(request)
        if isinstance(w, web.Response):
            return w
        try:
            body = json.loads(await request.text())
        except ValueError as exc:
            return _status(400, "BadRequest", f"error decoding the body: {exc}")
        current = w.scale()
        if request.method == "PUT":
            new: Any = body
        elif ctype not in PATCH_TYPES:
            return _status(
                415,
                "UnsupportedMediaType",
                "the body of the request was in an unknown format - accepted media types "
                f"include: {', '.join(sorted(PATCH_TYPES))}",
            )
        elif ctype == "application/json-patch+json":
            new = _json_patch(current, body)
            if isinstance(new, str):
                return _status(422, "Invalid", new)
        else:
            new = _merge(current, body)
        rv = (new.get("metadata") or {}).get("resourceVersion") if isinstance(new, dict) else None
        if rv is not None and str(rv) != str(w.resource_version):
            return _status(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {m["resource"]}.apps "{w.name}": the object '
                "has been modified; please apply your changes to the latest version and try "
                "again",
            )
        replicas = (new.get("spec") or {}).get("replicas") if isinstance(new, dict) else None
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            return _status(
                422,
                "Invalid",
                f'Scale.autoscaling "{w.name}" is invalid: spec.replicas: Invalid value: '
                f"{replicas!r}: must be greater than or equal to 0",
            )
        if replicas != w.replicas:
            w.replicas = replicas
            w.generation += 1
        self.revision += 1
        w.resource_version = self.revision
        task = asyncio.create_task(self._controller(w))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return web.json_response(w.scale())

    async def _controller(self, w: Workload) -> None:
        await asyncio.sleep(self.ready_delay_s)
        w.status_replicas = w.replicas
        w.ready = w.replicas
