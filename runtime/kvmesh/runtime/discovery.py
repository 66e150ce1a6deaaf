"""Service discovery: workers register under a lease; frontends and routers watch.

Backends, chosen by URL:
- `file:///dir` — the embedded default for one machine (`kvmesh up`): one JSON file per
  instance, refreshed while its lease lives; a file not refreshed within its TTL is expired,
  so a killed worker disappears without anyone cleaning up.
- `static://host:port,host:port` — a fixed list of worker addresses (no registration).
- `etcd://host:port[,host:port...][?prefix=/kvmesh&ttl=5]` — etcd with leases and watches, for
  many machines (`EtcdDiscovery`; needs the `aetcd` client, the `etcd` extra). Over TLS with
  `cacert=CA.pem` (etcd's `--trusted-ca-file`), plus `cert=...&key=...` for client certificate
  authentication (etcd's `--client-cert-auth`); the files are checked when the URL is opened
  and reloaded when they change.

`open_discovery` is the only place that knows the backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import ParseResult, parse_qs, urlparse

import grpc

from kvmesh.runtime.errors import InvalidRequest, Unavailable, Unimplemented
from kvmesh.runtime.tls import ReloadingTls, TlsError, TlsFiles

log = logging.getLogger(__name__)

K = TypeVar("K")


WORKER = "worker"
"""The component workers register as."""
ROUTER = "router"
"""The component KV routers that share their bookings register as (RouterService:
`kvmesh router`, a frontend with --router-sync-port), for replicas with --router-peers-discovery."""


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


FILE_DEFAULT_TTL_S = 3.0
ETCD_DEFAULT_TTL_S = 5
ETCD_DEFAULT_PORT = 2379
ETCD_DEFAULT_PREFIX = "/kvmesh"


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


class _BackgroundRegistration:
    """`register_in_background`'s registration."""

    def __init__(self, discovery: Discovery, instance: Instance, retry_max_s: float) -> None:
        self._registration: Registration | None = None
        self._task = asyncio.get_running_loop().create_task(
            self._register(discovery, instance, retry_max_s),
            name=f"register {instance.component} {instance.instance_id}",
        )

    async def _register(self, discovery: Discovery, instance: Instance, retry_max_s: float) -> None:
        delay = 0.2
        failures = 0
        while True:
            try:
                self._registration = await discovery.register(instance)
            except (Unavailable, OSError) as exc:
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                what = f"{instance.component} {instance.instance_id}"
                log.log(level, "%s not registered yet (%s); retrying", what, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, retry_max_s)
                continue
            if failures:
                log.info("%s %s registered", instance.component, instance.instance_id)
            return

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if self._registration is not None:
            await self._registration.close()


def register_in_background(
    discovery: Discovery, instance: Instance, retry_max_s: float = 5.0
) -> Registration:
    """Register `instance` now or, while discovery cannot take it (etcd down), as soon as it
    can (retried, backing off to `retry_max_s`), without failing the caller: for services that
    serve without being registered (a router its peers find). Needs a running event loop."""
    return _BackgroundRegistration(discovery, instance, retry_max_s)


def open_discovery(url: str, *, ttl_s: float | None = None, poll_s: float = 0.2) -> Discovery:
    """Build the discovery backend named by `url`.

    `ttl_s`: lease TTL; None: the backend's default (file 3 s, etcd 5 s). An etcd URL's
    `?ttl=` wins over it.
    """
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return FileDiscovery(
            Path(parsed.path), ttl_s=FILE_DEFAULT_TTL_S if ttl_s is None else ttl_s, poll_s=poll_s
        )
    if parsed.scheme == "static":
        addresses = [a for a in (parsed.netloc + parsed.path).split(",") if a]
        if not addresses:
            raise InvalidRequest("static:// discovery needs at least one host:port")
        return StaticDiscovery(addresses)
    if parsed.scheme == "etcd":
        return _etcd_from_url(parsed, ttl_s)
    raise InvalidRequest(
        f"unknown discovery URL {url!r} (use file:///dir, static://h:p,... or etcd://h:p,...)"
    )


def _diff(known: Mapping[K, Instance], current: Mapping[K, Instance]) -> list[DiscoveryEvent]:
    """Events that turn `known` into `current`: REMOVED first, then ADDED (a changed instance
    is removed and added again)."""
    events = [
        DiscoveryEvent(EventKind.REMOVED, inst)
        for k, inst in known.items()
        if current.get(k) != inst
    ]
    events += [
        DiscoveryEvent(EventKind.ADDED, inst) for k, inst in current.items() if known.get(k) != inst
    ]
    return events


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
            for event in _diff(known, current):
                yield event
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


# --- etcd -------------------------------------------------------------------------------------

# gRPC keepalive notices a dead connection under an idle watch (etcd accepts pings every 5 s
# on a stream); gRPC's own reconnect backoff is kept short, the backoff is ours. Each client
# has subchannels of its own: from gRPC's process-wide pool, a new client made to reconnect
# after etcd came back would take over the old one's connection still in reconnect backoff
# and fail at once ("failed to connect to all addresses"), as a worker registering just after
# an etcd restart did.
_ETCD_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1_000,
    "grpc.enable_retries": 0,
}
_ETCD_BACKOFF_MIN_S = 0.1
_ETCD_BACKOFF_MAX_S = 2.0
_ETCD_RELIST_S = 0.25
"""How often a watcher lists again while instances it knew are missing after a reconnect."""
_ETCD_WARN_EVERY = 20
"""While etcd stays unreachable, every this many failed attempts is logged as a warning again."""
_ETCD_URL_FORM = (
    "etcd://host:port[,host:port...][?prefix=/kvmesh&ttl=5][&cacert=CA.pem[&cert=C.pem&key=K.pem]]"
)


def _etcd_from_url(parsed: ParseResult, ttl_s: float | None) -> EtcdDiscovery:
    if parsed.path not in ("", "/") or parsed.params or parsed.fragment:
        raise InvalidRequest(f"etcd discovery URL must look like {_ETCD_URL_FORM}")
    endpoints = [_etcd_endpoint(e) for e in parsed.netloc.split(",") if e]
    if not endpoints:
        raise InvalidRequest(f"etcd discovery needs at least one host:port ({_ETCD_URL_FORM})")
    query = parse_qs(parsed.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"prefix", "ttl", "cacert", "cert", "key"})
    if unknown:
        raise InvalidRequest(
            f"unknown etcd discovery option(s) {unknown} (known: prefix, ttl, cacert, cert, key)"
        )
    prefix = query.get("prefix", [ETCD_DEFAULT_PREFIX])[-1]
    lease_ttl = ETCD_DEFAULT_TTL_S if ttl_s is None else max(1, math.ceil(ttl_s))
    if "ttl" in query:
        text = query["ttl"][-1]
        if not text.isdigit() or int(text) < 1:
            raise InvalidRequest(f"etcd ttl must be a whole number of seconds >= 1, got {text!r}")
        lease_ttl = int(text)
    files = {k: query[k][-1] for k in ("cacert", "cert", "key") if query.get(k, [""])[-1]}
    return EtcdDiscovery(endpoints, prefix=prefix, ttl_s=lease_ttl, tls=_etcd_tls(files))


def _etcd_tls(files: Mapping[str, str]) -> EtcdTls | None:
    """The TLS of an etcd URL's `cacert`, `cert` and `key` options (None: plaintext)."""
    if not files:
        return None
    if "cacert" not in files or ("cert" in files) != ("key" in files):
        raise InvalidRequest(
            "etcd over TLS needs cacert=, and cert= with key= for a client certificate "
            f"({_ETCD_URL_FORM})"
        )
    flags = ("etcd cert=", "etcd key=", "etcd cacert=")
    if "cert" in files:
        cert, key, ca = (Path(files[k]) for k in ("cert", "key", "cacert"))
        # etcd may trust another CA for clients than the one that signed its own certificate.
        return EtcdTls(ReloadingTls(TlsFiles(cert, key, ca, flags, chain_to_ca=False)))
    try:
        ca_pem = Path(files["cacert"]).read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read etcd cacert= {files['cacert']}: {exc.strerror}") from exc
    return EtcdTls(None, ca_pem)


class EtcdTls:
    """TLS credentials for etcd clients: a CA only, or a client certificate that is reloaded
    when its files change (each new client connects with the current one)."""

    def __init__(self, client: ReloadingTls | None, ca: bytes | None = None) -> None:
        self._client = client
        self._ca = ca

    def credentials(self) -> grpc.ChannelCredentials:
        """Credentials for a new connection."""
        if self._client is None:
            return grpc.ssl_channel_credentials(self._ca)
        _, m = self._client.current()
        return grpc.ssl_channel_credentials(m.ca, m.key, m.cert_chain)


def _etcd_endpoint(text: str) -> tuple[str, int]:
    """'host', 'host:port' or '[v6]:port' -> (host for a gRPC target, port)."""
    try:
        parts = urlparse("//" + text)
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise InvalidRequest(f"bad etcd endpoint {text!r}: {exc}") from exc
    if not host:
        raise InvalidRequest(f"bad etcd endpoint {text!r} ({_ETCD_URL_FORM})")
    return (f"[{host}]" if ":" in host else host), port or ETCD_DEFAULT_PORT


@functools.cache
def _tls_client() -> type[Any]:
    """aetcd.Client over TLS. aetcd 1.0 only dials plaintext: this subclass opens a secure
    channel instead and builds the same stubs on it (the attributes aetcd's methods use)."""
    import aetcd
    from aetcd import rpc, watcher

    class TlsClient(aetcd.Client):  # type: ignore[misc]
        def __init__(self, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._kvmesh_credentials = credentials

        async def connect(self) -> None:
            if self._connected.is_set():
                return
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            self.channel = grpc.aio.secure_channel(target, self._kvmesh_credentials, options)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()

    return TlsClient


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _decode_instance(key: bytes, value: bytes) -> Instance | None:
    """The Instance stored at `key`; None (logged) when the value is not one."""
    try:
        data = json.loads(value)
        names = {f.name for f in fields(Instance)}  # unknown fields: written by a newer kvmesh
        return Instance(**{k: v for k, v in data.items() if k in names})
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring malformed registration at %r: %s", key, exc)
        return None


async def _close_client(client: Any) -> None:
    try:
        await client.close()
    except Exception as exc:  # closing a client whose connection already failed
        log.debug("closing the etcd client failed: %s", _describe(exc))


class EtcdDiscovery:
    """Discovery through etcd, for many machines.

    Each registration holds a lease of its own (`ttl_s` whole seconds) and refreshes it every
    ttl/3. Its key, `{prefix}/v1/instances/{component}/{instance_id}`, holds the Instance as
    JSON and is attached to the lease, so etcd deletes it when the registration is closed
    (the lease is revoked) or its owner stops refreshing (killed, or cut off from etcd for
    longer than the TTL). A registration that finds its lease gone registers again.

    `watch` reads the component's keys, yields ADDED for each, then follows an etcd watch that
    starts at the revision right after that read, so nothing in between is missed. When the
    watch breaks (etcd restarted, connection lost) it reconnects with backoff, trying the
    endpoints in turn, reads again and yields REMOVED/ADDED for whatever changed meanwhile
    (an instance missing from that read is given a lease TTL to come back first: `_list`).

    Nothing connects until `register` or the first step of a `watch`; each registration and
    each watch has its own client, closed with it.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        prefix: str = ETCD_DEFAULT_PREFIX,
        ttl_s: int = ETCD_DEFAULT_TTL_S,
        request_timeout_s: float = 3.0,
        tls: EtcdTls | None = None,
    ) -> None:
        """`endpoints`: (host, port) of etcd members, tried in turn; `request_timeout_s`: the
        deadline of each etcd call; `tls`: connect over TLS (None: plaintext)."""
        try:
            import aetcd
        except ImportError as exc:
            raise Unimplemented(
                "etcd discovery needs the aetcd client: pip install 'kvmesh[etcd]'"
            ) from exc
        if not endpoints:
            raise InvalidRequest("etcd discovery needs at least one endpoint")
        if ttl_s < 1:
            raise InvalidRequest(f"etcd lease TTL must be at least 1 s, got {ttl_s}")
        self._aetcd: Any = aetcd
        self.endpoints = list(endpoints)
        self.prefix = "/" + prefix.strip("/") if prefix.strip("/") else ""
        self.ttl_s = ttl_s
        self.request_timeout_s = request_timeout_s
        self.tls = tls

    @property
    def where(self) -> str:
        """The endpoints, for messages."""
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def key(self, component: str, instance_id: str) -> bytes:
        """The etcd key of an instance."""
        return f"{self.key_prefix(component)}{instance_id}".encode()

    def key_prefix(self, component: str) -> str:
        """The etcd key prefix of a component's instances."""
        return f"{self.prefix}/v1/instances/{component}/"

    def connect(self, attempt: int) -> tuple[Any, str]:
        """A new client (connecting lazily) and its host:port; `attempt` picks the endpoint, so
        counting failed attempts tries the endpoints in turn."""
        host, port = self.endpoints[attempt % len(self.endpoints)]
        kwargs: dict[str, Any] = {
            "host": host,
            "port": port,
            "timeout": self.request_timeout_s,
            "options": dict(_ETCD_CHANNEL_OPTIONS),
        }
        if self.tls is None:
            return self._aetcd.Client(**kwargs), f"{host}:{port}"
        return _tls_client()(self.tls.credentials(), **kwargs), f"{host}:{port}"

    async def register(self, instance: Instance) -> Registration:
        """Put `instance` under a new lease and keep the lease alive until closed.

        Raises Unavailable when no endpoint answers.
        """
        reg = _EtcdRegistration(self, instance)
        await reg.start()
        return reg

    async def watch(self, component: str = "worker") -> AsyncIterator[DiscoveryEvent]:
        prefix = self.key_prefix(component).encode()
        known: dict[bytes, Instance] = {}
        delay = _ETCD_BACKOFF_MIN_S
        failures = attempt = 0
        while True:
            client, where = self.connect(attempt)
            try:
                listing, current = await self._list(client, prefix, known)
                for event in _diff(known, current):
                    yield event
                known = current
                stream = await client.watch_prefix(
                    prefix, start_revision=int(listing.header.revision) + 1
                )
                if failures:
                    log.info("etcd watch of %r re-established via %s", component, where)
                failures, delay = 0, _ETCD_BACKOFF_MIN_S
                async for change in stream:
                    key = bytes(change.kv.key)
                    old = known.get(key)
                    new = _decode_instance(key, change.kv.value) if change.kind == "PUT" else None
                    if new == old:
                        continue
                    if new is None:
                        del known[key]
                    else:
                        known[key] = new
                    if old is not None:
                        yield DiscoveryEvent(EventKind.REMOVED, old)
                    if new is not None:
                        yield DiscoveryEvent(EventKind.ADDED, new)
                raise ConnectionError("the watch stream ended")
            except Exception as exc:  # etcd down or restarted, connection lost, compaction
                failures += 1
                level = logging.WARNING if failures % _ETCD_WARN_EVERY == 1 else logging.DEBUG
                log.log(
                    level,
                    "etcd watch of %r via %s failed (%s); reconnecting",
                    component,
                    where,
                    _describe(exc),
                )
            finally:
                await _close_client(client)
            attempt += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, _ETCD_BACKOFF_MAX_S)

    async def _list(
        self, client: Any, prefix: bytes, known: Mapping[bytes, Instance]
    ) -> tuple[Any, dict[bytes, Instance]]:
        """The prefix's listing and its instances. After a reconnect (`known` not empty), an
        instance missing from it is given up to a lease TTL to appear again before the listing
        is taken: an etcd that restarted without its data has lost every key, and each live
        registration puts its own back within that time. Without the wait the watcher would
        remove every instance until they did (a mesh with no workers for a moment); an instance
        that is really gone is removed a TTL later, as its lease would have expired anyway."""
        deadline = asyncio.get_running_loop().time() + self.ttl_s
        while True:
            listing = await client.get_prefix(prefix)
            current: dict[bytes, Instance] = {}
            for kv in listing:
                inst = _decode_instance(kv.key, kv.value)
                if inst is not None:
                    current[bytes(kv.key)] = inst
            missing = known.keys() - current.keys()
            if not missing or asyncio.get_running_loop().time() >= deadline:
                return listing, current
            await asyncio.sleep(_ETCD_RELIST_S)


class _EtcdRegistration:
    """One instance's key under a lease of its own, kept alive until closed."""

    def __init__(self, discovery: EtcdDiscovery, instance: Instance) -> None:
        self._d = discovery
        self._label = f"{instance.component} {instance.instance_id!r}"
        self._key = discovery.key(instance.component, instance.instance_id)
        self._value = json.dumps(asdict(instance), sort_keys=True).encode()
        self._client: Any = None
        self._attempt = 0
        """Counts failures; picks the endpoint of the next client."""
        self.lease_id: int | None = None
        """The lease holding the key; None while it has to be (re)created."""
        self._orphan_lease: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self) -> None:
        failed: list[str] = []
        for _ in self._d.endpoints:
            self._client, where = self._d.connect(self._attempt)
            try:
                await self._grant_and_put()
                break
            except Exception as exc:
                failed.append(f"{where}: {_describe(exc)}")
                await _close_client(self._client)
                self._attempt += 1
        else:
            raise Unavailable(
                f"cannot register {self._label} in etcd (is etcd running at {self._d.where}?): "
                + "; ".join(failed)
            )
        self._task = asyncio.create_task(self._keepalive(), name=f"etcd-lease {self._label}")

    async def _grant_and_put(self) -> None:
        lease = await self._client.lease(self._d.ttl_s)
        lease_id = int(lease.id)
        try:
            put = await self._client.put(self._key, self._value, lease=lease_id, prev_kv=True)
        except BaseException:
            self._orphan_lease = lease_id  # the put may have landed: revoked on close
            raise
        self.lease_id = lease_id
        prev = put.prev_kv
        if prev is not None and prev.lease and prev.lease != lease_id:
            log.info(
                "%s replaced a registration under lease %x (restarted within the TTL, or "
                "another process uses the same id)",
                self._label,
                prev.lease,
            )
        log.debug("%s registered under lease %x (ttl %d s)", self._label, lease_id, lease.ttl)

    async def _keepalive(self) -> None:
        period = self._d.ttl_s / 3
        failures = 0
        while True:
            await asyncio.sleep(min(period, 0.5) if failures else period)
            try:
                # Bounded, so an unresponsive endpoint is left in time for the next one to
                # refresh the lease before it expires.
                async with asyncio.timeout(max(period, 1.0)):
                    await self._refresh()
            except Exception as exc:  # connection lost, etcd restarting: retry, next endpoint
                failures += 1
                if failures % _ETCD_WARN_EVERY == 1:
                    log.warning(
                        "etcd keepalive of %s failed (%s); retrying", self._label, _describe(exc)
                    )
                await _close_client(self._client)
                self._attempt += 1
                self._client, _ = self._d.connect(self._attempt)
                continue
            if failures:
                log.info("etcd keepalive of %s recovered", self._label)
            failures = 0

    async def _refresh(self) -> None:
        if self.lease_id is not None:
            resp = await self._client.refresh_lease(self.lease_id)
            if int(resp.TTL) > 0:
                return
            log.warning("etcd lease of %s expired; registering again", self._label)
            self.lease_id = None
        await self._grant_and_put()
        log.info("%s registered again under lease %x", self._label, self.lease_id)

    async def close(self) -> None:
        """Stop refreshing and revoke the lease (etcd deletes the key at once)."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for lease_id, orphan in ((self._orphan_lease, True), (self.lease_id, False)):
            if lease_id is None:
                continue
            try:
                await self._client.revoke_lease(lease_id)
            except Exception as exc:
                if orphan or "lease not found" in str(exc):  # expired: its key is gone already
                    log.debug("revoking lease %x of %s: %s", lease_id, self._label, exc)
                    continue
                log.warning(
                    "could not revoke the etcd lease of %s (%s); it expires within %d s",
                    self._label,
                    _describe(exc),
                    self._d.ttl_s,
                )
        await _close_client(self._client)
