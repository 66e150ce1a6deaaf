"""TorchEngine on the tiny random-weight Llama, in-process: greedy output token-identical to
transformers' generate() (alone, concurrent, chunked, after prefix-cache hits, across
preemptions), sampling knobs, real logprobs, KV events under eviction, block export/import."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("transformers", reason="transformers is not installed")

import torch

from kvmesh.runtime.errors import InvalidRequest, NotFound
from kvmesh.runtime.kv_events import BlocksRemoved, KvStateMirror
from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.pytorch.config import TorchConfig, TorchDType
from kvmesh.workers.pytorch.engine import TorchEngine
from kvmesh.workers.pytorch.model_runner import LoadedModel, load_model
from kvmesh.workers.pytorch.weights import create_tiny_weights
from tests.devices import DEVICE

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("torch") / "tiny-llama"
    shutil.copytree(tiny_model, path)
    create_tiny_weights(path)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, DEVICE, TorchDType.FLOAT32)


class Env:
    """Builds engines on the shared model and computes transformers references."""

    def __init__(self, model_dir: Path, loaded: LoadedModel) -> None:
        self.model_dir = model_dir
        self.loaded = loaded
        self.eos = ModelDirInfo.load(model_dir).eos_token_ids
        self._refs: dict[tuple[tuple[int, ...], int, float], list[int]] = {}

    def engine(self, **cfg: Any) -> TorchEngine:
        config = TorchConfig(**{"device": DEVICE, "num_gpu_blocks": 128, **cfg})
        return TorchEngine(
            config,
            model_dir=self.model_dir,
            served_model_name="tiny",
            eos_token_ids=self.eos,
            loaded=self.loaded,
        )

    def reference(self, prompt: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
        """transformers generate(), greedy."""
        key = (tuple(prompt), n, repetition_penalty)
        if key not in self._refs:
            ids = torch.tensor([prompt], device=self.loaded.device)
            out = self.loaded.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                repetition_penalty=repetition_penalty,
                eos_token_id=list(self.eos),
                pad_token_id=self.eos[0],
            )
            self._refs[key] = out[0, len(prompt) :].tolist()
        return self._refs[key]


@pytest.fixture(scope="module")
def env(model_dir: Path, loaded: LoadedModel) -> Env:
    return Env(model_dir, loaded)


@pytest.fixture
async def engine(env: Env) -> AsyncIterator[TorchEngine]:
    eng = env.engine()
    await eng.start()
    yield eng
    await eng.stop()


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(7 + salt * 131 + i * 37) % 3900 + 20 for i in range(n)]


_ids = iter(range(1 << 30))


def req(prompt: list[int], max_tokens: int = 12, **sampling: Any) -> EngineRequest:
    stop = {
        k: sampling.pop(k) for k in ("min_tokens", "stop_token_ids", "ignore_eos") if k in sampling
    }
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        f"t-{next(_ids)}",
        prompt,
        SamplingParams(**sampling),
        StopParams(max_tokens=max_tokens, **stop),
    )


async def run(engine: TorchEngine, request: EngineRequest) -> tuple[list[int], EngineOutput]:
    outs = [o async for o in engine.generate(request)]
    return [t for o in outs for t in o.token_ids], outs[-1]


def assert_idle(engine: TorchEngine) -> None:
    load = engine.load()
    assert (load.num_running, load.num_waiting, load.kv_active_blocks) == (0, 0, 0)
    engine.scheduler.check_invariants()


PROMPTS = [prompt_of(n, salt) for salt, n in enumerate((1, 5, 16, 17, 40, 75))]


async def test_greedy_matches_transformers_generate(engine: TorchEngine, env: Env) -> None:
    for prompt in PROMPTS:
        tokens, last = await run(engine, req(prompt, 12))
        assert tokens == env.reference(prompt, 12), len(prompt)
        assert last.usage is not None and last.usage.completion_tokens == len(tokens)
    assert_idle(engine)


@pytest.mark.parametrize("budget", [2048, 24])
async def test_concurrent_greedy_matches_transformers(env: Env, budget: int) -> None:
    """Different lengths batched together; with a 24-token budget prompts are chunked and
    prefill chunks share steps with decodes."""
    eng = env.engine(max_num_batched_tokens=budget)
    await eng.start()
    try:
        results = await asyncio.gather(*(run(eng, req(p, 12)) for p in PROMPTS))
        for prompt, (tokens, _) in zip(PROMPTS, results, strict=True):
            assert tokens == env.reference(prompt, 12), len(prompt)
        assert_idle(eng)
    finally:
        await eng.stop()


async def test_prefix_cache_hit_skips_prefill_and_matches(engine: TorchEngine, env: Env) -> None:
    base = prompt_of(70, salt=9)
    first, last = await run(engine, req(base, 8))
    assert last.usage is not None and last.usage.cached_tokens == 0
    # Same prompt: the 4 full blocks (64 tokens) come from the cache and are not computed.
    computed = engine.scheduler.num_computed_tokens
    again, last = await run(engine, req(base, 8))
    assert engine.scheduler.num_computed_tokens - computed == (70 - 64) + 7
    assert again == first == env.reference(base, 8)
    assert last.usage is not None and last.usage.cached_tokens == 64
    # Shared 48-token prefix, different tail: 3 blocks hit, the rest is computed.
    other = base[:48] + prompt_of(30, salt=10)
    tokens, last = await run(engine, req(other, 8))
    assert last.usage is not None and last.usage.cached_tokens == 48
    assert tokens == env.reference(other, 8)
    assert engine.load().prefix_cache_hit_rate > 0
    assert_idle(engine)


async def test_preemption_recomputes_and_matches(env: Env) -> None:
    eng = env.engine(num_gpu_blocks=10)  # 160 token slots for 4 x 60 tokens
    await eng.start()
    try:
        prompts = [prompt_of(30, salt=20 + i) for i in range(4)]
        results = await asyncio.gather(*(run(eng, req(p, 30, ignore_eos=True)) for p in prompts))
        assert eng.load().preemptions_total > 0
        for prompt, (tokens, last) in zip(prompts, results, strict=True):
            assert len(tokens) == 30 and last.finish_reason is FinishReason.LENGTH
            ref = env.reference(prompt, 30)
            assert tokens[: len(ref)] == ref
        assert_idle(eng)
        assert eng.kv_events is not None
        assert eng.kv_events.cached() == eng.cached_blocks()
    finally:
        await eng.stop()


async def test_without_prefix_caching(env: Env) -> None:
    eng = env.engine(enable_prefix_caching=False, enable_chunked_prefill=False)
    await eng.start()
    try:
        assert eng.kv_events is None and "KV_EVENTS" not in eng.info.capabilities
        prompt = PROMPTS[4]
        for _ in range(2):
            tokens, last = await run(eng, req(prompt, 12))
            assert tokens == env.reference(prompt, 12)
            assert last.usage is not None and last.usage.cached_tokens == 0
        assert eng.cached_blocks() == {}
    finally:
        await eng.stop()


async def test_seeded_sampling_is_reproducible_and_batch_independent(
    engine: TorchEngine,
) -> None:
    prompt = PROMPTS[3]
    a, _ = await run(engine, req(prompt, 16, temperature=1.0, seed=7))
    b, _ = await run(engine, req(prompt, 16, temperature=1.0, seed=7))
    assert a == b
    crowd = [req(p, 16, temperature=0.9, seed=i) for i, p in enumerate(PROMPTS)]
    results = await asyncio.gather(
        run(engine, req(prompt, 16, temperature=1.0, seed=7)), *(run(engine, r) for r in crowd)
    )
    assert results[0][0] == a
    c, _ = await run(engine, req(prompt, 16, temperature=1.0, seed=8))
    assert c != a
    unseeded = [(await run(engine, req(prompt, 16, temperature=1.0)))[0] for _ in range(2)]
    assert unseeded[0] != unseeded[1]


async def test_filters_that_leave_one_token_equal_greedy(engine: TorchEngine, env: Env) -> None:
    prompt = PROMPTS[2]
    ref = env.reference(prompt, 12)
    for knobs in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        tokens, _ = await run(engine, req(prompt, 12, temperature=1.5, seed=3, **knobs))
        assert tokens == ref, knobs


async def test_logit_bias_and_repetition_penalty(engine: TorchEngine, env: Env) -> None:
    prompt = PROMPTS[4]
    tokens, _ = await run(engine, req(prompt, 6, logit_bias={1234: 100.0}))
    assert tokens == [1234] * 6
    tokens, _ = await run(engine, req(prompt, 6, temperature=1.0, logit_bias={99: 100.0}))
    assert tokens == [99] * 6
    tokens, _ = await run(engine, req(prompt, 12, repetition_penalty=1.5))
    assert tokens == env.reference(prompt, 12, repetition_penalty=1.5)


async def test_min_tokens_masks_stop_ids(engine: TorchEngine, env: Env) -> None:
    prompt = PROMPTS[1]
    first = env.reference(prompt, 1)[0]
    tokens, last = await run(engine, req(prompt, 8, stop_token_ids=(first,)))
    assert tokens == [first] and last.finish_reason is FinishReason.STOP
    assert last.stop_token_id == first
    tokens, last = await run(engine, req(prompt, 8, stop_token_ids=(first,), min_tokens=3))
    assert first not in tokens[:3] and len(tokens) >= 4


async def test_logprobs_are_the_models(engine: TorchEngine, env: Env) -> None:
    prompt = PROMPTS[4]
    tokens, _ = await run(engine, req(prompt, 4))
    outs = [o async for o in engine.generate(req(prompt, 4, top_logprobs=5))]
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert [lp.token_id for lp in lps] == tokens
    ids = torch.tensor([prompt + tokens], device=env.loaded.device)
    with torch.inference_mode():
        logits = env.loaded.model(ids).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    for lp, row in zip(lps, expected, strict=True):
        values, top_ids = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert lp.logprob == pytest.approx(float(row[lp.token_id]), abs=1e-4)
        assert lp.top[0][0] == lp.token_id  # greedy picks the most likely token
    outs = [o async for o in engine.generate(req(prompt, 2, top_logprobs=0))]
    assert all(o.logprobs and o.logprobs[0].top == [] for o in outs)


async def test_requests_the_model_cannot_serve(engine: TorchEngine, env: Env) -> None:
    vocab = env.loaded.vocab_size
    bad = [
        ("prompt", req([1, vocab], 2)),
        ("logit_bias", req([1, 2], 2, logit_bias={vocab: 1.0})),
    ]
    for param, request in bad:
        with pytest.raises(InvalidRequest) as e:
            await anext(engine.generate(request))
        assert e.value.param == param
    with pytest.raises(NotFound, match="'adapter' is not loaded"):  # as vLLM: 404
        await anext(engine.generate(EngineRequest("lora", [1, 2], lora_name="adapter")))
    assert_idle(engine)


async def test_kv_events_track_eviction(env: Env) -> None:
    eng = env.engine(num_gpu_blocks=8)
    await eng.start()
    try:
        log = eng.kv_events
        assert log is not None
        sub = log.subscribe(None)
        mirror = KvStateMirror()
        mirror.apply(await anext(sub))
        for i in range(6):
            await run(eng, req(prompt_of(40, salt=40 + i), 4))
        kinds = [e.kind for e in log.events_since(0) or []]
        assert any(isinstance(k, BlocksRemoved) for k in kinds)
        assert log.cached() == eng.cached_blocks()
        while mirror.last_event_id != log.last_event_id:
            mirror.apply(await asyncio.wait_for(anext(sub), 5))
        assert mirror.state == eng.cached_blocks()
        await sub.aclose()  # type: ignore[attr-defined]
    finally:
        await eng.stop()


async def test_export_import_blocks_between_engines(env: Env) -> None:
    a, b = env.engine(), env.engine()
    await a.start()
    await b.start()
    try:
        prompt = prompt_of(70, salt=50)
        tokens, _ = await run(a, req(prompt, 8))
        n, kv = await a.export_blocks(prompt)
        assert n == 4 and tuple(kv.shape) == a.kv_spec.block_shape(4)
        ids = a.scheduler.match_prefix(prompt)
        assert torch.equal(await a.read_blocks(ids[1:3]), kv[:, :, 1:3])
        with pytest.raises(InvalidRequest):
            await a.read_blocks([a.info.kv_total_blocks])
        assert await b.import_blocks(prompt[: n * 16], kv) == 4
        assert await b.import_blocks(prompt[: n * 16], kv) == 0  # already cached
        assert b.cached_blocks() == {
            h: v for h, v in a.cached_blocks().items() if h in b.cached_blocks()
        }
        assert b.kv_events is not None and b.kv_events.cached() == b.cached_blocks()
        again, last = await run(b, req(prompt, 8))
        assert again == tokens
        assert last.usage is not None and last.usage.cached_tokens == 64
        with pytest.raises(InvalidRequest):
            await b.import_blocks(prompt[:32], kv)
        assert_idle(a)
        assert_idle(b)
    finally:
        await a.stop()
        await b.stop()


async def test_bfloat16_runs(model_dir: Path, env: Env) -> None:
    loaded = load_model(model_dir, DEVICE, TorchDType.BFLOAT16)
    assert loaded.dtype is torch.bfloat16
    eng = TorchEngine(
        TorchConfig(device=DEVICE, num_gpu_blocks=32),
        model_dir=model_dir,
        served_model_name="tiny",
        loaded=loaded,
    )
    await eng.start()
    try:
        tokens, last = await run(eng, req(PROMPTS[3], 6))
        assert len(tokens) == 6 and last.finish_reason is FinishReason.LENGTH
    finally:
        await eng.stop()


async def test_engine_loads_its_own_model_and_sizes_its_cache(model_dir: Path) -> None:
    eng = TorchEngine(
        TorchConfig(device=DEVICE, kv_cache_gb=0.001, max_model_len=512),
        model_dir=model_dir,
        served_model_name="tiny",
    )
    with pytest.raises(Exception, match="not been started"):
        _ = eng.info
    await eng.start()
    try:
        info = eng.info
        assert info.engine == "torch" and info.context_length == 512
        assert info.kv_total_blocks == int(0.001 * (1 << 30)) // eng.kv_spec.block_bytes
        tokens, _ = await run(eng, req(PROMPTS[0], 3))
        assert len(tokens) == 3
    finally:
        await eng.stop()


def test_random_weights_are_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    paths = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        shutil.copytree(tiny_model, tmp_path / name)
        paths.append(create_tiny_weights(tmp_path / name, seed=seed))
    data = [p.read_bytes() for p in paths]
    assert data[0] == data[1] != data[2]


def test_worker_flags_and_lazy_torch_import() -> None:
    from kvmesh.apps.cli import build_parser
    from kvmesh.runtime.config import from_args

    ns = build_parser().parse_args(
        ["worker", "--engine", "torch", "--torch-block-size", "32", "--dtype", "bfloat16"]
    )
    cfg = from_args(TorchConfig, ns)
    assert (cfg.block_size, cfg.dtype, cfg.device) == (32, TorchDType.BFLOAT16, "auto")
    # The generic (mocker) flag sets the same knob.
    ns = build_parser().parse_args(["worker", "--engine", "torch", "--block-size", "8"])
    assert from_args(TorchConfig, ns).block_size == 8
    code = (
        "import sys; from kvmesh.apps.cli import build_parser; build_parser(); "
        "from kvmesh.workers.mocker import MockerEngine; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


ARCHITECTURES = {
    # biases on q/k/v, tied embeddings
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    # RMSNorm on queries and keys
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    # an 8-token sliding window (prompts are longer, and chunked)
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "sliding_window": 8,
    },
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
async def test_other_architectures_match_transformers(
    arch: str, tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / arch
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(ARCHITECTURES[arch])
    (path / "config.json").write_text(json.dumps(config))
    create_tiny_weights(path)
    env = Env(path, load_model(path, DEVICE, TorchDType.FLOAT32))
    eng = env.engine(max_num_batched_tokens=12)
    await eng.start()
    try:
        prompts = PROMPTS[1], PROMPTS[4]
        results = await asyncio.gather(*(run(eng, req(p, 10)) for p in prompts))
        for prompt, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == env.reference(prompt, 10)
    finally:
        await eng.stop()


def test_unsupported_architecture_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "gpt2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(ValueError, match="not supported"):
        load_model(path, "cpu")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_model(tiny_model, "cpu")


def test_prefill_attention_leaves_out_cudnn_on_cuda_only() -> None:
    """On CUDA, prefill attention runs without torch's cuDNN backend (it plans per shape: a
    GPU run measured 85 -> 14 ms TTFT for prompts of new lengths); elsewhere nothing changes."""
    from kvmesh.workers.pytorch.model_runner import _prefill_attention_context

    backends = torch.backends.cuda
    before = (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled())
    with _prefill_attention_context(torch.device("cuda"))():
        assert not backends.cudnn_sdp_enabled()
        assert backends.flash_sdp_enabled() and backends.mem_efficient_sdp_enabled()
    assert (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled()) == before
    with _prefill_attention_context(torch.device("cpu"))():
        assert (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled()) == before
