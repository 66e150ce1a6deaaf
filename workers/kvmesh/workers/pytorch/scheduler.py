"""The torch engine's synchronous core: the shared continuous-batching scheduler
(kvmesh.workers.batching.scheduler, whose docstring explains scheduling, completion, aborts and
disaggregated serving) with real sampling state.

A step is split in two so the forward pass can run on another thread: `schedule()` (event-loop
thread) picks the work and returns SeqChunks (the token ids to compute, their start position, the
block table and, for chunks that reach the end of the known tokens, what the sampler needs);
`complete(step, sampled)` (event-loop thread, after the forward) applies the sampled tokens.

Stop token ids are EOS (unless ignore_eos) plus stop_token_ids; before min_tokens the sampler
masks them, so they are not generated at all. A guided request (structured output) gets its
grammar state when it is added (an invalid schema is refused then) and the state is advanced to
the request's output before each step that samples for it (kvmesh.workers.pytorch.guided).

A request with images (a multimodal model's `images` encoder) gets its pixels when it is added
(an undecodable image or a placeholder count that does not match is refused then); a chunk that
covers some of its placeholders carries them to the forward (kvmesh.workers.pytorch.vision), and
its block hashes cover the placeholders salted by the images' bytes
(kvmesh.runtime.multimodal), as the router's do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.kv_events import KvEventLog
from kvmesh.runtime.multimodal import placeholder_positions, salt_placeholders
from kvmesh.runtime.types import EngineRequest, LoadInfo
from kvmesh.workers.batching.scheduler import (
    BatchScheduler,
    SampledToken,
    Seq,
    SeqOutput,
    SeqStatus,
)
from kvmesh.workers.batching.scheduler import ScheduledStep as _Step
from kvmesh.workers.batching.tiers import KvTierConfig
from kvmesh.workers.pytorch.config import TorchConfig
from kvmesh.workers.pytorch.guided import GrammarCompiler, GrammarState
from kvmesh.workers.pytorch.lora import LoraAdapter
from kvmesh.workers.pytorch.model_runner import SeqChunk
from kvmesh.workers.pytorch.sampler import Sampled, SampleSpec
from kvmesh.workers.pytorch.speculative import DraftGate, SpecStats, accept, propose_ngram
from kvmesh.workers.pytorch.vision import ImageEncoder, RequestImages

__all__ = ["ScheduledStep", "SeqOutput", "SeqStatus", "TorchScheduler"]


_MASK64 = (1 << 64) - 1


def _position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for sequence `position` of the stream `seed` (splitmix64)."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class _Seq(Seq):
    """Scheduler state of one request, with what the sampler needs."""

    __slots__ = (
        "adapter",
        "bias_ids",
        "bias_values",
        "draft_len",
        "gate",
        "generator",
        "grammar",
        "images",
        "params",
        "seed",
        "suppress",
    )

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        super().__init__(request, arrival)
        self.adapter: LoraAdapter | None = None
        self.params = request.sampling
        self.generator: torch.Generator | None = None
        self.seed = 0
        """Sampled requests: the seed the generator is keyed by at each position."""
        self.suppress: tuple[int, ...] = ()
        self.grammar: GrammarState | None = None
        self.images: RequestImages | None = None
        self.gate: DraftGate | None = None
        """Speculative decoding: whether the request drafts (kvmesh.workers.pytorch.speculative)."""
        self.draft_len = 0
        """With a draft model: the leading positions whose draft-model KV is computed (it
        catches up on the rest when the request drafts; kvmesh.workers.pytorch.draft)."""
        bias = sorted(request.sampling.logit_bias.items())
        self.bias_ids = [t for t, _ in bias]
        self.bias_values = [float(b) for _, b in bias]


@dataclass(slots=True)
class ScheduledStep(_Step[_Seq]):
    """What one `schedule()` decided, with one SeqChunk per scheduled request."""

    chunks: list[SeqChunk] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    """Per scheduled request, the speculative draft tokens ending its chunk (0: none)."""


class TorchScheduler(BatchScheduler[_Seq, TorchConfig]):
    """Continuous-batching scheduler + KV block pool (see the module docstring).

    Synchronous and single-threaded (the engine's event loop). `vocab_size` bounds token ids;
    `eos_token_ids` stop generation unless a request sets ignore_eos; `max_model_len` is the
    longest sequence (prompt + output) a request may reach (also capped by what the pool holds
    and, without chunked prefill, by one step's budget); `device` is where per-request
    sampling generators live; `grammars` compiles structured-output constraints (None: guided
    requests are refused).
    """

    config: TorchConfig
    _limit_prompt_by_seq_len = True
    _report_watermark = False

    def __init__(
        self,
        config: TorchConfig,
        *,
        num_blocks: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        device: torch.device,
        events: KvEventLog | None = None,
        tiers: KvTierConfig | None = None,
        kv_block_bytes: int = 0,
        grammars: GrammarCompiler | None = None,
        images: ImageEncoder | None = None,
    ) -> None:
        super().__init__(
            config,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            events=events,
            tiers=tiers,
            kv_block_bytes=kv_block_bytes,
        )
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = device
        self.grammars = grammars
        self.images = images
        """The multimodal model's image encoder (None: requests with media are refused)."""
        self.num_computed_tokens = 0
        """Tokens whose KV the forward passes computed so far (prefill, recompute and decode)."""
        self.spec = SpecStats()
        """Speculative decoding counters (kvmesh.workers.pytorch.speculative)."""

    # -- requests ------------------------------------------------------------------------------

    def _check_request(self, request: EngineRequest) -> None:
        if request.sampling.guided is not None and self.grammars is None:
            raise InvalidRequest(
                "this torch engine has no grammar compiler (llguidance and the model's tokenizer "
                "are needed for guided decoding)",
                param="response_format",
            )
        if request.media:
            self._placeholders(request)
        vocab = self.vocab_size
        if request.prompt and max(request.prompt) >= vocab:
            raise InvalidRequest(
                f"prompt token ids must be < the vocabulary size {vocab}", param="prompt"
            )
        if request.prompt and any(t >= vocab for t in request.sampling.logit_bias):
            raise InvalidRequest(
                f"logit_bias token ids must be < the vocabulary size {vocab}", param="logit_bias"
            )

    def _placeholders(self, request: EngineRequest) -> list[int]:
        """Positions of the image placeholders of `request` (which has media)."""
        images = self.images
        if images is None:
            raise InvalidRequest("this model takes no images", param="media")
        prompt = request.prompt[: len(request.prompt) - request.resumed_output_tokens]
        return placeholder_positions(
            prompt, images.image_token_id, len(request.media), images.tokens_per_image
        )

    def hash_ids(self, request: EngineRequest) -> Sequence[int]:
        """The prompt with the image placeholders of a request with media salted by the images
        (kvmesh.runtime.multimodal), as the router hashes it; else the prompt."""
        images = self.images
        if not request.media or images is None:
            return request.prompt
        return salt_placeholders(
            request.prompt, images.image_token_id, request.media, images.tokens_per_image
        )

    def _new_seq(self, request: EngineRequest, arrival: int, now: float) -> _Seq:
        vocab = self.vocab_size
        seq = _Seq(request, arrival)
        images = self.images
        if request.media and images is not None:
            positions = self._placeholders(request)
            seq.images = RequestImages(images, positions, images.pixels(request.media))
            seq.salted = list(self.hash_ids(request))
        if request.lora_name:
            seq.adapter = self.loras.use(request.lora_name)
        stop_ids = set(request.stop.stop_token_ids)
        if not request.stop.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq.stop_ids = frozenset(stop_ids)
        seq.suppress = tuple(sorted(t for t in stop_ids if t < vocab))
        guided = request.sampling.guided
        if guided is not None and self.grammars is not None:
            seq.grammar = self.grammars.state(guided, seq.suppress)
        if request.sampling.temperature > 0:
            seed = request.sampling.seed
            if seed is None:
                seed = self._rng.getrandbits(63)
            seq.seed = seed & _MASK64
            seq.generator = torch.Generator(device=self.device)
        return seq

    # -- scheduling ----------------------------------------------------------------------------

    def load(self) -> LoadInfo:
        spec = self.spec
        return dataclasses.replace(
            super().load(),
            spec_steps_total=spec.steps,
            spec_draft_tokens_total=spec.draft_tokens,
            spec_accepted_tokens_total=spec.accepted_tokens,
            spec_emitted_tokens_total=spec.emitted_tokens,
            spec_skipped_steps_total=spec.skipped_steps,
        )

    def _preempt(self, seq: _Seq) -> None:
        super()._preempt(seq)
        seq.draft_len = 0  # its blocks may come back from the prefix cache without draft KV

    def _drafts(self, seq: _Seq) -> list[int]:
        """Speculative draft tokens for `seq` this step (see kvmesh.workers.pytorch.speculative:
        only greedy requests whose next token needs no logits processing)."""
        cfg = self.config
        p = seq.params
        if (
            not seq.decoding
            or seq.num_computed != len(seq.tokens) - 1
            or seq.pin
            or p.temperature > 0
            or p.repetition_penalty != 1.0
            or p.presence_penalty
            or p.frequency_penalty
            or p.top_logprobs is not None
            or p.guided is not None
            or seq.bias_ids
            or len(seq.tokens) < seq.min_len
        ):
            return []
        k = min(cfg.num_speculative_tokens, seq.max_len - len(seq.tokens) - 1)
        if k <= 0:
            return []
        gate = seq.gate
        if gate is None:
            gate = seq.gate = DraftGate(cfg.spec_min_acceptance, cfg.spec_backoff_steps)
        if not gate.allow():
            self.spec.skipped_steps += 1
            return []
        if cfg.draft_model:
            # placeholders: the draft model fills the chunk's tokens on the forward thread
            return [seq.tokens[-1]] * k
        lo = cfg.prompt_lookup_min
        return propose_ngram(seq.tokens, k, lo, max(lo, cfg.prompt_lookup_max))

    def schedule(self) -> ScheduledStep:
        """Pick this step's work (see the module docstring). An empty `chunks` list with no
        preemption means nothing can run until a request arrives or leaves."""
        drafted: dict[str, tuple[_Seq, int]] = {}
        if self.config.num_speculative_tokens:
            for seq in self._running:
                drafts = self._drafts(seq)
                if drafts:
                    seq.tokens.extend(drafts)
                    drafted[seq.request_id] = (seq, len(drafts))
        step = self._schedule_into(ScheduledStep())
        step.drafts = [0] * len(step.seqs)
        for i, seq in enumerate(step.seqs):
            entry = drafted.pop(seq.request_id, None)
            if entry is None:
                continue
            k = entry[1]
            if step.counts[i] == k + 1:
                step.drafts[i] = k
                continue
            # the token budget cut the chunk short: decode the last known token only
            del seq.tokens[-k:]
            step.decode_tokens -= step.counts[i] - 1
            step.counts[i] = 1
            step.sample[i] = True
        for seq, k in drafted.values():  # preempted, or left out of this step
            del seq.tokens[-k:]
        draft_model = bool(self.config.draft_model)
        for seq, start, n, sample, k in zip(
            step.seqs, step.starts, step.counts, step.sample, step.drafts, strict=True
        ):
            spec = None
            if sample:
                if seq.generator is not None:
                    # Keyed by (seed, position): the draw for a position does not depend on the
                    # draws before it, so a resumed request (a migration) continues its stream.
                    seq.generator.manual_seed(_position_seed(seq.seed, len(seq.tokens)))
                if seq.grammar is not None:
                    seq.grammar.advance(seq.tokens[seq.prompt_len :])
                spec = SampleSpec(
                    seq.params,
                    seq.tokens,
                    seq.prompt_len,
                    seq.generator,
                    seq.suppress if len(seq.tokens) < seq.min_len else (),
                    seq.bias_ids,
                    seq.bias_values,
                    seq.grammar,
                )
            images = seq.images
            if images is not None and not images.covers(start, start + n):
                images = None
            chunk = SeqChunk(
                seq.tokens[start : start + n],
                start,
                list(seq.blocks),
                spec,
                seq.adapter,
                verify=k > 0,
                images=images,
            )
            if draft_model:
                # KV past `start` is (re)computed now: the draft model's there is stale
                seq.draft_len = min(seq.draft_len, start)
                if k:
                    chunk.draft_prefix = seq.tokens[seq.draft_len : start]
                    seq.draft_len = start + k  # its forwards cover the last token and k - 1 drafts
            step.chunks.append(chunk)
        self.num_computed_tokens += step.prefill_tokens + step.decode_tokens
        return step

    def complete(self, step: _Step[_Seq], sampled: Sequence[SampledToken]) -> list[SeqOutput]:
        """Apply a computed step (see BatchScheduler.complete); a chunk with drafts keeps the
        ones the model agreed with and emits them before its sampled token."""
        assert isinstance(step, ScheduledStep)
        if not any(step.drafts):
            return super().complete(step, sampled)
        chosen: list[SampledToken] = list(sampled)
        early: dict[str, list[SeqOutput]] = {}
        row = -1
        for i, seq in enumerate(step.seqs):
            if not step.sample[i]:
                continue
            row += 1
            k = step.drafts[i]
            if not k:
                continue
            start = step.starts[i]
            base = start + 1  # where the drafts start in seq.tokens
            chunk = step.chunks[i]
            greedy = chunk.greedy
            if seq.status is not SeqStatus.RUNNING or seq.num_computed != start or not greedy:
                del seq.tokens[base:]  # aborted while the forward ran
                continue
            # the drafts as verified (a draft model wrote them into the chunk, not seq.tokens)
            emitted = accept(chunk.token_ids[1 : 1 + k], greedy)
            spec = self.spec
            spec.steps += 1
            spec.draft_tokens += k
            spec.accepted_tokens += len(emitted) - 1
            if seq.gate is not None:
                seq.gate.record(k, len(emitted) - 1)
            for j, t in enumerate(emitted):  # a token that ends the request ends the chunk
                pos = base + j
                if pos + 1 >= seq.max_len or (t in seq.stop_ids and pos + 1 >= seq.min_len):
                    emitted = emitted[: j + 1]
                    break
            spec.emitted_tokens += len(emitted)
            del seq.tokens[base:]
            seq.tokens.extend(emitted[:-1])
            step.counts[i] = len(emitted)  # KV computed: the last known token + kept drafts
            chosen[row] = Sampled(emitted[-1])
            early[seq.request_id] = [SeqOutput(seq.request_id, t) for t in emitted[:-1]]
        outputs = super().complete(step, chosen)
        merged: list[SeqOutput] = []
        for out in outputs:
            merged.extend(early.pop(out.request_id, ()))
            merged.append(out)
        return merged
