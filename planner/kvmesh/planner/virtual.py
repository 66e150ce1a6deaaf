"""The virtual connector: the planner decides, an external system runs the workers.

Each decision is published as one JSON document; the external system applies it and
acknowledges it by writing an acknowledgement document with the same id (and, optionally, how
its pools are now). Until decision N is acknowledged, a new `scale` is refused with Aborted
(the previous decision is still being applied), so the planner tries again next interval and
never stacks decisions.

    {prefix}/v1/planner/{model}/decision   {"id": 7, "targets": {"decode": 3, "prefill": 1},
                                            "reason": "...", "time": 1764000000.0}
    {prefix}/v1/planner/{model}/ack        {"id": 7, "pools": {"decode": {"ready": 2,
                                            "starting": 1, "draining": 0}, ...}}

`model` is `--model` or "default". Stores (`--virtual-store`): the mesh's etcd
(`etcd://host:port[,host:port...][?prefix=/kvmesh]`, the same URL as `--discovery`: keys as
above) or a directory shared with the external system (`file:///dir`: files `decision.json` and
`ack.json` under `dir/{model}/`, written atomically). Pools start at the sizes of the
acknowledgement, or 0 (`--virtual-pools` names the pools when nothing was acknowledged yet).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from kvmesh.planner.connectors import check_replicas
from kvmesh.planner.policy import PoolState
from kvmesh.runtime.config import opt
from kvmesh.runtime.discovery import EtcdDiscovery, open_discovery
from kvmesh.runtime.errors import Aborted, InvalidRequest, Unavailable
from kvmesh.runtime.types import Role

__all__ = [
    "DecisionStore",
    "EtcdStore",
    "FileStore",
    "VirtualConfig",
    "VirtualConnector",
    "open_store",
]


@dataclass
class VirtualConfig:
    """The virtual connector (--connector virtual): decisions for an external system."""

    virtual_store: str = opt(
        "", "where decisions are published: etcd://host:port[?prefix=/kvmesh] or file:///dir"
    )
    virtual_pools: list[str] = opt(
        ["aggregated"], "the pools the external system runs: aggregated, or prefill decode"
    )
    virtual_model: str = opt("default", "name the decisions are published under")


class DecisionStore(Protocol):
    """Two JSON documents: the planner's decision and the external system's acknowledgement."""

    async def read(self, name: str) -> dict[str, Any] | None:
        """The document `name` ("decision" or "ack"); None if absent."""
        ...

    async def write(self, name: str, doc: dict[str, Any]) -> None:
        """Replace the document `name`."""
        ...

    async def close(self) -> None: ...


def _decode(raw: bytes | str, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise Unavailable(f"{where} is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise Unavailable(f"{where} is not a JSON object")
    return doc


class FileStore:
    """Documents as files `{name}.json` in a directory (written to a temp file, then renamed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    async def read(self, name: str) -> dict[str, Any] | None:
        path = self.directory / f"{name}.json"
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Unavailable(f"cannot read {path}: {exc}") from None
        return _decode(raw, str(path))

    async def write(self, name: str, doc: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(doc, sort_keys=True))
            tmp.replace(path)
        except OSError as exc:
            raise Unavailable(f"cannot write {path}: {exc}") from None

    async def close(self) -> None:
        return None


class EtcdStore:
    """Documents as etcd keys `{prefix}/v1/planner/{model}/{name}` (the mesh's etcd)."""

    def __init__(self, etcd: EtcdDiscovery, model: str) -> None:
        self.etcd = etcd
        self.base = f"{etcd.prefix}/v1/planner/{model}/"
        self._client: Any = None
        self._attempt = 0

    def _connect(self) -> Any:
        if self._client is None:
            self._client, _ = self.etcd.connect(self._attempt)
        return self._client

    async def _failed(self, exc: Exception) -> Unavailable:
        client, self._client = self._client, None
        self._attempt += 1
        if client is not None:
            try:
                await client.close()
            except Exception:  # closing a client whose connection already failed
                pass
        return Unavailable(f"etcd at {self.etcd.where}: {exc or type(exc).__name__}")

    async def read(self, name: str) -> dict[str, Any] | None:
        key = (self.base + name).encode()
        try:
            got = await self._connect().get(key)
        except Exception as exc:  # aetcd raises its own connection errors
            raise await self._failed(exc) from None
        return None if got is None else _decode(got.value, key.decode())

    async def write(self, name: str, doc: dict[str, Any]) -> None:
        key = (self.base + name).encode()
        try:
            await self._connect().put(key, json.dumps(doc, sort_keys=True).encode())
        except Exception as exc:  # aetcd raises its own connection errors
            raise await self._failed(exc) from None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def open_store(url: str, model: str) -> DecisionStore:
    """The store `url` names (etcd:// or file://)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileStore(Path(parsed.path) / model)
    if parsed.scheme == "etcd":
        etcd = open_discovery(url)
        assert isinstance(etcd, EtcdDiscovery)
        return EtcdStore(etcd, model)
    raise InvalidRequest(
        f"--virtual-store must be etcd://host:port[?prefix=...] or file:///dir, not {url!r}"
    )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and value >= 0 else 0


class VirtualConnector:
    """Publishes decisions and waits for acknowledgements (see the module doc)."""

    def __init__(self, config: VirtualConfig, store: DecisionStore | None = None) -> None:
        if not config.virtual_store and store is None:
            raise InvalidRequest("--connector virtual needs --virtual-store etcd://... or file://")
        try:
            self.roles = [Role(r) for r in config.virtual_pools]
        except ValueError:
            raise InvalidRequest("--virtual-pools takes aggregated, prefill, decode") from None
        if not self.roles:
            raise InvalidRequest("--virtual-pools names no pool")
        self.store = store or open_store(config.virtual_store, config.virtual_model)

    async def _state(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return await self.store.read("decision"), await self.store.read("ack")

    async def pools(self) -> dict[Role, PoolState]:
        decision, ack = await self._state()
        targets = decision.get("targets", {}) if decision else {}
        reported = ack.get("pools", {}) if ack else {}
        out: dict[Role, PoolState] = {}
        for role in self.roles:
            target = _count(targets.get(role.value, 0)) if isinstance(targets, dict) else 0
            state = reported.get(role.value) if isinstance(reported, dict) else None
            if isinstance(state, dict):
                out[role] = PoolState(
                    role,
                    target=target,
                    ready=_count(state.get("ready")),
                    starting=_count(state.get("starting")),
                    draining=_count(state.get("draining")),
                )
            else:  # nothing reported: an acknowledged target is taken as ready
                acked = bool(decision and ack and ack.get("id") == decision.get("id"))
                out[role] = PoolState(
                    role,
                    target=target,
                    ready=target if acked else 0,
                    starting=0 if acked else target,
                )
        return out

    async def scale(self, targets: Mapping[Role, int], reason: str = "") -> None:
        for role, replicas in targets.items():
            if role not in self.roles:
                raise InvalidRequest(
                    f"no {role.value} pool: the external system runs "
                    + ", ".join(r.value for r in self.roles),
                    param="role",
                )
            check_replicas(replicas, 2**31 - 1)
        decision, ack = await self._state()
        last = decision.get("id", 0) if decision else 0
        if decision and (not ack or ack.get("id") != last):
            raise Aborted(
                f"decision {last} is not acknowledged yet: the external system is still applying it"
            )
        published = dict(decision.get("targets", {})) if decision else {}
        published.update({role.value: n for role, n in targets.items()})
        await self.store.write(
            "decision",
            {
                "id": int(last) + 1,
                "targets": published,
                "reason": reason,
                "time": time.time(),
            },
        )

    async def close(self) -> None:
        await self.store.close()
