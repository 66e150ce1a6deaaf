"""Conversions between the protobuf contract and the engine's typed messages.

Both directions live here so the worker server and its clients (router, gateway) agree.
"""

from __future__ import annotations

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.workers import kv_events as kv
from kvmesh.workers.engine import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    LoadInfo,
    ModelInfo,
    Role,
    SamplingParams,
    StopParams,
    TokenLogprob,
    Usage,
)

_FINISH_TO_PB = {
    None: cpb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: cpb.FINISH_REASON_STOP,
    FinishReason.LENGTH: cpb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: cpb.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_ROLE_TO_PB = {
    Role.AGGREGATED: cpb.WORKER_ROLE_AGGREGATED,
    Role.PREFILL: cpb.WORKER_ROLE_PREFILL,
    Role.DECODE: cpb.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}


# --- requests -------------------------------------------------------------------------------


def request_to_pb(req: EngineRequest) -> wpb.GenerateRequest:
    """EngineRequest -> GenerateRequest."""
    s, st = req.sampling, req.stop
    sampling = cpb.SamplingOptions(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        logit_bias=s.logit_bias,
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.top_logprobs is not None:
        sampling.top_logprobs = s.top_logprobs
    if s.guided is not None:
        guided_to_pb(s.guided, sampling.guided)
    stop = cpb.StopConditions(
        min_tokens=st.min_tokens, stop_token_ids=st.stop_token_ids, ignore_eos=st.ignore_eos
    )
    if st.max_tokens is not None:
        stop.max_tokens = st.max_tokens
    return wpb.GenerateRequest(
        request_id=req.request_id,
        token_ids=req.prompt,
        sampling=sampling,
        stop=stop,
        lora_name=req.lora_name,
        priority=req.priority,
    )


def request_from_pb(msg: wpb.GenerateRequest, default_id: str) -> EngineRequest:
    """GenerateRequest -> EngineRequest; unset optionals take their semantic defaults."""
    s, st = msg.sampling, msg.stop
    sampling = SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        min_p=s.min_p if s.HasField("min_p") else 0.0,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        top_logprobs=s.top_logprobs if s.HasField("top_logprobs") else None,
        logit_bias=dict(s.logit_bias),
        guided=guided_from_pb(s.guided) if s.HasField("guided") else None,
    )
    stop = StopParams(
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
    )
    return EngineRequest(
        request_id=msg.request_id or default_id,
        prompt=list(msg.token_ids),
        sampling=sampling,
        stop=stop,
        lora_name=msg.lora_name,
        priority=msg.priority,
    )


def guided_to_pb(guided: GuidedDecoding, msg: cpb.GuidedDecoding) -> None:
    """Write `guided` into the (empty) GuidedDecoding message `msg`."""
    kind = guided.kind
    if kind is GuidedKind.JSON_SCHEMA:
        msg.json_schema = guided.value
    elif kind is GuidedKind.JSON_OBJECT:
        msg.json_object = True
    elif kind is GuidedKind.REGEX:
        msg.regex = guided.value
    elif kind is GuidedKind.GRAMMAR:
        msg.grammar = guided.value
    else:
        msg.choices.choices.extend(guided.choices)


def guided_from_pb(msg: cpb.GuidedDecoding) -> GuidedDecoding | None:
    """GuidedDecoding message -> GuidedDecoding (None when no constraint is set)."""
    which = msg.WhichOneof("constraint")
    if which == "json_schema":
        return GuidedDecoding(GuidedKind.JSON_SCHEMA, msg.json_schema)
    if which == "json_object":
        return GuidedDecoding(GuidedKind.JSON_OBJECT) if msg.json_object else None
    if which == "regex":
        return GuidedDecoding(GuidedKind.REGEX, msg.regex)
    if which == "grammar":
        return GuidedDecoding(GuidedKind.GRAMMAR, msg.grammar)
    if which == "choices":
        return GuidedDecoding(GuidedKind.CHOICE, choices=tuple(msg.choices.choices))
    return None


# --- outputs --------------------------------------------------------------------------------


def output_to_pb(out: EngineOutput) -> wpb.GenerateResponse:
    """EngineOutput -> GenerateResponse."""
    msg = wpb.GenerateResponse()
    fill_output_pb(msg, out)
    return msg


def fill_output_pb(msg: wpb.GenerateResponse, out: EngineOutput) -> None:
    """Write `out` into an empty GenerateResponse (e.g. a field of a larger message)."""
    msg.token_ids.extend(out.token_ids)
    if out.logprobs:
        msg.logprobs.extend(
            cpb.TokenLogprob(
                token_id=lp.token_id,
                logprob=lp.logprob,
                top_logprobs=[cpb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
            )
            for lp in out.logprobs
        )
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_TO_PB[out.finish_reason]
    if out.usage is not None:
        u = out.usage
        msg.usage.CopyFrom(
            cpb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
            )
        )
    if out.stop_token_id is not None:
        msg.stop_token_id = out.stop_token_id


def output_from_pb(msg: wpb.GenerateResponse) -> EngineOutput:
    """GenerateResponse -> EngineOutput."""
    out = EngineOutput(list(msg.token_ids))
    if msg.logprobs:
        out.logprobs = [
            TokenLogprob(
                lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs]
            )
            for lp in msg.logprobs
        ]
    if msg.finish_reason:
        out.finish_reason = _FINISH_FROM_PB.get(msg.finish_reason, FinishReason.STOP)
        u = msg.usage
        out.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        if msg.HasField("stop_token_id"):
            out.stop_token_id = msg.stop_token_id
    return out


# --- model card and load --------------------------------------------------------------------


def card_to_pb(info: ModelInfo) -> cpb.ModelCard:
    """ModelInfo -> ModelCard."""
    return cpb.ModelCard(
        served_model_name=info.served_model_name,
        engine=info.engine,
        role=_ROLE_TO_PB[info.role],
        kv_block_size_tokens=info.kv_block_size,
        kv_total_blocks=info.kv_total_blocks,
        context_length_tokens=info.context_length,
        model_path=info.model_path,
        lora_adapters=info.lora_adapters,
        capabilities=[
            cpb.EngineCapability.Value(f"ENGINE_CAPABILITY_{c}") for c in info.capabilities
        ],
        max_num_seqs=info.max_num_seqs,
        eos_token_ids=info.eos_token_ids,
    )


def card_from_pb(card: cpb.ModelCard) -> ModelInfo:
    """ModelCard -> ModelInfo."""
    prefix = "ENGINE_CAPABILITY_"
    return ModelInfo(
        served_model_name=card.served_model_name,
        engine=card.engine,
        kv_block_size=card.kv_block_size_tokens,
        kv_total_blocks=card.kv_total_blocks,
        context_length=card.context_length_tokens,
        model_path=card.model_path,
        role=_ROLE_FROM_PB.get(card.role, Role.AGGREGATED),
        max_num_seqs=card.max_num_seqs,
        eos_token_ids=tuple(card.eos_token_ids),
        lora_adapters=tuple(card.lora_adapters),
        capabilities=tuple(
            cpb.EngineCapability.Name(c).removeprefix(prefix) for c in card.capabilities
        ),
    )


def load_to_pb(load: LoadInfo, *, timestamp_ms: int, draining: bool) -> cpb.LoadMetrics:
    """LoadInfo -> LoadMetrics."""
    return cpb.LoadMetrics(
        num_running_requests=load.num_running,
        num_waiting_requests=load.num_waiting,
        kv_active_blocks=load.kv_active_blocks,
        kv_total_blocks=load.kv_total_blocks,
        pending_prefill_tokens=load.pending_prefill_tokens,
        prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        timestamp_ms=timestamp_ms,
        requests_finished_total=load.requests_finished_total,
        preemptions_total=load.preemptions_total,
        draining=draining,
    )


# --- KV events ------------------------------------------------------------------------------


def stored_to_pb(ev: kv.BlocksStored) -> cpb.KvBlocksStored:
    """BlocksStored -> KvBlocksStored."""
    msg = cpb.KvBlocksStored(
        blocks=[cpb.KvBlock(block_hash=b.block_hash, token_ids=b.token_ids) for b in ev.blocks],
        lora_name=ev.lora_name,
        tier=cpb.KV_TIER_DEVICE,
    )
    if ev.parent_hash is not None:
        msg.parent_block_hash = ev.parent_hash
    return msg


def stored_from_pb(msg: cpb.KvBlocksStored) -> kv.BlocksStored:
    """KvBlocksStored -> BlocksStored."""
    return kv.BlocksStored(
        parent_hash=msg.parent_block_hash if msg.HasField("parent_block_hash") else None,
        blocks=[kv.StoredBlock(b.block_hash, tuple(b.token_ids)) for b in msg.blocks],
        lora_name=msg.lora_name,
    )


def kv_item_to_pb(
    item: kv.SnapshotChunk | kv.KvEventRecord, log_id: str = ""
) -> wpb.SubscribeKvEventsResponse:
    """A snapshot chunk or event record -> one stream message (log_id goes on snapshots)."""
    if isinstance(item, kv.SnapshotChunk):
        return wpb.SubscribeKvEventsResponse(
            snapshot=wpb.KvSnapshotChunk(
                as_of_event_id=item.as_of_event_id,
                chains=[stored_to_pb(c) for c in item.chains],
                first=item.first,
                last=item.last,
                log_id=log_id,
            )
        )
    event = cpb.KvEvent(event_id=item.event_id)
    kind = item.kind
    if isinstance(kind, kv.BlocksStored):
        event.stored.CopyFrom(stored_to_pb(kind))
    elif isinstance(kind, kv.BlocksRemoved):
        event.removed.CopyFrom(
            cpb.KvBlocksRemoved(block_hashes=kind.block_hashes, tier=cpb.KV_TIER_DEVICE)
        )
    else:
        event.cleared.SetInParent()
    return wpb.SubscribeKvEventsResponse(event=event)


def kv_item_from_pb(msg: wpb.SubscribeKvEventsResponse) -> kv.SnapshotChunk | kv.KvEventRecord:
    """One stream message -> a snapshot chunk or event record."""
    if msg.HasField("snapshot"):
        s = msg.snapshot
        return kv.SnapshotChunk(
            as_of_event_id=s.as_of_event_id,
            chains=[stored_from_pb(c) for c in s.chains],
            first=s.first,
            last=s.last,
        )
    e = msg.event
    which = e.WhichOneof("kind")
    kind: kv.KvEventKind
    if which == "stored":
        kind = stored_from_pb(e.stored)
    elif which == "removed":
        kind = kv.BlocksRemoved(list(e.removed.block_hashes))
    else:
        kind = kv.AllCleared()
    return kv.KvEventRecord(e.event_id, kind)
