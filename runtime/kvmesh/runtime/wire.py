"""Conversions between the protobuf contract and the engine's typed messages.

Both directions live here so the worker server and its clients (router, gateway) agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.runtime import kv_events as kv
from kvmesh.runtime.errors import InvalidRequest, Unimplemented
from kvmesh.runtime.types import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    GuidedDecoding,
    GuidedKind,
    KvBlockDescriptor,
    KvLayout,
    KvTierStats,
    KvTransferHandle,
    LoadInfo,
    MediaInput,
    ModelInfo,
    PrefillResult,
    RemotePrefill,
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


def role_to_pb(role: Role) -> cpb.WorkerRole.ValueType:
    """Role -> WorkerRole."""
    return _ROLE_TO_PB[role]


def role_from_pb(role: int) -> Role | None:
    """WorkerRole -> Role; None for UNSPECIFIED and unknown values."""
    return _ROLE_FROM_PB.get(cpb.WorkerRole.ValueType(role))


# --- requests -------------------------------------------------------------------------------


def sampling_to_pb(s: SamplingParams) -> cpb.SamplingOptions:
    """SamplingParams -> SamplingOptions (every knob set explicitly)."""
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
    return sampling


def stop_to_pb(st: StopParams) -> cpb.StopConditions:
    """StopParams -> StopConditions."""
    stop = cpb.StopConditions(
        min_tokens=st.min_tokens, stop_token_ids=st.stop_token_ids, ignore_eos=st.ignore_eos
    )
    if st.max_tokens is not None:
        stop.max_tokens = st.max_tokens
    return stop


def request_to_pb(req: EngineRequest) -> wpb.GenerateRequest:
    """EngineRequest -> GenerateRequest."""
    msg = wpb.GenerateRequest(
        request_id=req.request_id,
        token_ids=req.prompt,
        sampling=sampling_to_pb(req.sampling),
        stop=stop_to_pb(req.stop),
        lora_name=req.lora_name,
        priority=req.priority,
        resumed_output_tokens=req.resumed_output_tokens,
    )
    if req.remote_prefill is not None:
        msg.remote_prefill.CopyFrom(remote_prefill_to_pb(req.remote_prefill))
    if req.media:
        msg.media.extend(media_to_pb(req.media))
    return msg


def media_to_pb(media: Sequence[MediaInput]) -> list[cpb.MediaInput]:
    """MediaInputs -> MediaInput messages (bytes, never URLs)."""
    return [cpb.MediaInput(mime_type=m.mime_type, data=m.data) for m in media]


def media_from_pb(media: Sequence[cpb.MediaInput]) -> tuple[MediaInput, ...]:
    """MediaInput messages -> MediaInputs. InvalidRequest for a URL source (workers do not
    fetch: the gateway sends the bytes) or an empty one."""
    out: list[MediaInput] = []
    for i, m in enumerate(media):
        if m.WhichOneof("source") != "data" or not m.data:
            raise InvalidRequest(
                f"media[{i}] must carry its bytes in 'data' (workers do not fetch URLs)",
                param="media",
            )
        out.append(MediaInput(m.mime_type, m.data))
    return tuple(out)


def sampling_from_pb(s: cpb.SamplingOptions) -> SamplingParams:
    """SamplingOptions -> SamplingParams; unset optionals take their semantic defaults."""
    return SamplingParams(
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


def stop_from_pb(st: cpb.StopConditions) -> StopParams:
    """StopConditions -> StopParams."""
    return StopParams(
        max_tokens=st.max_tokens if st.HasField("max_tokens") else None,
        min_tokens=st.min_tokens,
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
    )


def _refuse_uncarried(msg: wpb.GenerateRequest | wpb.PrefillRemoteRequest) -> None:
    """Unimplemented for the fields an EngineRequest has no place for (no engine implements
    them yet): refused here, where they would otherwise be dropped."""
    if msg.engine_params_json:
        raise Unimplemented(
            "engine_params_json is not supported on requests: no kvmesh engine reads it yet",
            param="engine_params_json",
        )


def request_from_pb(msg: wpb.GenerateRequest, default_id: str) -> EngineRequest:
    """GenerateRequest -> EngineRequest; unset optionals take their semantic defaults.
    Unimplemented for fields no engine implements (engine_params_json)."""
    _refuse_uncarried(msg)
    return EngineRequest(
        request_id=msg.request_id or default_id,
        prompt=list(msg.token_ids),
        sampling=sampling_from_pb(msg.sampling),
        stop=stop_from_pb(msg.stop),
        lora_name=msg.lora_name,
        priority=msg.priority,
        remote_prefill=(
            remote_prefill_from_pb(msg.remote_prefill) if msg.HasField("remote_prefill") else None
        ),
        resumed_output_tokens=msg.resumed_output_tokens,
        media=media_from_pb(msg.media),
    )


# --- disaggregated serving --------------------------------------------------------------------


def prefill_request_to_pb(
    req: EngineRequest, decode_worker_id: str = ""
) -> wpb.PrefillRemoteRequest:
    """EngineRequest -> PrefillRemoteRequest (for the prefill worker of a disaggregated request)."""
    return wpb.PrefillRemoteRequest(
        request_id=req.request_id,
        token_ids=req.prompt,
        sampling=sampling_to_pb(req.sampling),
        lora_name=req.lora_name,
        decode_worker_id=decode_worker_id,
        stop=stop_to_pb(req.stop),
        media=media_to_pb(req.media),
    )


def prefill_request_from_pb(msg: wpb.PrefillRemoteRequest, default_id: str) -> EngineRequest:
    """PrefillRemoteRequest -> EngineRequest (unset stop: the first token never ends it).
    Unimplemented for fields no engine implements (engine_params_json)."""
    _refuse_uncarried(msg)
    return EngineRequest(
        request_id=msg.request_id or default_id,
        prompt=list(msg.token_ids),
        sampling=sampling_from_pb(msg.sampling),
        stop=stop_from_pb(msg.stop) if msg.HasField("stop") else StopParams(ignore_eos=True),
        lora_name=msg.lora_name,
        media=media_from_pb(msg.media),
    )


def layout_to_pb(layout: KvLayout) -> cpb.KvLayout:
    """KvLayout -> KvLayout message."""
    return cpb.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size_tokens=layout.block_size,
        dtype=layout.dtype,
        block_bytes=layout.block_bytes,
        chunk_bytes=layout.chunk_bytes,
        chunk_stride_bytes=layout.chunk_stride_bytes,
    )


def layout_from_pb(msg: cpb.KvLayout) -> KvLayout:
    """KvLayout message -> KvLayout."""
    return KvLayout(
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size_tokens,
        dtype=msg.dtype,
        block_bytes=msg.block_bytes,
        chunk_bytes=msg.chunk_bytes,
        chunk_stride_bytes=msg.chunk_stride_bytes,
    )


def handle_to_pb(handle: KvTransferHandle) -> cpb.KvTransferHandle:
    """KvTransferHandle -> KvTransferHandle message."""
    return cpb.KvTransferHandle(
        transfer_id=handle.transfer_id,
        prefill_worker_id=handle.prefill_worker_id,
        prefill_address=handle.prefill_address,
        nixl_agent_name=handle.agent_name,
        nixl_agent_metadata=handle.agent_metadata,
        layout=layout_to_pb(handle.layout),
        blocks=[
            cpb.KvBlockDescriptor(
                block_hash=b.block_hash,
                address=b.address,
                length_bytes=b.length_bytes,
                device_id=b.device_id,
            )
            for b in handle.blocks
        ],
        num_computed_tokens=handle.num_computed_tokens,
        memory_kind=handle.memory_kind,
        expires_after_ms=handle.expires_after_ms,
    )


def handle_from_pb(msg: cpb.KvTransferHandle) -> KvTransferHandle:
    """KvTransferHandle message -> KvTransferHandle."""
    return KvTransferHandle(
        transfer_id=msg.transfer_id,
        layout=layout_from_pb(msg.layout),
        blocks=[
            KvBlockDescriptor(b.block_hash, b.address, b.length_bytes, b.device_id)
            for b in msg.blocks
        ],
        num_computed_tokens=msg.num_computed_tokens,
        agent_name=msg.nixl_agent_name,
        agent_metadata=msg.nixl_agent_metadata,
        memory_kind=msg.memory_kind or "DRAM",
        expires_after_ms=msg.expires_after_ms,
        prefill_worker_id=msg.prefill_worker_id,
        prefill_address=msg.prefill_address,
    )


def _logprob_to_pb(lp: TokenLogprob) -> cpb.TokenLogprob:
    return cpb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[cpb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
    )


def _logprob_from_pb(lp: cpb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])


def remote_prefill_to_pb(rp: RemotePrefill) -> cpb.RemotePrefillResult:
    """RemotePrefill -> RemotePrefillResult."""
    msg = cpb.RemotePrefillResult(
        first_token_id=rp.first_token_id,
        engine_params_json=rp.engine_params_json,
        cached_tokens=rp.cached_tokens,
    )
    if rp.first_logprob is not None:
        msg.first_token_logprob.CopyFrom(_logprob_to_pb(rp.first_logprob))
    if rp.handle is not None:
        msg.handle.CopyFrom(handle_to_pb(rp.handle))
    return msg


def remote_prefill_from_pb(msg: cpb.RemotePrefillResult) -> RemotePrefill:
    """RemotePrefillResult -> RemotePrefill."""
    return RemotePrefill(
        first_token_id=msg.first_token_id,
        first_logprob=(
            _logprob_from_pb(msg.first_token_logprob)
            if msg.HasField("first_token_logprob")
            else None
        ),
        handle=handle_from_pb(msg.handle) if msg.HasField("handle") else None,
        engine_params_json=msg.engine_params_json,
        cached_tokens=msg.cached_tokens,
    )


def prefill_result_to_pb(result: PrefillResult) -> wpb.PrefillRemoteResponse:
    """PrefillResult -> PrefillRemoteResponse."""
    u = result.usage
    msg = wpb.PrefillRemoteResponse(
        result=remote_prefill_to_pb(result.remote),
        usage=cpb.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens,
        ),
        finish_reason=_FINISH_TO_PB[result.finish_reason],
    )
    if result.stop_token_id is not None:
        msg.stop_token_id = result.stop_token_id
    return msg


def prefill_result_from_pb(msg: wpb.PrefillRemoteResponse) -> PrefillResult:
    """PrefillRemoteResponse -> PrefillResult."""
    u = msg.usage
    return PrefillResult(
        remote=remote_prefill_from_pb(msg.result),
        usage=Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens),
        finish_reason=_FINISH_FROM_PB.get(msg.finish_reason),
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
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
        msg.logprobs.extend(_logprob_to_pb(lp) for lp in out.logprobs)
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
    if out.kv_transfer_bytes:
        msg.kv_transfer_bytes = out.kv_transfer_bytes
    if out.remote_prefill_fallback:
        msg.remote_prefill_fallback = True


def output_from_pb(msg: wpb.GenerateResponse) -> EngineOutput:
    """GenerateResponse -> EngineOutput."""
    out = EngineOutput(list(msg.token_ids))
    if msg.logprobs:
        out.logprobs = [_logprob_from_pb(lp) for lp in msg.logprobs]
    if msg.finish_reason:
        out.finish_reason = _FINISH_FROM_PB.get(msg.finish_reason, FinishReason.STOP)
        u = msg.usage
        out.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
        if msg.HasField("stop_token_id"):
            out.stop_token_id = msg.stop_token_id
        out.kv_transfer_bytes = msg.kv_transfer_bytes
        out.remote_prefill_fallback = msg.remote_prefill_fallback
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
        image_token_id=info.image_token_id,
        tokens_per_image=info.tokens_per_image,
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
        image_token_id=card.image_token_id if card.HasField("image_token_id") else None,
        tokens_per_image=card.tokens_per_image,
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
        kv_pinned_blocks=load.kv_pinned_blocks,
        kv_tiers=[
            cpb.KvTierMetrics(
                tier=_TIER_TO_PB[t.tier],
                blocks=t.blocks,
                capacity_blocks=t.capacity_blocks,
                hit_tokens_total=t.hit_tokens,
                offload_blocks_total=t.offload_blocks,
                offload_bytes_total=t.offload_bytes,
                onboard_blocks_total=t.onboard_blocks,
                onboard_bytes_total=t.onboard_bytes,
                errors_total=t.errors,
            )
            for t in load.kv_tiers
        ],
        spec_steps_total=load.spec_steps_total,
        spec_draft_tokens_total=load.spec_draft_tokens_total,
        spec_accepted_tokens_total=load.spec_accepted_tokens_total,
        spec_emitted_tokens_total=load.spec_emitted_tokens_total,
        spec_skipped_steps_total=load.spec_skipped_steps_total,
    )


def device_cached_blocks(m: cpb.LoadMetrics) -> int:
    """Blocks of reusable prefix-cache content in a worker's device tier (0: none reported):
    what routing to it would reuse, and what draining it loses."""
    device = (cpb.KV_TIER_DEVICE, cpb.KV_TIER_UNSPECIFIED)
    return sum(t.blocks for t in m.kv_tiers if t.tier in device)


def load_from_pb(m: cpb.LoadMetrics) -> LoadInfo:
    """LoadMetrics -> LoadInfo (tier entries of tiers this version does not know are left out)."""
    return LoadInfo(
        num_running=m.num_running_requests,
        num_waiting=m.num_waiting_requests,
        kv_active_blocks=m.kv_active_blocks,
        kv_total_blocks=m.kv_total_blocks,
        pending_prefill_tokens=m.pending_prefill_tokens,
        prefix_cache_hit_rate=m.prefix_cache_hit_rate,
        requests_finished_total=m.requests_finished_total,
        preemptions_total=m.preemptions_total,
        kv_pinned_blocks=m.kv_pinned_blocks,
        kv_tiers=tuple(
            KvTierStats(
                tier=_TIER_FROM_PB[t.tier],
                blocks=t.blocks,
                capacity_blocks=t.capacity_blocks,
                hit_tokens=t.hit_tokens_total,
                offload_blocks=t.offload_blocks_total,
                offload_bytes=t.offload_bytes_total,
                onboard_blocks=t.onboard_blocks_total,
                onboard_bytes=t.onboard_bytes_total,
                errors=t.errors_total,
            )
            for t in m.kv_tiers
            if t.tier in _TIER_FROM_PB
        ),
        spec_steps_total=m.spec_steps_total,
        spec_draft_tokens_total=m.spec_draft_tokens_total,
        spec_accepted_tokens_total=m.spec_accepted_tokens_total,
        spec_emitted_tokens_total=m.spec_emitted_tokens_total,
        spec_skipped_steps_total=m.spec_skipped_steps_total,
    )


# --- KV events ------------------------------------------------------------------------------

_TIER_TO_PB = {
    kv.KvTier.DEVICE: cpb.KV_TIER_DEVICE,
    kv.KvTier.HOST: cpb.KV_TIER_HOST,
    kv.KvTier.DISK: cpb.KV_TIER_DISK,
}
_TIER_FROM_PB = {v: k for k, v in _TIER_TO_PB.items()} | {cpb.KV_TIER_UNSPECIFIED: kv.KvTier.DEVICE}


def tier_from_pb(tier: cpb.KvTier.ValueType) -> kv.KvTier | None:
    """KvTier -> kv.KvTier (UNSPECIFIED: DEVICE); None for a value this version does not know."""
    return _TIER_FROM_PB.get(tier)


def stored_to_pb(ev: kv.BlocksStored) -> cpb.KvBlocksStored:
    """BlocksStored -> KvBlocksStored."""
    msg = cpb.KvBlocksStored(
        blocks=[cpb.KvBlock(block_hash=b.block_hash, token_ids=b.token_ids) for b in ev.blocks],
        lora_name=ev.lora_name,
        tier=_TIER_TO_PB[ev.tier],
    )
    if ev.parent_hash is not None:
        msg.parent_block_hash = ev.parent_hash
    return msg


def stored_from_pb(msg: cpb.KvBlocksStored, tier: kv.KvTier = kv.KvTier.DEVICE) -> kv.BlocksStored:
    """KvBlocksStored -> BlocksStored on `tier` (the caller resolves msg.tier: tier_from_pb)."""
    return kv.BlocksStored(
        parent_hash=msg.parent_block_hash if msg.HasField("parent_block_hash") else None,
        blocks=[kv.StoredBlock(b.block_hash, tuple(b.token_ids)) for b in msg.blocks],
        lora_name=msg.lora_name,
        tier=tier,
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
            cpb.KvBlocksRemoved(block_hashes=kind.block_hashes, tier=_TIER_TO_PB[kind.tier])
        )
    else:
        event.cleared.SetInParent()
    return wpb.SubscribeKvEventsResponse(event=event)


@dataclass(slots=True, frozen=True)
class SkippedKvEvent:
    """A KV event a reader must leave out, and why: blocks stored in or removed from a tier this
    version does not know, or an event of a kind it does not know. Its id still counts in the
    stream's sequence."""

    event_id: int
    reason: str


def _tier_name(tier: cpb.KvTier.ValueType) -> str:
    return cpb.KvTier.Name(tier) if tier in cpb.KvTier.values() else str(int(tier))


def kv_item_from_pb(
    msg: wpb.SubscribeKvEventsResponse,
) -> kv.SnapshotChunk | kv.KvEventRecord | SkippedKvEvent:
    """One stream message -> a snapshot chunk or event record, each block on its tier
    (UNSPECIFIED: the device): snapshot chains on unknown tiers are left out, events on unknown
    tiers (and of unknown kinds) become SkippedKvEvent."""
    if msg.HasField("snapshot"):
        s = msg.snapshot
        chains: list[kv.BlocksStored] = []
        for c in s.chains:
            tier = _TIER_FROM_PB.get(c.tier)
            if tier is not None:
                chains.append(stored_from_pb(c, tier))
        return kv.SnapshotChunk(
            as_of_event_id=s.as_of_event_id, chains=chains, first=s.first, last=s.last
        )
    e = msg.event
    which = e.WhichOneof("kind")
    kind: kv.KvEventKind
    if which == "stored":
        tier = _TIER_FROM_PB.get(e.stored.tier)
        if tier is None:
            return SkippedKvEvent(e.event_id, f"stored on tier {_tier_name(e.stored.tier)}")
        kind = stored_from_pb(e.stored, tier)
    elif which == "removed":
        tier = _TIER_FROM_PB.get(e.removed.tier)
        if tier is None:
            return SkippedKvEvent(e.event_id, f"removed from tier {_tier_name(e.removed.tier)}")
        kind = kv.BlocksRemoved(list(e.removed.block_hashes), tier)
    elif which == "cleared":
        kind = kv.AllCleared()
    else:
        return SkippedKvEvent(e.event_id, "unknown event kind")
    return kv.KvEventRecord(e.event_id, kind)
