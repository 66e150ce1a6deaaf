"""`kvmesh replay`: aggregated replay, every worker serving whole requests.

Each request is routed by the policy of the router mode (kvmesh.sim.policies: the live
KvScheduler fed by the workers' own KV events and load metrics, or the live round-robin, random
and least-loaded choice) among all workers, and runs there from prefill to its last token, on
the virtual-time cluster of kvmesh.sim.cluster. Traces: kvmesh.sim.trace; metrics:
kvmesh.sim.results.
"""

from __future__ import annotations

from kvmesh.router.routing import RouterMode
from kvmesh.sim.cluster import Cluster, Progress, SimWorker
from kvmesh.sim.config import ReplayConfig
from kvmesh.sim.policies import make_policy
from kvmesh.sim.results import ModeResult
from kvmesh.sim.trace import Trace
from kvmesh.workers.batching.scheduler import SeqOutput

__all__ = ["AggregatedReplay", "simulate"]


class AggregatedReplay:
    """Requests go to the policy's choice among all workers and finish there."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.overlap_blocks = 0
        self.prompt_blocks = 0

    def arrival(self, index: int, now: float) -> None:
        c = self.cluster
        request = c.request(index)
        route = c.policy.route(
            request.request_id,
            request.prompt,
            now,
            expected_output_tokens=c.trace.requests[index].max_tokens,
        )
        self.overlap_blocks += route.overlap_blocks
        self.prompt_blocks += route.prompt_blocks
        worker = c.workers[route.worker]
        if c.admit(worker, index, request):
            worker.requests += 1
            worker.prompt_tokens += len(request.prompt)

    def output(self, worker: SimWorker, out: SeqOutput, now: float) -> None:
        index = self.cluster.token(out)
        if out.finish_reason is not None:
            self.cluster.credit_cache(index, worker, out)
            self.cluster.finish(index)

    def transfer(self, index: int, now: float) -> None:
        raise AssertionError("an aggregated replay moves no KV")

    @property
    def predicted_overlap_rate(self) -> float:
        """Leading prompt blocks the router found on its choices / prompt blocks."""
        return self.overlap_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def simulate(
    trace: Trace, config: ReplayConfig, mode: RouterMode, *, progress: Progress | None = None
) -> ModeResult:
    """Replay `trace` on `config.workers` workers routed by `mode` and return the metrics.

    `progress(settled, total, sim_time_s)` is called now and then (and once at the end)."""
    worker_ids = [f"w{i}" for i in range(config.workers)]
    cluster = Cluster(trace, config, worker_ids, make_policy(mode, worker_ids, config))
    replay = AggregatedReplay(cluster)
    cluster.run(replay, progress)
    return cluster.summarize(mode.value, replay.predicted_overlap_rate)
