"""Ports a process picks for servers that another process will bind (`kvmesh up`'s children, the
tests' meshes).

A port "free a moment ago" (bind to port 0, read it, close) is not reserved: until its server binds
it, the kernel may hand the same port to any socket that binds port 0 (a worker's gRPC server)
or connects out, and a second pick may return it again. `free_port` closes both gaps:

- it picks below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), where the kernel
  never assigns ports on its own, so no bind(0) or outgoing connection can take it;
- it claims each port it returns in a directory shared by every process of this user on this
  machine (an exclusively created file per port), so two pickers (a test and the `kvmesh up` it
  started) never return the same port while the claim is fresh (`CLAIM_S`).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
from pathlib import Path

CLAIM_S = 300.0
"""How long a returned port stays claimed: ample for its server to start and bind it."""

_LOWEST = 10_000
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 where it cannot be read)."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claims() -> Path:
    d = Path(tempfile.gettempdir()) / f"kvmesh-ports-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def _claim(claims: Path, port: int) -> bool:
    """Claim `port` for this caller unless another claimed it less than CLAIM_S ago."""
    path = claims / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime < CLAIM_S:
                    return False
                path.unlink()  # a stale claim: take it over (once)
    return False


def _prune(claims: Path) -> None:
    """Remove stale claims, so the directory stays small."""
    now = time.time()
    for path in claims.iterdir():
        with contextlib.suppress(FileNotFoundError):
            if now - path.stat().st_mtime >= CLAIM_S:
                path.unlink()


def _address(host: str) -> tuple[socket.AddressFamily, str]:
    """`host` resolved once (a name that does not resolve fails here, not once per try)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot pick a port on {host!r}: {e}") from e
    return family, str(sockaddr[0])


def _bindable(address: tuple[socket.AddressFamily, str], port: int) -> bool:
    family, ip = address
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now, outside the kernel's ephemeral range, and not
    returned to any other caller on this machine in the last CLAIM_S seconds."""
    top = _ephemeral_start()
    if top - _LOWEST < 1000:  # an unusual ephemeral range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    address = _address(host)
    claims = _claims()
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(_LOWEST, top)
        if _bindable(address, port) and _claim(claims, port):
            if rng.random() < 0.02:
                _prune(claims)
            return port
    raise OSError(f"no free port on {host} in [{_LOWEST}, {top})")
