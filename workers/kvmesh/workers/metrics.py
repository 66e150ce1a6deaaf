"""A worker's Prometheus metrics, under vLLM's metric names with the `kvmesh_worker_` prefix
(vLLM's `vllm:num_requests_running` is `kvmesh_worker_num_requests_running`), so dashboards and
alerts written for vLLM read them with a prefix change. Labels: `model`, `worker_id`, `role`.

Served by every worker on `--metrics-port` (kvmesh.runtime.metrics.MetricsServer):
- gauges from the engine's load (the numbers it also sends routers over gRPC as LoadMetrics):
  `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (0-1),
  `kv_cache_total_blocks`, `kv_pinned_blocks`, `prefix_cache_hit_rate` (0-1);
- counters: `num_preemptions_total`, `spec_decode_num_drafts_total`,
  `spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total` (vLLM's
  speculative decoding counters; acceptance rate = accepted / draft tokens) and
  `spec_decode_num_emitted_tokens_total` (tokens per drafting step = emitted / drafts),
  `prefix_cache_queries_total` / `prefix_cache_hits_total`
  (prompt tokens looked up / found in the prefix cache), `prompt_tokens_total`,
  `generation_tokens_total`, `request_success_total{finished_reason}`,
  `kv_transfer_bytes_total` (KV pulled by a decode worker), `kv_transfer_failures_total`
  (pulls whose KV could not be used: the prompt was recomputed),
  `external_prefix_cache_queries_total` / `external_prefix_cache_hits_total` (prompt tokens
  looked up in / taken from the KV connector instead of computed: on a decode worker, the
  KV pulled from the prefill worker; vLLM's connector prefix cache);
- histograms (engines that keep `EngineStats`: the mocker, the torch engine, vLLM):
  `time_to_first_token_seconds`, `inter_token_latency_seconds` (one observation per token gap,
  recorded per request as its mean), `e2e_request_latency_seconds`,
  `request_queue_time_seconds`, `request_prefill_time_seconds`, `request_decode_time_seconds`,
  `kv_transfer_seconds`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvmesh.runtime.metrics import Histogram
from kvmesh.runtime.types import FinishReason, LoadInfo, ModelInfo

__all__ = ["PREFIX", "EngineStats", "WorkerCollector"]

PREFIX = "kvmesh_worker_"

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class EngineStats:
    """Per-request timings and token counts an engine core records (on its event loop)."""

    __slots__ = (
        "decode",
        "e2e",
        "external_prefix_hit_tokens",
        "external_prefix_query_tokens",
        "finished",
        "generation_tokens",
        "itl",
        "kv_transfer",
        "kv_transfer_bytes",
        "kv_transfer_failures",
        "prefill",
        "prefix_hit_tokens",
        "prefix_query_tokens",
        "prompt_tokens",
        "queue",
        "ttft",
    )

    def __init__(self) -> None:
        self.ttft = Histogram(LATENCY_BUCKETS)
        """Arrival at this engine to its first output token."""
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        """Arrival to first admission by the scheduler."""
        self.prefill = Histogram(LATENCY_BUCKETS)
        """First admission to the first token (local prefills)."""
        self.decode = Histogram(LATENCY_BUCKETS)
        """First token (or, continuing a remote prefill, admission) to the last."""
        self.kv_transfer = Histogram(LATENCY_BUCKETS)
        self.kv_transfer_bytes = 0
        """Prompt KV bytes pulled from prefill workers (decode side)."""
        self.kv_transfer_failures = 0
        """KV pulls whose KV could not be used (the prompt was recomputed)."""
        self.external_prefix_query_tokens = 0
        """Prompt tokens looked up in the KV connector (vLLM's connector prefix cache)."""
        self.external_prefix_hit_tokens = 0
        """Prompt tokens taken from the KV connector instead of computed (on a decode worker:
        the prompt KV pulled from the prefill worker)."""
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.finished: dict[FinishReason, int] = {}


class WorkerCollector:
    """Collector of one worker: its engine's load (`load()`), card (`info()`) and stats."""

    def __init__(
        self,
        worker_id: str,
        info: Callable[[], ModelInfo],
        load: Callable[[], LoadInfo],
        stats: EngineStats | None,
    ) -> None:
        self._worker_id = worker_id
        self._info = info
        self._load = load
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        info = self._info()
        load = self._load()
        names = ["model", "worker_id", "role"]
        labels = [info.served_model_name, self._worker_id, info.role.value]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            c.add_metric(labels, value)
            return c

        total = load.kv_total_blocks
        yield gauge("num_requests_running", "Requests in the running batch.", load.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", load.num_waiting)
        yield gauge(
            "kv_cache_usage_perc",
            "KV cache usage: fraction of the KV blocks in use (1 = full).",
            load.kv_active_blocks / total if total else 0.0,
        )
        yield gauge("kv_cache_total_blocks", "KV cache blocks of the engine.", total)
        yield gauge(
            "kv_pinned_blocks",
            "KV blocks pinned for decode workers to pull (prefill workers).",
            load.kv_pinned_blocks,
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up, since start.",
            load.prefix_cache_hit_rate,
        )
        yield counter(
            "num_preemptions", "Requests preempted (recomputed later).", load.preemptions_total
        )
        for name, doc, value in (
            ("spec_decode_num_drafts", "Speculative verification chunks (one per drafting "
             "request per step).", load.spec_steps_total),
            ("spec_decode_num_draft_tokens", "Speculative draft tokens verified.",
             load.spec_draft_tokens_total),
            ("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
             load.spec_accepted_tokens_total),
            ("spec_decode_num_emitted_tokens", "Tokens the speculative verification chunks "
             "produced (accepted drafts + one model token each).", load.spec_emitted_tokens_total),
            ("spec_decode_num_skipped_steps", "Decode steps a request that could draft did not "
             "(adaptive drafting backing off after low acceptance).",
             load.spec_skipped_steps_total),
        ):  # fmt: skip
            yield counter(name, doc, value)
        stats = self._stats
        if stats is None:
            return
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_query_tokens,
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hit_tokens
        )
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", stats.prompt_tokens)
        yield counter(
            "generation_tokens", "Tokens generated by this engine.", stats.generation_tokens
        )
        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            labels=[*names, "finished_reason"],
        )
        for reason in FinishReason:
            success.add_metric([*labels, reason.value], stats.finished.get(reason, 0))
        yield success
        for name, doc, value in (
            ("kv_transfer_bytes", "Prompt KV bytes pulled from prefill workers.",
             stats.kv_transfer_bytes),
            ("kv_transfer_failures", "KV pulls whose KV could not be used (the prompt was "
             "recomputed).", stats.kv_transfer_failures),
            ("external_prefix_cache_queries", "Prompt tokens looked up in the KV connector.",
             stats.external_prefix_query_tokens),
            ("external_prefix_cache_hits", "Prompt tokens taken from the KV connector instead "
             "of computed (a decode worker: KV pulled from the prefill worker).",
             stats.external_prefix_hit_tokens),
        ):  # fmt: skip
            yield counter(name, doc, value)
        specs = (
            ("time_to_first_token_seconds", "Arrival at the engine to the first token.", "ttft"),
            ("inter_token_latency_seconds", "Time between consecutive tokens.", "itl"),
            ("e2e_request_latency_seconds", "Arrival at the engine to the last token.", "e2e"),
            ("request_queue_time_seconds", "Time waiting to be scheduled.", "queue"),
            ("request_prefill_time_seconds", "Admission to the first token.", "prefill"),
            ("request_decode_time_seconds", "First token to the last.", "decode"),
            ("kv_transfer_seconds", "KV pulls from prefill workers (decode side).", "kv_transfer"),
        )
        for suffix, doc, attr in specs:
            hist: Histogram = getattr(stats, attr)
            family = HistogramMetricFamily(PREFIX + suffix, doc, labels=names)
            family.add_metric(labels, hist.buckets(), hist.total)
            yield family
