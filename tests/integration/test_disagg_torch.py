"""Disaggregated serving with the torch engine as real processes: `kvmesh up --engine torch
--prefill-workers 1 --decode-workers 1`, the official `openai` client, NIXL (UCX over host
memory) between the worker processes. Greedy output through gateway -> prefill worker -> NIXL
-> decode worker equals transformers' generate() and aggregated serving, for single and
concurrent requests, prompts spanning many blocks, and prompts partly cached on the decode
side; the frontend's /metrics counts the remote prefills and the bytes moved. A prefill worker
killed (SIGKILL) between its prefill and the pull leaves the decode worker to recompute: the
answer is still complete and identical, and no block stays referenced."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("nixl", reason="NIXL is not installed (pip install kvmesh[nixl])")

import grpc

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime import wire
from kvmesh.runtime.discovery import EventKind, FileDiscovery
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.ports import free_port
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from kvmesh.workers.pytorch.config import TorchDType
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights
from tests.conftest import generate_reference
from tests.devices import DEVICE
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh

pytestmark = pytest.mark.integration

BLOCK = 16
BLOCK_BYTES = 8192  # tiny Llama, float32: 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims x 4


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch-disagg") / "tiny-llama"
    shutil.copytree(tiny_model, path)
    create_tiny_weights(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 + salt * 97 + i * 53) % 3900 + 20 for i in range(n)]


class DisaggMesh:
    def __init__(self, mesh: Mesh, registry: Path) -> None:
        self.mesh, self.registry = mesh, registry

    def worker_address(self, role: str) -> str:
        async def find() -> str:
            async for ev in FileDiscovery(self.registry).watch("worker"):
                if ev.kind is EventKind.ADDED and ev.instance.role == role:
                    return ev.instance.address
            raise AssertionError("unreachable")

        return asyncio.run(asyncio.wait_for(find(), 10))

    def metrics(self) -> dict[str, float]:
        return self.mesh.metrics("kvmesh_remote_prefill", "kvmesh_local_prefill", "kvmesh_kv_")


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DisaggMesh]:
    tmp = tmp_path_factory.mktemp("up-torch-disagg")
    registry = tmp / "registry"
    m = start_mesh(
        tmp,
        "--engine",
        "torch",
        "--model",
        str(model_dir),
        "--workers",
        "0",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--disagg-local-prefill-tokens",
        "0",
        "--discovery",
        f"file://{registry}",
        "--device",
        DEVICE,
        "--dtype",
        "float32",
        "--torch-num-gpu-blocks",
        "256",
    )
    dm = DisaggMesh(m, registry)
    m.wait_workers(prefill=1, decode=1)
    yield dm
    assert stop_mesh(m) == 0, m.log.read_text()


def test_greedy_through_prefill_nixl_decode_equals_transformers(
    mesh: DisaggMesh, model_dir: Path, loaded: LoadedModel
) -> None:
    eos = ModelDirInfo.load(model_dir).eos_token_ids
    tok = Tokenizer.from_pretrained(model_dir)
    client = mesh.mesh.client()

    # Compared token by token (logprobs carry each token's text): the gateway's text of some
    # token-id prompts starts with the prompt's undecodable tail, aggregated or not.
    def run(ids: list[int], n: int = 10) -> list[str]:
        res = client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=n, temperature=0, logprobs=0
        )
        assert res.usage is not None and res.usage.completion_tokens == n
        assert res.choices[0].logprobs is not None and res.choices[0].logprobs.tokens is not None
        return res.choices[0].logprobs.tokens

    def want(ids: list[int], n: int = 10) -> list[str]:
        return [tok.token_str(t) for t in generate_reference(loaded, eos, ids, n)]

    before = mesh.metrics()
    singles = [prompt(n, salt=n) for n in (9, 16, 33, 300)]  # up to 19 blocks
    for ids in singles:
        assert run(ids) == want(ids)
    concurrent = [prompt(40 + 17 * i, salt=100 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(run, concurrent))
    assert outputs == [want(ids) for ids in concurrent]
    after = mesh.metrics()
    moved = after["kvmesh_kv_transfer_bytes_total"] - before["kvmesh_kv_transfer_bytes_total"]
    blocks = sum(-(-len(ids) // BLOCK) for ids in singles + concurrent)
    assert moved % BLOCK_BYTES == 0 and moved <= blocks * BLOCK_BYTES
    # Every block, exactly, unless a request fell back to prefilling on the decode worker (a pull
    # that timed out on a loaded machine: its output was still checked above). Seen once in a
    # loaded CI run: 41 of 42 blocks; the fallback counter tells which case it was.
    fell_back = sum(
        v - before.get(k, 0.0) for k, v in after.items() if k.startswith("kvmesh_local_prefill")
    )
    if not fell_back:
        assert moved == blocks * BLOCK_BYTES
    assert (
        after["kvmesh_remote_prefill_total"] - before.get("kvmesh_remote_prefill_total", 0) == 8
    ), {k: v - before.get(k, 0.0) for k, v in after.items()}

    # Partly cached on the decode side: the decode worker holds the 300-token prompt's 18 full
    # blocks (pulled above), so a follow-up turn pulls only the blocks after them.
    follow = [*singles[-1], *prompt(50, salt=7)]  # 350 tokens, 22 blocks
    assert run(follow) == want(follow)
    again = mesh.metrics()
    moved = again["kvmesh_kv_transfer_bytes_total"] - after["kvmesh_kv_transfer_bytes_total"]
    assert moved == (22 - 18) * BLOCK_BYTES
    assert not any(v for k, v in again.items() if k.startswith("kvmesh_local_prefill_total"))


@pytest.mark.slow
def test_prefill_worker_killed_before_the_pull(
    mesh: DisaggMesh, model_dir: Path, loaded: LoadedModel, tmp_path: Path
) -> None:
    """A second prefill worker (not in the mesh's registry) prefills, dies (SIGKILL), and the
    mesh's decode worker is handed its transfer handle: the NIXL READ from the dead process
    fails, the decode worker recomputes, the answer is complete and identical."""
    eos = ModelDirInfo.load(model_dir).eos_token_ids
    port = free_port()
    log = (tmp_path / "prefill.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "--log-level",
            "warning",
            "worker",
            "--engine",
            "torch",
            "--model",
            str(model_dir),
            "--role",
            "prefill",
            "--port",
            str(port),
            "--device",
            DEVICE,
            "--dtype",
            "float32",
            "--torch-num-gpu-blocks",
            "64",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    try:
        prefill = wpb_grpc.WorkerServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        deadline = time.monotonic() + 60
        while True:
            try:
                prefill.GetModelCard(wpb.GetModelCardRequest(), timeout=1)
                break
            except grpc.RpcError:
                assert proc.poll() is None and time.monotonic() < deadline, "worker did not start"
                time.sleep(0.2)
        ids = prompt(90, salt=42)
        req = EngineRequest(
            "killed", ids, SamplingParams(temperature=0.0), StopParams(max_tokens=10)
        )
        resp = prefill.PrefillRemote(wire.prefill_request_to_pb(req), timeout=30)
        assert resp.result.handle.nixl_agent_name and len(resp.result.handle.blocks) == 6
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

        decode = wpb_grpc.WorkerServiceStub(grpc.insecure_channel(mesh.worker_address("decode")))
        req.remote_prefill = wire.remote_prefill_from_pb(resp.result)
        msgs = list(decode.Generate(wire.request_to_pb(req), timeout=60))
        tokens = [resp.result.first_token_id, *(t for m in msgs for t in m.token_ids)]
        assert tokens == generate_reference(loaded, eos, ids, 10)
        assert msgs[-1].remote_prefill_fallback and msgs[-1].kv_transfer_bytes == 0
        load = decode.GetLoadMetrics(wpb.GetLoadMetricsRequest()).metrics
        assert (load.kv_active_blocks, load.num_running_requests) == (0, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
