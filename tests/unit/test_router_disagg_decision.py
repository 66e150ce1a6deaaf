"""Conditional disaggregation (`local_prefill_reason`), the one decision the gateway's
MeshBackend and the simulator's disaggregated replay both make: where a request prefills."""

from __future__ import annotations

import pytest

from kvmesh.router.backend import DisaggConfig, LocalPrefill, local_prefill_reason

pytestmark = pytest.mark.unit


def decide(
    prompt: int, cached: int, inflight: list[int], *, local: int = 100, limit: int = 0
) -> LocalPrefill | None:
    config = DisaggConfig(disagg_local_prefill_tokens=local, disagg_max_prefill_inflight=limit)
    return local_prefill_reason(config, prompt, cached, inflight)


def test_no_prefill_worker_comes_first() -> None:
    assert decide(10, 0, []) is LocalPrefill.NO_PREFILL_WORKER  # short, but nobody to send to
    assert decide(10_000, 0, [], limit=1) is LocalPrefill.NO_PREFILL_WORKER


def test_short_uncached_part_prefills_locally() -> None:
    assert decide(100, 0, [0]) is LocalPrefill.SHORT_PROMPT  # at the threshold: local
    assert decide(101, 0, [0]) is None
    assert decide(1_000, 900, [0]) is LocalPrefill.SHORT_PROMPT  # mostly cached on D
    assert decide(1_000, 899, [0]) is None
    assert decide(1, 0, [0], local=0) is None  # 0: always remote


def test_saturated_prefill_pool_prefills_locally() -> None:
    assert decide(1_000, 0, [2, 3], limit=2) is LocalPrefill.PREFILL_SATURATED
    assert decide(1_000, 0, [2, 1], limit=2) is None  # one prefill worker has room
    assert decide(1_000, 0, [50, 50]) is None  # 0: never saturated
    assert decide(50, 0, [2, 3], limit=2) is LocalPrefill.SHORT_PROMPT  # short wins
