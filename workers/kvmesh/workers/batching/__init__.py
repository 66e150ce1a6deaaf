"""The continuous-batching core shared by the mocker and the torch engine: the paged KV block
pool (block_pool), the scheduler over it (scheduler), per-request bookkeeping (requests) and the
async engine around them (engine: submission, the step loop, cancellation, disaggregated
serving). The engines differ only in how a step's tokens are produced and timed and how KV blocks
move between workers (BatchingEngine's hooks)."""

from kvmesh.workers.batching.block_pool import BlockPool, block_hash
from kvmesh.workers.batching.scheduler import (
    BatchScheduler,
    ScheduledStep,
    Seq,
    SeqOutput,
    SeqStatus,
)

__all__ = [
    "BatchScheduler",
    "BlockPool",
    "ScheduledStep",
    "Seq",
    "SeqOutput",
    "SeqStatus",
    "block_hash",
]
