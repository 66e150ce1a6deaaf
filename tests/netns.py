"""Hosts of a private test network on this machine: Linux network namespaces, each with one
veth link to a bridge that lives in a namespace of its own, so nothing is added to the host's
network (no interface, address or route outside the namespaces this module makes).

    lab = NetLab()                 # needs the privilege to make namespaces: NetLab.unavailable()
    ip = lab.add_host("w1")        # a namespace with eth0 = 10.231.7.N/24, linked to the bridge
    lab.wrap("w1")                 # command prefix running a program on that host
    lab.cut("w1") / lab.restore("w1")   # the host's link down (unplugged) / up again
    lab.close()                    # deletes every namespace it made (idempotent)

Namespace names carry the creating process's pid; a NetLab removes the namespaces left by
test processes that died without cleaning up (their pid no longer exists), never others'.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess

SUBNET = "10.231.7"
"""/24 of the test hosts. Private and never routed: it exists only inside the namespaces."""
PREFIX = "kvmt"
_NAME = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]+-")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _must(*args: str) -> None:
    out = _ip(*args)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def unavailable() -> str | None:
    """Why this machine cannot host a NetLab (tried by making and deleting a namespace);
    None when it can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    out = _ip("netns", "add", name)
    if out.returncode != 0:
        return f"cannot create a network namespace here: {out.stderr.strip()}"
    _ip("netns", "del", name)
    return None


def _sweep_stale() -> None:
    """Delete namespaces of earlier NetLabs whose process is gone."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            _ip("netns", "del", name)
        except PermissionError:
            pass  # alive, someone else's


class NetLab:
    """A bridge (in its own namespace) and hosts plugged into it; see the module docstring."""

    def __init__(self) -> None:
        _sweep_stale()
        self.tag = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.namespaces: list[str] = []
        self.hosts: dict[str, str] = {}
        self._ports: dict[str, str] = {}
        self.switch = self._add_namespace("sw")
        try:
            _must("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _must("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> str:
        ns = f"{self.tag}-{name}"
        _must("netns", "add", ns)
        self.namespaces.append(ns)
        _must("-n", ns, "link", "set", "lo", "up")
        return ns

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def add_host(self, host: str) -> str:
        """Add a host (namespace + link to the bridge); returns its address."""
        assert host not in self.hosts and host != "sw"
        ns = self._add_namespace(host)
        ip = f"{SUBNET}.{len(self.hosts) + 2}"
        port = f"p{len(self.hosts)}"  # the switch-side end (interface names: 15 chars at most)
        _must("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port,
              "netns", self.switch)  # fmt: skip
        _must("-n", self.switch, "link", "set", port, "master", "br0")
        _must("-n", self.switch, "link", "set", port, "up")
        _must("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _must("-n", ns, "link", "set", "eth0", "up")
        self.hosts[host] = ip
        self._ports[host] = port
        return ip

    def wrap(self, host: str) -> list[str]:
        """Command prefix that runs a program on `host` (`ip netns exec` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def cut(self, host: str) -> None:
        """Take the host's link down at the bridge: its packets go nowhere, as if unplugged."""
        _must("-n", self.switch, "link", "set", self._ports[host], "down")

    def restore(self, host: str) -> None:
        _must("-n", self.switch, "link", "set", self._ports[host], "up")

    def close(self) -> None:
        """Delete every namespace this lab made (its veth links go with them)."""
        for ns in reversed(self.namespaces):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _ip("netns", "del", ns)
        self.namespaces.clear()
