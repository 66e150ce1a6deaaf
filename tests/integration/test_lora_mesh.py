"""LoRA adapters through the gateway: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter
over real mocker workers (gRPC, file discovery), adapters in /v1/models with their base model as
`parent`, requests naming an adapter as the model, the router preferring the workers that have
the adapter, the workers' LRU bound, and the errors of each step."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.router.backend import MeshBackend
from kvmesh.router.pool import WorkerPool
from kvmesh.router.routing import RouterMode, SimpleRouter
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.server import Worker

from .test_worker_contract import make_engine

pytestmark = pytest.mark.integration


@dataclass
class Gateway:
    url: str
    http: aiohttp.ClientSession
    workers: list[Worker]
    pool: WorkerPool

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=body) as resp:
            text = await resp.text()
            ctype = resp.headers.get("Content-Type", "")
            return resp.status, (await resp.json() if "json" in ctype else text)

    async def get(self, path: str) -> Any:
        async with self.http.get(self.url + path) as resp:
            assert resp.status == 200
            return await resp.json()

    async def complete(self, model: str) -> tuple[int, Any]:
        return await self.post(
            "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 2}
        )

    def finished(self) -> list[int]:
        return [w.engine.load().requests_finished_total for w in self.workers]


@pytest.fixture
async def gateway(tiny_model: Path, tmp_path: Path) -> AsyncIterator[Gateway]:
    url = f"file://{tmp_path / 'registry'}"
    workers = [
        Worker(
            WorkerConfig(discovery=url, worker_id=f"w{i}"),
            make_engine(tiny_model, max_loras=2, lora_modules=mods),
        )
        for i, mods in enumerate(((), ("sql=/adapters/sql",)))
    ]
    for w in workers:
        await w.start()
    pool = WorkerPool(FileDiscovery(tmp_path / "registry", poll_s=0.05))
    await pool.start()
    await pool.wait_for(2, timeout_s=10)
    backend = MeshBackend(pool, SimpleRouter(pool, RouterMode.ROUND_ROBIN))
    service = OpenAIService(backend, {"tiny": Tokenizer.from_pretrained(tiny_model)})
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    async with aiohttp.ClientSession() as http:
        yield Gateway(f"http://127.0.0.1:{port}", http, workers, pool)
    await runner.cleanup()
    await pool.stop()
    for w in workers:
        await w.stop()


async def test_adapter_routing_models_and_unload(gateway: Gateway) -> None:
    models = await gateway.get("/v1/models")
    cards = {m["id"]: m for m in models["data"]}
    assert cards["tiny"]["parent"] is None and cards["tiny"]["root"] == "tiny"
    assert cards["sql"]["parent"] == "tiny"
    assert (await gateway.get("/v1/models/sql"))["parent"] == "tiny"
    # only w1 has "sql": every request for it goes there (round-robin would alternate)
    before = gateway.finished()
    for _ in range(4):
        status, body = await gateway.complete("sql")
        assert status == 200 and body["model"] == "sql"
    assert [a - b for a, b in zip(gateway.finished(), before, strict=True)] == [0, 4]
    status, body = await gateway.complete("nope")
    assert status == 404 and body["error"]["param"] == "model"

    status, text = await gateway.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert "sql" not in {m["id"] for m in (await gateway.get("/v1/models"))["data"]}
    status, _ = await gateway.complete("sql")
    assert status == 404
    status, body = await gateway.post("/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_load_everywhere_lru_bound_and_bad_requests(gateway: Gateway) -> None:
    status, text = await gateway.post(
        "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"}
    )
    assert (status, text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert [w.engine.info.lora_adapters for w in gateway.workers] == [("chat",), ("chat", "sql")]
    before = gateway.finished()
    for _ in range(4):
        assert (await gateway.complete("chat"))[0] == 200
    assert [a - b for a, b in zip(gateway.finished(), before, strict=True)] == [2, 2]
    # a third adapter on w1 (max_loras=2) unloads its least recently used one ("sql")
    status, _ = await gateway.post(
        "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": "/adapters/math"}
    )
    assert status == 200
    assert gateway.workers[1].engine.info.lora_adapters == ("chat", "math")
    ids = {m["id"] for m in (await gateway.get("/v1/models"))["data"]}
    assert ids == {"tiny", "chat", "math"}
    assert (await gateway.complete("sql"))[0] == 404

    for body, code in [
        ({"lora_name": "chat", "lora_path": "/x"}, 400),  # already loaded
        ({"lora_name": "tiny", "lora_path": "/x"}, 400),  # a served model's name
        ({"lora_name": "", "lora_path": "/x"}, 400),
        ({"lora_path": "/x"}, 400),
        ({"lora_name": "x", "lora_path": "/x", "model": "other"}, 404),
    ]:
        status, err = await gateway.post("/v1/load_lora_adapter", body)
        assert status == code, (body, err)
        assert "message" in err["error"]
