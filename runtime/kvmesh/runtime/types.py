"""The shared domain types: requests, outputs, sampling and stop options, model and load info,
and the KV transfer descriptors of disaggregated serving.

They belong to no component: the gateway builds EngineRequests, the router reads ModelInfo and
LoadInfo, engines consume requests and produce EngineOutputs, and kvmesh.runtime.wire converts
each to and from its protobuf message. The engine contract that uses them is
kvmesh.workers.engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvmesh.runtime.kv_events import KvTier
from kvmesh.runtime.tracing import TraceContext


class FinishReason(enum.Enum):
    """Why a sequence ended."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


class Role(enum.Enum):
    """The part a worker plays."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class GuidedKind(enum.Enum):
    """Kinds of structured-output constraint (kvmesh.api.common.v1.GuidedDecoding)."""

    JSON_SCHEMA = "json_schema"
    """`value`: a JSON Schema document (JSON text) the output must validate against."""
    JSON_OBJECT = "json_object"
    """Any syntactically valid JSON object; `value` is empty."""
    REGEX = "regex"
    """`value`: a regular expression the whole output must match."""
    GRAMMAR = "grammar"
    """`value`: an EBNF / GBNF grammar."""
    CHOICE = "choice"
    """`choices`: the output is exactly one of them."""


@dataclass(slots=True)
class GuidedDecoding:
    """A structured-output constraint. Engines without the GUIDED_DECODING capability never
    receive one (the gateway refuses such requests)."""

    kind: GuidedKind
    value: str = ""
    """The schema, regex or grammar text (empty for JSON_OBJECT and CHOICE)."""
    choices: tuple[str, ...] = ()
    """The allowed outputs of CHOICE."""


@dataclass(slots=True)
class SamplingParams:
    """Sampling knobs with their semantic defaults (validated by the worker server)."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    """None: the engine picks a random seed."""
    top_logprobs: int | None = None
    """None: no logprobs; 0: only the chosen token's; k: plus k alternatives."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    guided: GuidedDecoding | None = None
    """Structured-output constraint; None: unconstrained."""


@dataclass(slots=True)
class StopParams:
    """When to stop."""

    max_tokens: int | None = None
    """None: until the context window is full."""
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop token ids (EOS ids from the model card always stop unless ignore_eos)."""
    ignore_eos: bool = False


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of a generated token and its top alternatives (token id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    """Token accounting of one sequence."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


# --- disaggregated serving (kvmesh.api.common.v1 KvLayout ... RemotePrefillResult) -----------


@dataclass(slots=True, frozen=True)
class KvLayout:
    """Shape of a KV block in memory, so a puller can compute offsets and check compatibility."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    """Element type name, e.g. "bfloat16"."""
    block_bytes: int
    """Bytes of one block across all layers, keys and values."""
    chunk_bytes: int = 0
    """Bytes of one contiguous piece of a block (pieces ordered by layer, keys before values);
    0: a block is one contiguous region."""
    chunk_stride_bytes: int = 0
    """Distance from one piece of a block to the next (unused when chunk_bytes is 0)."""

    def compatible(self, other: KvLayout) -> bool:
        """Whether KV of `other`'s blocks can be used as KV of this layout's blocks."""
        return (
            self.num_layers == other.num_layers
            and self.num_kv_heads == other.num_kv_heads
            and self.head_dim == other.head_dim
            and self.block_size == other.block_size
            and self.dtype == other.dtype
            and self.block_bytes == other.block_bytes
        )


@dataclass(slots=True, frozen=True)
class KvBlockDescriptor:
    """Where one pinned block sits in the prefill worker's registered memory."""

    block_hash: int
    """The prefill engine's hash of the block; 0 for a partial (unhashed) last block."""
    address: int
    """Address of the block (of its first piece, for a chunked layout)."""
    length_bytes: int
    device_id: int = 0
    """GPU ordinal; 0 for host memory."""


@dataclass(slots=True)
class KvTransferHandle:
    """What a decode worker needs to pull a prompt's KV from the prefill worker holding it."""

    transfer_id: str
    layout: KvLayout
    blocks: list[KvBlockDescriptor]
    """The prompt's blocks in order (the last one partial when the prompt does not fill it)."""
    num_computed_tokens: int
    """Prompt tokens whose KV the blocks hold."""
    agent_name: str = ""
    """NIXL agent of the prefill worker; empty: not NIXL (e.g. the mocker's simulation)."""
    agent_metadata: bytes = b""
    """NIXL agent metadata (add_remote_agent)."""
    memory_kind: str = "DRAM"
    """"DRAM" (host memory) or "VRAM" (GPU memory)."""
    expires_after_ms: int = 0
    """The prefill worker frees the blocks by itself after this long without release."""
    prefill_worker_id: str = ""
    prefill_address: str = ""
    """gRPC address of the prefill worker (set by its worker server)."""

    @property
    def total_bytes(self) -> int:
        """Bytes of every block of the handle."""
        return sum(b.length_bytes for b in self.blocks)


@dataclass(slots=True)
class RemotePrefill:
    """The result of a remote prefill, handed to the decode worker with the request."""

    first_token_id: int
    first_logprob: TokenLogprob | None = None
    handle: KvTransferHandle | None = None
    """Where the prompt KV is; None: the decode worker recomputes it (or the engine moves it
    by its own means, described in engine_params_json)."""
    engine_params_json: str = ""
    """Engine-specific transfer parameters (vLLM kv_transfer_params, SGLang bootstrap room,
    TRT-LLM disaggregated_params) as a JSON object; empty: none."""
    cached_tokens: int = 0
    """Prompt tokens the prefill worker served from its prefix cache."""


@dataclass(slots=True)
class PrefillResult:
    """What Engine.prefill_remote returns."""

    remote: RemotePrefill
    usage: Usage
    """Prompt tokens, 1 completion token, cached tokens on the prefill side."""
    finish_reason: FinishReason | None = None
    """Set when the first token already ends the request (nothing is pinned then)."""
    stop_token_id: int | None = None


@dataclass(frozen=True, slots=True)
class MediaInput:
    """A non-text input (an image) of a request, referenced by placeholder tokens in its
    prompt. The gateway decodes and checks images before sending them, so `data` is the
    image file's bytes (never a URL to fetch)."""

    mime_type: str
    """e.g. "image/png"; "": the engine sniffs the data."""
    data: bytes


@dataclass(slots=True)
class EngineRequest:
    """One generation request."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopParams = field(default_factory=StopParams)
    lora_name: str = ""
    priority: int = 0
    remote_prefill: RemotePrefill | None = None
    """Set on a decode worker: the prompt was prefilled remotely (see the module docstring)."""
    resumed_output_tokens: int = 0
    """Request migration: the last this-many `prompt` tokens are output the request generated
    before (on another worker, or before it was paused); the engine continues that output (they
    count as output for penalties and the sampling stream). `stop` counts only what is still to
    generate. Needs the RESUME capability. 0: a new request."""
    media: tuple[MediaInput, ...] = ()
    """Images the prompt's placeholder tokens stand for (engines with MULTIMODAL only)."""
    trace: TraceContext | None = None
    """The caller's span (W3C trace context from gRPC metadata): the engine's spans (queue,
    prefill, kv_transfer, decode) are its children. None: no trace."""


@dataclass(slots=True)
class EngineOutput:
    """Tokens generated since the previous output; the last one carries finish_reason/usage."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_token_id: int | None = None
    kv_transfer_bytes: int = 0
    """Last output of a remote-prefilled request: prompt KV bytes pulled."""
    remote_prefill_fallback: bool = False
    """Last output of a remote-prefilled request: the pulled KV could not be used and the
    prompt was recomputed locally."""


@dataclass(slots=True)
class ModelInfo:
    """What an engine serves; becomes the ModelCard on the wire."""

    served_model_name: str
    engine: str
    kv_block_size: int
    kv_total_blocks: int
    context_length: int
    model_path: str = ""
    role: Role = Role.AGGREGATED
    max_num_seqs: int = 0
    eos_token_ids: tuple[int, ...] = ()
    lora_adapters: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ()
    """Names of kvmesh.api.common.v1.EngineCapability values without the prefix, e.g.
    "KV_EVENTS", "LOGPROBS"."""
    image_token_id: int | None = None
    """MULTIMODAL models: the image placeholder token (kvmesh.runtime.multimodal)."""
    tokens_per_image: int = 0
    """MULTIMODAL models: placeholder tokens per image in the prompt (0: none)."""


@dataclass(slots=True)
class LoadInfo:
    """Instantaneous load; becomes LoadMetrics on the wire."""

    num_running: int = 0
    num_waiting: int = 0
    kv_active_blocks: int = 0
    kv_total_blocks: int = 0
    pending_prefill_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    requests_finished_total: int = 0
    preemptions_total: int = 0
    kv_pinned_blocks: int = 0
    """Blocks pinned for remote prefill transfers (included in kv_active_blocks)."""
    kv_tiers: tuple[KvTierStats, ...] = ()
    """Per-tier cache counters: the device tier, then the host and disk tiers the engine has
    (empty: the engine reports none)."""
    spec_steps_total: int = 0
    """Speculative decoding: verification chunks run (one per drafting request per step)."""
    spec_draft_tokens_total: int = 0
    """Draft tokens proposed and verified."""
    spec_accepted_tokens_total: int = 0
    """Draft tokens the model accepted (acceptance rate: accepted / draft)."""
    spec_emitted_tokens_total: int = 0
    """Tokens the verification chunks produced (tokens per step: emitted / steps)."""
    spec_skipped_steps_total: int = 0
    """Decode steps on which a request that could draft did not (adaptive drafting backing off
    after low acceptance)."""


@dataclass(slots=True, frozen=True)
class KvTierStats:
    """One tier's KV cache counters (kvmesh.api.common.v1.KvTierMetrics); lifetime counters
    count since the engine started."""

    tier: KvTier
    blocks: int = 0
    """Cached blocks the tier holds now."""
    capacity_blocks: int = 0
    """Blocks the tier can hold (0: unknown)."""
    hit_tokens: int = 0
    """Prompt tokens served from the tier instead of computed (device: prefix-cache hits; host,
    disk: onboarded to the device), at each request's first admission (as usage counts them)."""
    offload_blocks: int = 0
    """Blocks copied into the tier (host: from the device; disk: from the host)."""
    offload_bytes: int = 0
    onboard_blocks: int = 0
    """Blocks copied from the tier back to the device."""
    onboard_bytes: int = 0
    errors: int = 0
    """Blocks the tier failed to store or return (full or unwritable disk, corrupted file)."""
