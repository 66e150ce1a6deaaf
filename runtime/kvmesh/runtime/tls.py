"""Certificates: the mesh's TLS settings, loading and checking PEM files, reloading them when
they change on disk, and a throwaway CA for one machine (`kvmesh up --tls`).

`TlsConfig` is the one config dataclass every process (worker, router, frontend, `kvmesh up`,
planner) shares for its mesh links; `kvmesh.runtime.grpcutil.MeshSecurity` turns it into gRPC
credentials and the authorization of mesh servers.

`TlsFiles.load()` reads a certificate chain, its key and a CA bundle and checks them the way a
peer would, so a bad file stops a process at start-up with a message that names the flag, the
file and what is wrong (missing, not PEM, expired, not yet valid, key does not match, not
signed by the CA) instead of failing at its first request. `ReloadingTls` re-reads the files
when they change (checked at most once a second, when a handshake or a new call asks for them)
and keeps serving the previous material, with a warning, while the new files do not pass the
same checks (e.g. a certificate replaced before its key).
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.runtime.config import ConfigError, opt

if TYPE_CHECKING:  # imported where used: `cryptography.x509` alone costs ~60 ms of start-up
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = [
    "DevPki",
    "ReloadingTls",
    "ServerSslContext",
    "TlsConfig",
    "TlsError",
    "TlsFiles",
    "TlsMaterial",
    "write_dev_pki",
]

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 1.0
"""How often, at most, the files behind a ReloadingTls are looked at again."""

MESH_TOKEN_ENV = "KVMESH_MESH_TOKEN"
"""Environment variable that may hold the shared mesh token instead of --mesh-token-file."""


class TlsError(ConfigError):
    """A certificate, key or CA file that cannot be used (the message says which and why)."""


@dataclass
class TlsConfig:
    """TLS and authentication of the mesh's own gRPC links (workers, routers, `kvmesh up`'s
    ScalingService, the planner). With --tls-cert, --tls-key and --tls-ca every mesh server and
    client uses mTLS: servers accept only clients whose certificate the CA signed (and, with
    --mesh-identities, only those identities); files are reloaded when they change. Without
    TLS, --mesh-token-file (or $KVMESH_MESH_TOKEN) makes mesh servers accept only calls that
    carry that shared token."""

    tls_cert: str = opt(
        "",
        "PEM certificate (chain) this process presents on mesh links, as server and as client; "
        "with --tls-key and --tls-ca: mTLS on every mesh link; empty: plaintext",
    )
    tls_key: str = opt("", "PEM private key of --tls-cert (unencrypted)")
    tls_ca: str = opt(
        "", "PEM CA bundle that mesh peers' certificates (servers' and clients') must chain to"
    )
    mesh_identities: list[str] = opt(
        [],
        "identities allowed to call mesh servers: a client certificate's subject common name "
        "or one of its subject alternative names (DNS, URI such as spiffe://..., IP); empty: "
        "any certificate --tls-ca signed",
    )
    tls_server_name: str = opt(
        "",
        "name mesh clients check in servers' certificates instead of the host they dial (for "
        "servers dialed by IP, e.g. Kubernetes pod IPs: give every certificate this DNS SAN); "
        "empty: the dialed host",
    )
    mesh_token_file: str = opt(
        "",
        "without TLS: a file holding a shared secret that every mesh call must carry (opt-in; "
        f"${MESH_TOKEN_ENV} works too); empty: mesh servers accept any caller",
    )

    def __post_init__(self) -> None:
        given = {"--tls-cert": self.tls_cert, "--tls-key": self.tls_key, "--tls-ca": self.tls_ca}
        missing = [flag for flag, value in given.items() if not value]
        if 0 < len(missing) < len(given):
            raise ValueError(
                "mesh TLS needs all of --tls-cert, --tls-key and --tls-ca (mTLS); missing: "
                + ", ".join(missing)
            )
        if self.tls_server_name and not self.tls_cert:
            raise ValueError("--tls-server-name needs mesh TLS (--tls-cert, --tls-key, --tls-ca)")
        if self.mesh_identities and not self.tls_cert:
            raise ValueError("--mesh-identities needs mesh TLS (--tls-cert, --tls-key, --tls-ca)")

    @property
    def enabled(self) -> bool:
        """Whether mesh links use mTLS."""
        return bool(self.tls_cert)

    def files(self) -> TlsFiles:
        """The certificate, key and CA files (mesh TLS must be enabled)."""
        return TlsFiles(
            Path(self.tls_cert),
            Path(self.tls_key),
            Path(self.tls_ca),
            flags=("--tls-cert", "--tls-key", "--tls-ca"),
        )

    def token(self) -> bytes | None:
        """The shared mesh token (from --mesh-token-file or $KVMESH_MESH_TOKEN), or None.

        Raises TlsError when it is set together with TLS, or is empty or unreadable."""
        env = os.environ.get(MESH_TOKEN_ENV, "")
        if not self.mesh_token_file and not env:
            return None
        if self.enabled:
            raise TlsError(
                f"the mesh token (--mesh-token-file or ${MESH_TOKEN_ENV}) is for meshes without "
                "TLS; with --tls-cert, identities come from client certificates: set one or the "
                "other"
            )
        if self.mesh_token_file:
            token = _read(Path(self.mesh_token_file), "--mesh-token-file").strip()
            where = f"--mesh-token-file {self.mesh_token_file}"
        else:
            token, where = env.strip().encode(), f"${MESH_TOKEN_ENV}"
        if len(token) < 16:
            raise TlsError(f"the mesh token in {where} is too short (at least 16 characters)")
        return token


@dataclass(frozen=True)
class TlsMaterial:
    """Checked PEM bytes of one certificate chain, its key and (optionally) a CA bundle."""

    cert_chain: bytes
    key: bytes
    ca: bytes | None
    identities: tuple[str, ...]
    """The leaf certificate's subject common name and subject alternative names."""
    not_after: datetime.datetime
    """When the leaf certificate expires (UTC)."""


@dataclass(frozen=True)
class TlsFiles:
    """Where a certificate chain, its key and a CA bundle live; `flags` name them in errors.
    `chain_to_ca`: the certificate must be signed by the CA (mesh certificates are; a client
    certificate for etcd may come from another CA than etcd's server certificate)."""

    cert: Path
    key: Path
    ca: Path | None = None
    flags: tuple[str, str, str] = ("certificate", "key", "CA")
    chain_to_ca: bool = True

    def stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What changes when any of the files is replaced (inode, size, mtime)."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.cert, self.key, self.ca):
            try:
                st = path.stat() if path is not None else None
            except OSError:
                st = None
            out.append((st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None)
        return tuple(out)

    def load(self, now: datetime.datetime | None = None) -> TlsMaterial:
        """Read and check the files; raises TlsError that says which file is wrong and why."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization

        cert_flag, key_flag, ca_flag = self.flags
        now = now or datetime.datetime.now(datetime.UTC)
        chain_pem = _read(self.cert, cert_flag)
        key_pem = _read(self.key, key_flag)
        ca_pem = _read(self.ca, ca_flag) if self.ca is not None else None
        chain = _certificates(chain_pem, cert_flag, self.cert)
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except TypeError as exc:  # encrypted
            raise TlsError(f"{key_flag} {self.key}: the key is encrypted ({exc})") from exc
        except ValueError as exc:
            raise TlsError(f"{key_flag} {self.key}: not a PEM private key ({exc})") from exc
        leaf = chain[0]
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        der = serialization.Encoding.DER
        if key.public_key().public_bytes(der, spki) != leaf.public_key().public_bytes(der, spki):
            raise TlsError(
                f"{key_flag} {self.key} does not match the certificate in {cert_flag} "
                f"{self.cert} ({_describe(leaf)})"
            )
        for cert in chain:
            _check_validity(cert, now, f"{cert_flag} {self.cert}")
        for lower, upper in itertools.pairwise(chain):
            try:
                lower.verify_directly_issued_by(upper)
            except (ValueError, TypeError, InvalidSignature) as exc:
                raise TlsError(
                    f"{cert_flag} {self.cert}: {_describe(lower)} is not signed by the next "
                    f"certificate of the chain, {_describe(upper)}"
                ) from exc
        if ca_pem is not None:
            assert self.ca is not None
            cas = _certificates(ca_pem, ca_flag, self.ca)
            for ca in cas:
                _check_validity(ca, now, f"{ca_flag} {self.ca}")
            top = chain[-1]
            if self.chain_to_ca and not any(_issued_by(top, ca) for ca in cas):
                raise TlsError(
                    f"{cert_flag} {self.cert}: {_describe(top)} is not signed by a CA of "
                    f"{ca_flag} {self.ca} (" + "; ".join(_describe(ca) for ca in cas) + ")"
                )
        return TlsMaterial(
            cert_chain=chain_pem,
            key=key_pem,
            ca=ca_pem,
            identities=identities_of(leaf),
            not_after=leaf.not_valid_after_utc,
        )


def identities_of(cert: x509.Certificate) -> tuple[str, ...]:
    """A certificate's subject common name(s) and subject alternative names (DNS, URI, IP,
    email), the strings `--mesh-identities` is matched against."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return tuple(names)
    for kind in (x509.DNSName, x509.UniformResourceIdentifier, x509.RFC822Name):
        names += [str(v) for v in san.get_values_for_type(kind)]
    names += [str(v) for v in san.get_values_for_type(x509.IPAddress)]
    return tuple(names)


def _read(path: Path, flag: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read {flag} {path}: {exc.strerror or exc}") from exc
    if not data.strip():
        raise TlsError(f"{flag} {path} is empty")
    return data


def _certificates(pem: bytes, flag: str, path: Path) -> list[x509.Certificate]:
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise TlsError(f"{flag} {path}: no PEM certificate in it ({exc})") from exc
    return certs


def _describe(cert: x509.Certificate) -> str:
    return f"'{cert.subject.rfc4514_string()}' (serial {cert.serial_number:x})"


def _check_validity(cert: x509.Certificate, now: datetime.datetime, where: str) -> None:
    if now > cert.not_valid_after_utc:
        raise TlsError(f"{where}: {_describe(cert)} expired on {_utc(cert.not_valid_after_utc)}")
    if now < cert.not_valid_before_utc:
        raise TlsError(
            f"{where}: {_describe(cert)} is not valid before {_utc(cert.not_valid_before_utc)}"
        )


def _utc(when: datetime.datetime) -> str:
    return f"{when:%Y-%m-%d %H:%M:%S} UTC"


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    from cryptography.exceptions import InvalidSignature

    if cert == ca:
        return True  # the chain ends with the CA certificate itself
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


class ReloadingTls:
    """The current TlsMaterial of some TlsFiles, re-read when the files change.

    `current()` is cheap: it looks at the files at most every `check_s` seconds (a stat each),
    and loads them again only when one changed. New files that fail `TlsFiles.load` are logged
    once and ignored; the previous material stays in use. `generation` counts successful
    loads, so users rebuild what they derived from the material only when it changed.
    Thread-safe (gRPC asks for server certificates from its own threads).
    """

    def __init__(
        self,
        files: TlsFiles,
        *,
        check_s: float = RELOAD_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Loads the files now: raises TlsError when they cannot be used."""
        self.files = files
        self._check_s = check_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamp = files.stamp()
        self._material = files.load()
        self._rejected: tuple[tuple[int, int, int] | None, ...] | None = None
        self._next_check = clock() + check_s
        self.generation = 0

    def current(self) -> tuple[int, TlsMaterial]:
        """(generation, material): the files as of the last successful load."""
        now = self._clock()
        if now < self._next_check:
            return self.generation, self._material
        with self._lock:
            if now >= self._next_check:
                self._next_check = now + self._check_s
                self._maybe_reload()
            return self.generation, self._material

    def _maybe_reload(self) -> None:
        stamp = self.files.stamp()
        if stamp == self._stamp or stamp == self._rejected:
            return
        try:
            material = self.files.load()
        except TlsError as exc:
            self._rejected = stamp
            log.warning("not reloading TLS files: %s; the previous certificate stays in use", exc)
            return
        self._stamp, self._rejected = stamp, None
        self._material = material
        self.generation += 1
        log.info(
            "reloaded TLS certificate %s (%s, valid until %s)",
            self.files.cert,
            ", ".join(material.identities) or "no identities",
            _utc(material.not_after),
        )


class ServerSslContext:
    """An ssl.SSLContext for a TLS server (the gateway's HTTPS) that follows a ReloadingTls.

    Give `context` to the server. Each handshake asks for the current material (its SNI
    callback runs for every ClientHello, with or without a server name) and, when the files
    were reloaded, switches the connection to a context built from them, so new connections
    get the new certificate and open ones are left alone. `require_client_certificate`: the
    client must present a certificate the material's CA signed (mTLS).
    """

    def __init__(self, tls: ReloadingTls, *, require_client_certificate: bool = False) -> None:
        self._tls = tls
        self._require = require_client_certificate
        generation, material = tls.current()
        self.context = self._build(material)
        self.context.sni_callback = self._on_hello
        self._current = (generation, self.context)

    def _build(self, material: TlsMaterial) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # The checked bytes, not the paths: the files may have changed since they were read.
        fd = os.memfd_create("kvmesh-tls", os.MFD_CLOEXEC)
        try:
            os.write(fd, material.cert_chain + b"\n" + material.key)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        if self._require:
            if material.ca is None:
                raise TlsError("client certificates need a CA to check them against")
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=material.ca.decode())
        return ctx

    def _on_hello(self, conn: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: object) -> None:
        generation, ctx = self._current
        latest, material = self._tls.current()
        if latest != generation:
            try:
                ctx = self._build(material)
            except (ssl.SSLError, OSError, TlsError) as exc:  # keep the previous one
                log.warning("cannot use the reloaded TLS certificate: %s", exc)
            self._current = (latest, ctx)
        if ctx is not self.context:
            conn.context = ctx


# --- a throwaway CA for one machine -----------------------------------------------------------

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names every certificate of a DevPki is valid for (servers listen on loopback)."""


@dataclass(frozen=True)
class DevPki:
    """Files of a throwaway CA and one certificate per identity (`write_dev_pki`)."""

    directory: Path
    ca: Path
    """The CA certificate (PEM): what clients and servers trust."""
    ca_key: Path

    def cert(self, identity: str) -> Path:
        """The certificate of `identity`."""
        return self.directory / f"{identity}.pem"

    def key(self, identity: str) -> Path:
        """The private key of `identity`'s certificate."""
        return self.directory / f"{identity}-key.pem"

    def files(self, identity: str) -> TlsFiles:
        """`identity`'s certificate and key with the CA."""
        return TlsFiles(self.cert(identity), self.key(identity), self.ca)

    def config(self, identity: str, identities: Sequence[str] = ()) -> TlsConfig:
        """A TlsConfig that presents `identity` and lets `identities` call its servers."""
        return TlsConfig(
            tls_cert=str(self.cert(identity)),
            tls_key=str(self.key(identity)),
            tls_ca=str(self.ca),
            mesh_identities=list(identities),
        )

    def issue(
        self,
        identity: str,
        *,
        hosts: Sequence[str] = LOCAL_HOSTS,
        valid_from: datetime.datetime | None = None,
        valid_for: datetime.timedelta = datetime.timedelta(days=365),
    ) -> TlsFiles:
        """(Re)issue `identity`'s certificate and key with this CA (replacing the files
        atomically: the key first, then the certificate)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        ca_cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        key = _new_key()
        cert = _sign(
            _name(identity),
            key.public_key(),
            ca_cert.subject,
            ca_key,
            valid_from=valid_from,
            valid_for=valid_for,
            ca=False,
            hosts=hosts,
        )
        _write(self.key(identity), _key_pem(key), private=True)
        _write(self.cert(identity), cert.public_bytes(serialization.Encoding.PEM))
        return self.files(identity)


def write_dev_pki(
    directory: Path,
    identities: Sequence[str],
    *,
    hosts: Sequence[str] = LOCAL_HOSTS,
    valid_for: datetime.timedelta = datetime.timedelta(days=365),
) -> DevPki:
    """Create a new CA in `directory` and one certificate per identity (subject CN = the
    identity, valid for `hosts`, usable as TLS server and client). Keys are written 0600.

    For one machine and for tests: the CA key sits next to the certificates."""
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _new_key()
    name = _name(f"kvmesh throwaway CA {os.getpid()}-{time.time_ns():x}")
    ca_cert = _sign(name, ca_key.public_key(), name, ca_key, valid_for=valid_for, ca=True)
    pki = DevPki(directory, directory / "ca.pem", directory / "ca-key.pem")
    _write(pki.ca_key, _key_pem(ca_key), private=True)
    _write(pki.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
    for identity in identities:
        pki.issue(identity, hosts=hosts, valid_for=valid_for)
    return pki


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sign(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    valid_for: datetime.timedelta,
    ca: bool,
    valid_from: datetime.datetime | None = None,
    hosts: Sequence[str] = (),
) -> x509.Certificate:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    start = valid_from or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + valid_for)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Replace `path` atomically (a reader sees the old or the new file, never half of one)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
