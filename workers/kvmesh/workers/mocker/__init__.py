"""The mocker engine: a simulated vLLM-style engine (`kvmesh worker --engine mocker`).

Real continuous batching, paged KV blocks with prefix caching and KV events, preemption and
chunked prefill; deterministic fake tokens; step durations from a timing model. The synchronous
core (MockerScheduler) can be driven directly in virtual time.
"""

from kvmesh.runtime.timing import PolynomialTiming, TableTiming, TimingModel, load_timing
from kvmesh.workers.batching.block_pool import BlockPool, block_hash
from kvmesh.workers.mocker.config import MockerConfig
from kvmesh.workers.mocker.engine import MockerEngine
from kvmesh.workers.mocker.sampling import TokenSampler
from kvmesh.workers.mocker.scheduler import MockerScheduler, SeqOutput, SeqStatus, StepResult

__all__ = [
    "BlockPool",
    "MockerConfig",
    "MockerEngine",
    "MockerScheduler",
    "PolynomialTiming",
    "SeqOutput",
    "SeqStatus",
    "StepResult",
    "TableTiming",
    "TimingModel",
    "TokenSampler",
    "block_hash",
    "load_timing",
]
