"""Certificate files: the checks a bad file fails at start-up (with the flag, the file and the
reason in the message), reloading on change, the mesh token, and `kvmesh up --tls`'s CA."""

from __future__ import annotations

import datetime
import logging
import os
from pathlib import Path

import pytest
from cryptography import x509

from kvmesh.runtime.grpcutil import MeshSecurity
from kvmesh.runtime.tls import (
    MESH_TOKEN_ENV,
    DevPki,
    ReloadingTls,
    TlsConfig,
    TlsError,
    TlsFiles,
    write_dev_pki,
)

DAY = datetime.timedelta(days=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return write_dev_pki(tmp_path_factory.mktemp("pki"), ["kvmesh-worker", "kvmesh-planner"])


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return write_dev_pki(tmp_path_factory.mktemp("other"), ["kvmesh-worker"])


def test_dev_pki_certificates_load_with_their_identities(pki: DevPki) -> None:
    material = pki.config("kvmesh-worker").files().load()
    assert material.identities == ("kvmesh-worker", "localhost", "127.0.0.1", "::1")
    assert material.ca == pki.ca.read_bytes()
    assert material.not_after > datetime.datetime.now(datetime.UTC) + 300 * DAY
    assert os.stat(pki.key("kvmesh-worker")).st_mode & 0o777 == 0o600
    assert os.stat(pki.ca_key).st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate(pki.cert("kvmesh-worker").read_bytes())
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def _files(cert: Path, key: Path, ca: Path) -> TlsFiles:
    return TlsConfig(tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca)).files()


def test_missing_and_empty_files_name_the_flag_and_path(pki: DevPki, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match=r"cannot read --tls-cert .*nope\.pem: No such file"):
        _files(tmp_path / "nope.pem", pki.key("kvmesh-worker"), pki.ca).load()
    (tmp_path / "empty.pem").write_bytes(b"\n")
    with pytest.raises(TlsError, match=r"--tls-ca .*empty\.pem is empty"):
        _files(pki.cert("kvmesh-worker"), pki.key("kvmesh-worker"), tmp_path / "empty.pem").load()
    (tmp_path / "junk.pem").write_bytes(b"not a certificate")
    with pytest.raises(TlsError, match=r"--tls-cert .*junk\.pem: no PEM certificate"):
        _files(tmp_path / "junk.pem", pki.key("kvmesh-worker"), pki.ca).load()
    with pytest.raises(TlsError, match=r"--tls-key .*: not a PEM private key"):
        _files(pki.cert("kvmesh-worker"), pki.cert("kvmesh-worker"), pki.ca).load()


def test_key_of_another_certificate_is_refused(pki: DevPki) -> None:
    with pytest.raises(TlsError, match=r"--tls-key .*kvmesh-planner-key\.pem does not match"):
        _files(pki.cert("kvmesh-worker"), pki.key("kvmesh-planner"), pki.ca).load()


def test_certificate_of_another_ca_is_refused(pki: DevPki, other_pki: DevPki) -> None:
    with pytest.raises(TlsError, match=r"is not signed by a CA of --tls-ca"):
        _files(other_pki.cert("kvmesh-worker"), other_pki.key("kvmesh-worker"), pki.ca).load()


def test_expired_and_future_certificates_are_refused(tmp_path: Path) -> None:
    pki = write_dev_pki(tmp_path, [])
    now = datetime.datetime.now(datetime.UTC)
    expired = pki.issue("old", valid_from=now - 10 * DAY, valid_for=DAY)
    with pytest.raises(TlsError, match=r"--tls-cert .*old\.pem: 'CN=old' .* expired on \d{4}-"):
        _files(expired.cert, expired.key, pki.ca).load()
    future = pki.issue("new", valid_from=now + DAY, valid_for=DAY)
    with pytest.raises(TlsError, match=r"is not valid before"):
        _files(future.cert, future.key, pki.ca).load()


def test_tls_config_needs_all_three_files_and_identities_need_tls() -> None:
    with pytest.raises(ValueError, match="missing: --tls-key, --tls-ca"):
        TlsConfig(tls_cert="a.pem")
    with pytest.raises(ValueError, match="--mesh-identities needs mesh TLS"):
        TlsConfig(mesh_identities=["kvmesh-worker"])
    assert not TlsConfig().enabled


def test_mesh_token_from_file_or_env(
    tmp_path: Path, pki: DevPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MESH_TOKEN_ENV, raising=False)
    assert TlsConfig().token() is None
    (tmp_path / "token").write_text("0123456789abcdef-secret\n")
    assert TlsConfig(mesh_token_file=str(tmp_path / "token")).token() == b"0123456789abcdef-secret"
    monkeypatch.setenv(MESH_TOKEN_ENV, "short")
    with pytest.raises(TlsError, match=r"\$KVMESH_MESH_TOKEN is too short"):
        TlsConfig().token()
    monkeypatch.setenv(MESH_TOKEN_ENV, "x" * 32)
    with pytest.raises(TlsError, match="for meshes without TLS"):
        MeshSecurity.load(pki.config("kvmesh-worker"))
    assert MeshSecurity.load(TlsConfig()).mode == "token"


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_reload_picks_up_new_files_and_skips_broken_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = write_dev_pki(tmp_path, ["kvmesh-worker"])
    clock = FakeClock()
    tls = ReloadingTls(pki.files("kvmesh-worker"), check_s=1.0, clock=clock)
    gen, first = tls.current()
    assert gen == 0
    pki.issue("kvmesh-worker")
    assert tls.current() == (0, first), "not looked at again before check_s"
    clock.t = 1.0
    gen, second = tls.current()
    assert gen == 1 and second.cert_chain != first.cert_chain
    assert second.cert_chain == pki.cert("kvmesh-worker").read_bytes()
    # A key replaced before its certificate: refused, logged once, the previous pair stays.
    other = write_dev_pki(tmp_path / "other", ["x"])
    pki.key("kvmesh-worker").write_bytes(other.key("x").read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvmesh.runtime.tls"):
        clock.t = 2.0
        assert tls.current() == (1, second)
        clock.t = 3.0
        assert tls.current() == (1, second)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "does not match" in caplog.records[0].message
    # ...until the matching certificate arrives.
    pki.issue("kvmesh-worker")
    clock.t = 4.0
    gen, third = tls.current()
    assert gen == 2 and third.cert_chain == pki.cert("kvmesh-worker").read_bytes()
