"""The Kubernetes connector: each pool is a Deployment or StatefulSet of workers, and the planner
sets its size through the workload's `scale` subresource, with an async Kubernetes client
(kubernetes_asyncio, the `kubernetes` extra).

  * `pools`: reads each workload (`GET /apis/apps/v1/namespaces/NS/deployments/NAME`): target =
    spec.replicas, ready = status.readyReplicas, starting = the target's pods not ready yet,
    draining = pods above the target still terminating their requests (status.replicas -
    spec.replicas);
  * `scale`: reads the scale subresource (`GET .../deployments/NAME/scale`, autoscaling/v1
    Scale), then patches it with a JSON merge patch (`PATCH .../deployments/NAME/scale`,
    `Content-Type: application/merge-patch+json`) that carries the resourceVersion it read:
    {"metadata": {"resourceVersion": RV}, "spec": {"replicas": N}}. A 409 Conflict (someone
    changed the workload in between) is retried from a fresh read, up to 3 times, then reported
    as Aborted; 404 is NotFound, 403 (RBAC) Unavailable with what the Role must allow, 422
    InvalidRequest.

RBAC the planner's ServiceAccount needs in the workers' namespace (deploy/kubernetes/overlays/
planner): `get` on deployments (and statefulsets), `get` and `patch` on deployments/scale (and
statefulsets/scale). Scale-down drains: Kubernetes sends SIGTERM to the pods it removes, and
a kvmesh worker leaves discovery first and finishes its requests within its
`terminationGracePeriodSeconds` (deploy/README.md).

Configuration: `--k8s-kubeconfig FILE`, else the in-cluster service account when running in a
pod, else ~/.kube/config; `--k8s-namespace`, else the pod's own namespace, else "default".
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.planner.connectors import check_replicas
from kvmesh.planner.policy import PoolState
from kvmesh.runtime.config import opt
from kvmesh.runtime.errors import (
    Aborted,
    InvalidRequest,
    KvmeshError,
    NotFound,
    Unavailable,
    Unimplemented,
)
from kvmesh.runtime.types import Role

__all__ = ["CONFLICT_RETRIES", "KubernetesConfig", "KubernetesConnector", "Workload"]

CONFLICT_RETRIES = 3
MERGE_PATCH = "application/merge-patch+json"
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_KINDS = {"deployment": "deployment", "statefulset": "stateful_set"}


@dataclass
class KubernetesConfig:
    """The Kubernetes connector (--connector kubernetes): which workloads are which pool."""

    k8s_workloads: list[str] = opt(
        [],
        "ROLE=KIND/NAME for each pool, e.g. aggregated=deployment/kvmesh-worker or "
        "prefill=deployment/kvmesh-prefill decode=statefulset/kvmesh-decode",
    )
    k8s_namespace: str = opt(
        "", "namespace of the workers; empty: the pod's own (in cluster), else 'default'"
    )
    k8s_kubeconfig: str = opt(
        "", "kubeconfig file; empty: the in-cluster service account, else ~/.kube/config"
    )


@dataclass(frozen=True, slots=True)
class Workload:
    """A pool's Deployment or StatefulSet."""

    kind: str
    """"deployment" or "statefulset"."""
    name: str

    @classmethod
    def parse(cls, text: str) -> tuple[Role, Workload]:
        """'ROLE=KIND/NAME' -> (role, workload); InvalidRequest if malformed."""
        role_text, _, ref = text.partition("=")
        kind, _, name = ref.partition("/")
        try:
            role = Role(role_text.strip())
        except ValueError:
            raise InvalidRequest(
                f"--k8s-workloads {text!r}: role must be aggregated, prefill or decode"
            ) from None
        kind = kind.strip().lower()
        if kind not in _KINDS or not name.strip():
            raise InvalidRequest(
                f"--k8s-workloads {text!r} must look like ROLE=deployment/NAME or "
                "ROLE=statefulset/NAME"
            )
        return role, cls(kind, name.strip())


def _own_namespace() -> str:
    """The pod's namespace (in cluster), else "default"."""
    try:
        return _SA_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"


def _import_client() -> Any:
    try:
        return importlib.import_module("kubernetes_asyncio")
    except ImportError:
        raise Unimplemented(
            "the kubernetes connector needs kubernetes_asyncio: pip install 'kvmesh[kubernetes]'"
        ) from None


class KubernetesConnector:
    """Pools as Deployments/StatefulSets, sized through their scale subresource (module doc)."""

    def __init__(self, config: KubernetesConfig) -> None:
        if not config.k8s_workloads:
            raise InvalidRequest("--connector kubernetes needs --k8s-workloads ROLE=KIND/NAME ...")
        self.config = config
        self.workloads: dict[Role, Workload] = {}
        for text in config.k8s_workloads:
            role, workload = Workload.parse(text)
            if role in self.workloads:
                raise InvalidRequest(f"--k8s-workloads names the {role.value} pool twice")
            self.workloads[role] = workload
        self._k8s = _import_client()
        self._api_client: Any = None
        self._apps: Any = None
        self.namespace = config.k8s_namespace or _own_namespace()

    async def _api(self) -> Any:
        if self._apps is not None:
            return self._apps
        k8s = self._k8s
        config = k8s.config
        settings = k8s.client.Configuration()  # this connector's own, never the global one
        try:
            if self.config.k8s_kubeconfig:
                await config.load_kube_config(
                    config_file=self.config.k8s_kubeconfig, client_configuration=settings
                )
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=settings)
            else:
                await config.load_kube_config(client_configuration=settings)
        except (config.ConfigException, OSError) as exc:
            raise Unavailable(f"no Kubernetes configuration: {exc}") from None
        self._api_client = k8s.client.ApiClient(configuration=settings)
        self._apps = k8s.client.AppsV1Api(self._api_client)
        return self._apps

    def _workload(self, role: Role) -> Workload:
        found = self.workloads.get(role)
        if found is None:
            raise InvalidRequest(
                f"no {role.value} pool: this planner scales "
                + ", ".join(r.value for r in self.workloads),
                param="role",
            )
        return found

    def _error(self, exc: Exception, what: str) -> KvmeshError:
        status = getattr(exc, "status", 0)
        reason = getattr(exc, "reason", "") or str(exc)
        if status == 404:
            return NotFound(f"{what}: not found ({reason})")
        if status == 403:
            return Unavailable(
                f"{what}: forbidden ({reason}); the planner's Role must allow get on "
                "deployments/statefulsets and get, patch on their scale subresource"
            )
        if status == 409:
            return Aborted(f"{what}: changed concurrently ({reason})")
        if status in (400, 422):
            return InvalidRequest(f"{what}: rejected ({reason})")
        return Unavailable(f"{what}: {reason or type(exc).__name__}")

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except self._k8s.client.exceptions.ApiException as exc:
            raise self._error(exc, what) from None
        except (OSError, TimeoutError) as exc:
            raise Unavailable(f"{what}: cannot reach the Kubernetes API ({exc})") from None

    async def pools(self) -> dict[Role, PoolState]:
        apps = await self._api()
        out: dict[Role, PoolState] = {}
        for role, w in self.workloads.items():
            read = getattr(apps, f"read_namespaced_{_KINDS[w.kind]}")
            obj = await self._call(f"{w.kind}/{w.name}", read, w.name, self.namespace)
            target = int(obj.spec.replicas or 0)
            ready = int(obj.status.ready_replicas or 0)
            current = int(obj.status.replicas or 0)
            ready_in_target = min(ready, target)
            out[role] = PoolState(
                role,
                target=target,
                ready=ready_in_target,
                starting=max(0, target - ready_in_target),
                draining=max(0, current - target),
            )
        return out

    async def scale(self, targets: Mapping[Role, int], reason: str = "") -> None:
        for role, replicas in targets.items():
            self._workload(role)
            check_replicas(replicas, 2**31 - 1)
        for role, replicas in targets.items():
            await self._scale(role, replicas)

    async def _scale(self, role: Role, replicas: int) -> None:
        w = self._workload(role)
        apps = await self._api()
        kind = _KINDS[w.kind]
        read = getattr(apps, f"read_namespaced_{kind}_scale")
        patch = getattr(apps, f"patch_namespaced_{kind}_scale")
        what = f"{w.kind}/{w.name} scale"
        for _ in range(CONFLICT_RETRIES):
            scale = await self._call(what, read, w.name, self.namespace)
            if int(scale.spec.replicas or 0) == replicas:
                return
            body = {
                "metadata": {"resourceVersion": scale.metadata.resource_version},
                "spec": {"replicas": replicas},
            }
            try:
                await self._call(
                    what, patch, w.name, self.namespace, body, _content_type=MERGE_PATCH
                )
                return
            except Aborted:
                continue  # changed since we read it: read again
        raise Aborted(f"{what}: changed concurrently {CONFLICT_RETRIES} times; not applied")

    async def close(self) -> None:
        if self._api_client is not None:
            await self._api_client.close()
            self._api_client = None
            self._apps = None
