"""The torch engine behind real servers: a worker over gRPC (in-process), and `kvmesh up --engine
torch` (real processes) driven by the official `openai` client; greedy output through the whole
mesh equals transformers' generate() on the same tiny model."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

from tokenizers import Tokenizer

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.api.worker.v1 import worker_service_pb2_grpc as wpb_grpc
from kvmesh.runtime import wire
from kvmesh.runtime.grpcutil import insecure_channel
from kvmesh.runtime.kv_events import KvStateMirror
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights
from kvmesh.workers.server import Worker
from tests.conftest import generate_reference
from tests.devices import DEVICE
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch") / "tiny-llama"
    shutil.copytree(tiny_model, path)
    create_tiny_weights(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


PROMPTS = [
    [(11 + salt * 97 + i * 53) % 3900 + 20 for i in range(n)] for salt, n in enumerate((9, 33, 70))
]


@pytest.fixture
async def stub(model_dir: Path, loaded: LoadedModel) -> AsyncIterator[wpb_grpc.WorkerServiceStub]:
    info = ModelDirInfo.load(model_dir)
    engine = TorchEngine(
        TorchConfig(device=DEVICE, num_gpu_blocks=64),
        model_dir=model_dir,
        served_model_name="tiny",
        eos_token_ids=info.eos_token_ids,
        loaded=loaded,
    )
    worker = Worker(WorkerConfig(), engine)
    await worker.start()
    channel = insecure_channel(worker.address)
    yield wpb_grpc.WorkerServiceStub(channel)
    await channel.close()
    await worker.stop()


async def test_worker_generate_events_and_card(
    stub: wpb_grpc.WorkerServiceStub, model_dir: Path, loaded: LoadedModel
) -> None:
    eos = ModelDirInfo.load(model_dir).eos_token_ids
    card = (await stub.GetModelCard(wpb.GetModelCardRequest())).card
    assert card.engine == "torch" and card.kv_block_size_tokens == 16
    assert cpb.ENGINE_CAPABILITY_KV_EVENTS in card.capabilities
    assert cpb.ENGINE_CAPABILITY_LOGPROBS in card.capabilities

    events = stub.SubscribeKvEvents(wpb.SubscribeKvEventsRequest())
    mirror = KvStateMirror()
    mirror.apply(wire.kv_item_from_pb(await events.read()))

    async def generate(prompt: list[int]) -> list[int]:
        req = wpb.GenerateRequest(
            token_ids=prompt,
            sampling=cpb.SamplingOptions(temperature=0.0),
            stop=cpb.StopConditions(max_tokens=10),
        )
        return [t async for m in stub.Generate(req) for t in m.token_ids]

    results = await asyncio.gather(*(generate(p) for p in PROMPTS))
    for prompt, tokens in zip(PROMPTS, results, strict=True):
        assert tokens == generate_reference(loaded, eos, prompt, 10)
    # The event stream rebuilds the cache: 2 + 4 full blocks of prompt + output.
    while len(mirror.state) < 6:
        mirror.apply(wire.kv_item_from_pb(await asyncio.wait_for(events.read(), 5)))
    assert {tuple(v[1]) for v in mirror.state.values()} >= {tuple(PROMPTS[2][:16])}
    events.cancel()
    load = (await stub.GetLoadMetrics(wpb.GetLoadMetricsRequest())).metrics
    assert load.kv_active_blocks == 0 and load.kv_total_blocks == 64


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(
        tmp_path_factory.mktemp("up-torch"),
        "--engine",
        "torch",
        "--model",
        str(model_dir),
        "--workers",
        "1",
        "--device",
        DEVICE,
        "--dtype",
        "float32",
        "--torch-num-gpu-blocks",
        "256",
    )
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()


def test_greedy_through_the_mesh_equals_transformers(
    mesh: Mesh, model_dir: Path, loaded: LoadedModel
) -> None:
    """openai client -> gateway -> router -> torch worker process."""
    eos = ModelDirInfo.load(model_dir).eos_token_ids
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    client = mesh.client()
    for prompt in PROMPTS:
        expected = generate_reference(loaded, eos, prompt, 12)
        res = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=12, temperature=0
        )
        assert res.usage is not None and res.usage.completion_tokens == len(expected)
        assert res.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hello there!"}],
        max_tokens=8,
        temperature=0,
    )
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
