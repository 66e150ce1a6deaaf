"""`free_port`: ports a process picks for servers another process binds never come from the
kernel's ephemeral range (where a worker's bind to port 0 could take them first) and are never
returned twice while claimed (a test and the `kvmesh up` it starts pick from one pool)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from kvmesh.runtime import ports
from kvmesh.runtime.ports import free_port

pytestmark = pytest.mark.unit


def test_ports_are_outside_the_ephemeral_range_distinct_and_bindable() -> None:
    top = ports._ephemeral_start()
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(ports._LOWEST <= p < top for p in picked)
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_another_process_never_gets_a_claimed_port() -> None:
    mine = {free_port() for _ in range(100)}
    code = (
        "import json; from kvmesh.runtime.ports import free_port; "
        "print(json.dumps([free_port() for _ in range(300)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    theirs = set(json.loads(out.stdout))
    assert len(theirs) == 300
    assert not mine & theirs


def test_a_stale_claim_is_taken_over_and_a_bound_port_is_skipped() -> None:
    claims = ports._claims()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        assert not ports._bindable(ports._address("127.0.0.1"), taken)
    port = free_port()
    assert not ports._claim(claims, port)  # fresh: refused
    old = time.time() - ports.CLAIM_S - 1
    os.utime(claims / str(port), (old, old))
    assert ports._claim(claims, port)  # stale: taken over


def test_a_host_that_does_not_resolve_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(OSError, match=r"cannot pick a port on 'no-such-host\.invalid'"):
        free_port("no-such-host.invalid")
    assert time.monotonic() - start < 10  # one lookup, not one per candidate port
