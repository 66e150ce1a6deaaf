"""Service discovery: workers register under a lease; frontends and routers watch.

Backends, chosen by URL:
- `file:///dir` — the embedded default for one machine (`kvmesh up`): one JSON file per
  instance, refreshed while its lease lives; a file not refreshed within its TTL is expired,
  so a killed worker disappears without anyone cleaning up.
- `static://host:port,host:port` — a fixed list of worker addresses (no registration).
- `etcd://host:port` — etcd with leases and watches, for many machines (next issue; the seam
  is here: `open_discovery` is the only place that knows the backends).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from kvmesh.errors import InvalidRequest, Unimplemented

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Instance:
    """A registered worker (or router) process."""

    instance_id: str
    address: str
    """host:port of its gRPC server."""
    component: str = "worker"
    model: str = ""
    """Served model name; empty when unknown (static discovery: ask the worker)."""
    role: str = "aggregated"


class EventKind(enum.Enum):
    """What happened to an instance."""

    ADDED = "added"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class DiscoveryEvent:
    """An instance appeared or disappeared."""

    kind: EventKind
    instance: Instance


class Registration(Protocol):
    """A live registration; closing it removes the instance."""

    async def close(self) -> None: ...


class Discovery(Protocol):
    """Register instances under a lease and watch the set of instances."""

    async def register(self, instance: Instance) -> Registration:
        """Publish `instance` and keep its lease alive until the registration is closed."""
        ...

    def watch(self, component: str = "worker") -> AsyncIterator[DiscoveryEvent]:
        """ADDED for every current instance, then changes, until the iterator is closed."""
        ...


def open_discovery(url: str, *, ttl_s: float = 3.0, poll_s: float = 0.2) -> Discovery:
    """Build the discovery backend named by `url`."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileDiscovery(Path(parsed.path), ttl_s=ttl_s, poll_s=poll_s)
    if parsed.scheme == "static":
        addresses = [a for a in (parsed.netloc + parsed.path).split(",") if a]
        if not addresses:
            raise InvalidRequest("static:// discovery needs at least one host:port")
        return StaticDiscovery(addresses)
    if parsed.scheme == "etcd":
        raise Unimplemented("etcd discovery is not implemented yet; use file:// or static://")
    raise InvalidRequest(f"unknown discovery URL {url!r} (use file:///dir or static://h:p,...)")


class _FileRegistration:
    def __init__(self, path: Path, payload: bytes, refresh_s: float) -> None:
        self._path = path
        self._payload = payload
        self._task = asyncio.create_task(self._keepalive(refresh_s))

    def write(self) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(self._payload)
        os.replace(tmp, self._path)

    async def _keepalive(self, refresh_s: float) -> None:
        while True:
            await asyncio.sleep(refresh_s)
            try:
                os.utime(self._path)
            except FileNotFoundError:
                self.write()  # someone removed it (or it expired while we were stalled)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


class FileDiscovery:
    """Discovery through a shared directory on one machine (see module docstring).

    The lease is the file's mtime: the owner touches it every ttl/3; watchers treat a file
    older than ttl as gone.
    """

    def __init__(self, directory: Path, *, ttl_s: float = 3.0, poll_s: float = 0.2) -> None:
        self.directory = directory
        self.ttl_s = ttl_s
        self.poll_s = poll_s

    async def register(self, instance: Instance) -> Registration:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{instance.component}.{instance.instance_id}.json"
        reg = _FileRegistration(path, json.dumps(asdict(instance)).encode(), self.ttl_s / 3)
        reg.write()
        return reg

    def _scan(self, component: str) -> dict[str, Instance]:
        found: dict[str, Instance] = {}
        now = time.time()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return found
        for entry in entries:
            if not (entry.name.startswith(component + ".") and entry.name.endswith(".json")):
                continue
            try:
                if now - entry.stat().st_mtime > self.ttl_s:
                    continue
                data = json.loads(Path(entry.path).read_bytes())
                inst = Instance(**data)
            except (OSError, ValueError, TypeError) as exc:
                log.debug("skipping unreadable registration %s: %s", entry.path, exc)
                continue
            found[inst.instance_id] = inst
        return found

    async def watch(self, component: str = "worker") -> AsyncIterator[DiscoveryEvent]:
        known: dict[str, Instance] = {}
        while True:
            current = self._scan(component)
            for iid, inst in known.items():
                if iid not in current or current[iid] != inst:
                    yield DiscoveryEvent(EventKind.REMOVED, inst)
            for iid, inst in current.items():
                if known.get(iid) != inst:
                    yield DiscoveryEvent(EventKind.ADDED, inst)
            known = current
            await asyncio.sleep(self.poll_s)


class _NoRegistration:
    async def close(self) -> None:
        return None


class StaticDiscovery:
    """A fixed set of worker addresses; registration is a no-op."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def register(self, instance: Instance) -> Registration:
        return _NoRegistration()

    async def watch(self, component: str = "worker") -> AsyncIterator[DiscoveryEvent]:
        if component == "worker":
            for addr in self.addresses:
                yield DiscoveryEvent(EventKind.ADDED, Instance(instance_id=addr, address=addr))
        await asyncio.Event().wait()  # static: nothing ever changes
