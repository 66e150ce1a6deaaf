"""`kvmesh replay --prefill-workers N`: disaggregated replay, for comparing aggregated and
disaggregated pools of the same total size.

`--workers` W workers become N prefill and W - N decode mockers on the virtual-time cluster of
kvmesh.sim.cluster, routed by the live KvScheduler (kvmesh.sim.policies.KvPolicy) the way the
gateway's MeshBackend routes them (kvmesh.router.backend), and deciding where to prefill with
the gateway's own conditional disaggregation (`local_prefill_reason`, `--disagg-*` flags):

  * arrival: the router picks a decode worker D among the decode workers (KV-aware cost, so
    D's cached prefix is known); if the request should prefill on D (the part of the prompt D
    does not cache is at most `--disagg-local-prefill-tokens`, no prefill worker, or every one
    has `--disagg-max-prefill-inflight` prefills in flight), D prefills it itself; otherwise
    the router picks a prefill worker P and P runs the prompt as a pinned request;
  * P's step that samples the first token: the first token is out (TTFT), P's prefill booking
    ends, P's blocks stay pinned, D reserves blocks for the prompt (its cached prefix needs no
    transfer) and the transfer of the other blocks starts: it lasts `MockerConfig.transfer_s`
    (fixed latency + bytes / `--kv-transfer-gbps`, `--kv-bytes-per-token` per token) in
    virtual time. D without room for the blocks recomputes the prompt instead (a fallback);
  * transfer end: P releases the pinned blocks, D caches the received blocks (KV events) and
    decodes after the first token (ahead of its waiting queue).

ITL includes the gap between the first token (from P) and the second (from D after the
transfer). A request's cached tokens are those of the worker that prefilled it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.backend import DisaggConfig, LocalPrefill, local_prefill_reason
from kvmesh.runtime.types import EngineRequest
from kvmesh.sim.cluster import Cluster, EventKind, Progress, SimWorker, prefill_id
from kvmesh.sim.config import ReplayConfig, ReplayError
from kvmesh.sim.policies import KvPolicy
from kvmesh.sim.results import ModeResult
from kvmesh.sim.trace import Trace
from kvmesh.workers.batching.scheduler import SeqOutput

__all__ = ["DisaggStats", "DisaggregatedReplay", "simulate_disaggregated"]


class DisaggStats:
    """Which path the requests of a disaggregated replay took."""

    __slots__ = (
        "blocks_in_use_at_end",
        "kv_transfer_bytes",
        "local_prefills",
        "remote_prefills",
        "transfer_fallbacks",
    )

    def __init__(self) -> None:
        self.remote_prefills = 0
        """Requests sent to a prefill worker."""
        self.local_prefills = dict.fromkeys(LocalPrefill, 0)
        """Requests prefilled on their decode worker, by reason (local_prefill_reason)."""
        self.transfer_fallbacks = 0
        """Prefilled remotely, but the decode worker had no room for the blocks: recomputed."""
        self.kv_transfer_bytes = 0
        self.blocks_in_use_at_end = 0
        """Blocks still referenced (pinned or held) when the replay ended: 0 unless requests
        were left unfinished."""

    @property
    def local_prefills_total(self) -> int:
        """Requests prefilled on their decode worker, whatever the reason."""
        return sum(self.local_prefills.values())


@dataclass(slots=True)
class _Transfer:
    """A KV transfer in flight: the blocks D reserved (the first `had` it held already) and
    their hashes, from prefill worker `source`."""

    blocks: list[int]
    hashes: list[int]
    had: int
    source: int


class DisaggregatedReplay:
    """Requests decode on the `decode` workers and prefill there or on the `prefill` workers
    (indices into the cluster's workers), as `disagg` decides (see the module doc)."""

    def __init__(
        self, cluster: Cluster, prefill: list[int], decode: list[int], disagg: DisaggConfig
    ) -> None:
        self.cluster = cluster
        self.prefill = prefill
        self.decode = decode
        self.disagg = disagg
        self.stats = DisaggStats()
        n = len(cluster.trace.requests)
        self.requests: list[EngineRequest | None] = [None] * n
        self.decode_of = [0] * n
        self.first_token = [0] * n
        self.remote = [False] * n
        self.transfers: dict[int, _Transfer] = {}
        self.overlap_blocks = 0
        self.prompt_blocks = 0

    def arrival(self, index: int, now: float) -> None:
        c = self.cluster
        request = self.requests[index] = c.request(index)
        prompt = request.prompt
        route = c.policy.route(
            request.request_id,
            prompt,
            now,
            candidates=self.decode,
            expected_output_tokens=c.trace.requests[index].max_tokens,
        )
        self.overlap_blocks += route.overlap_blocks
        self.prompt_blocks += route.prompt_blocks
        decode = c.workers[route.worker]
        self.decode_of[index] = decode.index
        decode.requests += 1
        decode.prompt_tokens += len(prompt)
        reason = local_prefill_reason(
            self.disagg,
            len(prompt),
            route.overlap_blocks * c.block_size,
            [c.policy.inflight(p) for p in self.prefill],
        )
        if reason is not None:
            self.stats.local_prefills[reason] += 1
            c.admit(decode, index, request)
            return
        prefill = c.workers[
            c.policy.route(prefill_id(index), prompt, now, candidates=self.prefill).worker
        ]
        prefill.requests += 1
        prefill.prompt_tokens += len(prompt)
        self.remote[index] = True
        self.stats.remote_prefills += 1
        c.admit(prefill, index, request, pin=True)

    def output(self, worker: SimWorker, out: SeqOutput, now: float) -> None:
        c = self.cluster
        index = c.token(out)
        if out.handoff:  # P sampled the first token: transfer the prompt to D
            self._handoff(worker, out, index)
        elif out.finish_reason is not None:
            # Credit the prefilling worker: D for a local prefill; P when the first token ended
            # the request there (after a handoff, P was credited then).
            if not self.remote[index] or worker.index != self.decode_of[index]:
                c.credit_cache(index, worker, out)
            c.finish(index)

    def _handoff(self, prefill: SimWorker, out: SeqOutput, index: int) -> None:
        c = self.cluster
        c.policy.finished(prefill_id(index))
        decode = c.workers[self.decode_of[index]]
        request = self.requests[index]
        assert request is not None
        self.first_token[index] = out.token_id
        c.credit_cache(index, prefill, out)
        reserved = decode.sched.reserve_prefilled(request.prompt)
        if reserved is None:  # no room on D: it recomputes the prompt
            self.stats.transfer_fallbacks += 1
            prefill.sched.release_pinned(request.request_id)
            c.admit(decode, index, request, first_token=out.token_id)
            return
        blocks, hashes, had = reserved
        mcfg = c.config.mocker
        nbytes = (len(blocks) - had) * mcfg.kv_block_bytes
        self.stats.kv_transfer_bytes += nbytes
        self.transfers[index] = _Transfer(blocks, hashes, had, prefill.index)
        c.schedule(mcfg.transfer_s(nbytes), EventKind.TRANSFER, index)

    def transfer(self, index: int, now: float) -> None:
        c = self.cluster
        t = self.transfers.pop(index)
        request = self.requests[index]
        assert request is not None
        c.workers[t.source].sched.release_pinned(request.request_id)
        decode = c.workers[self.decode_of[index]]
        decode.sched.commit_prefilled(t.blocks, t.hashes, t.had, request.prompt)
        c.flush_events(decode)
        if not c.admit(
            decode, index, request, first_token=self.first_token[index], blocks=t.blocks
        ):
            decode.sched.pool.release(t.blocks)

    @property
    def predicted_overlap_rate(self) -> float:
        """Leading prompt blocks the router found on its decode choices / prompt blocks."""
        return self.overlap_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


def simulate_disaggregated(
    trace: Trace, config: ReplayConfig, *, progress: Progress | None = None
) -> tuple[ModeResult, DisaggStats]:
    """Replay `trace` on `config.prefill_workers` prefill and `config.workers -
    config.prefill_workers` decode mockers with KV-aware routing and the conditional
    disaggregation of `config.disagg` (see the module doc)."""
    n_prefill = config.prefill_workers
    if not 0 < n_prefill < config.workers:
        raise ReplayError("--prefill-workers must be between 1 and --workers - 1")
    n_decode = config.workers - n_prefill
    worker_ids = [f"p{i}" for i in range(n_prefill)] + [f"d{i}" for i in range(n_decode)]
    cluster = Cluster(
        trace, config, worker_ids, KvPolicy(config.kv_router(), worker_ids, config.mocker)
    )
    replay = DisaggregatedReplay(
        cluster, list(range(n_prefill)), list(range(n_prefill, config.workers)), config.disagg
    )
    cluster.run(replay, progress)
    replay.stats.blocks_in_use_at_end = sum(w.sched.pool.num_used for w in cluster.workers)
    result = cluster.summarize(f"kv-disagg-{n_prefill}p{n_decode}d", replay.predicted_overlap_rate)
    return result, replay.stats
