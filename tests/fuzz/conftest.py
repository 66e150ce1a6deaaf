"""One gateway process for all fuzz tests; its log must stay free of tracebacks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_gateway import RunningGateway, running


@pytest.fixture(scope="session")
def gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    log = tmp_path_factory.mktemp("fuzz") / "gateway.log"
    with running(tiny_model, log) as gw:
        yield gw
        assert gw.proc.poll() is None, "the gateway died"
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "internal error" not in text, text[-4000:]
