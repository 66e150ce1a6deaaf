"""Request validation shared by every engine adapter.

Engines call `validate_request` first thing in `generate()`, so every engine rejects the same
requests with the same messages; the worker server calls `validate_wire_request` on each request
message before converting it, for the contract fields that never reach an engine. Errors name the
offending parameter (`param=`) so the gateway can return OpenAI-style errors.

A request that asks for something the engine's model card does not advertise (guided decoding,
logprobs, a LoRA adapter, media inputs) is refused with InvalidRequest, never served as if the
field were not there.
"""

from __future__ import annotations

import math

from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge
from kvmesh.runtime.types import EngineRequest, ModelInfo

__all__ = ["MAX_TOP_LOGPROBS", "validate_request", "validate_wire_request"]

MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask logprobs for (OpenAI's limit)."""


def _range(value: float, lo: float, hi: float, param: str, what: str) -> None:
    if not lo <= value <= hi:  # also rejects NaN
        raise InvalidRequest(f"{param} must be {what}, got {value!r}", param=param)


def validate_request(request: EngineRequest, info: ModelInfo) -> None:
    """Raise InvalidRequest (or RequestTooLarge) if `request` cannot be served by `info`'s model.

    Checks: a non-empty prompt of non-negative token ids; temperature >= 0; 0 < top_p <= 1;
    top_k >= 0; 0 <= min_p <= 1; presence/frequency penalties in [-2, 2]; repetition_penalty > 0;
    0 <= top_logprobs <= 20; logit_bias ids >= 0 with biases in [-100, 100]; max_tokens >= 1;
    0 <= min_tokens <= max_tokens; stop token ids >= 0; prompt shorter than the context length and
    prompt + max_tokens within it; guided decoding, logprobs, a LoRA adapter and resumed output only
    when the model card advertises GUIDED_DECODING, LOGPROBS, LORA and RESUME (resumed output
    shorter than the prompt). Token ids are not checked against the
    vocabulary (unknown here).
    """
    _check_capabilities(request, info)
    prompt = request.prompt
    if not prompt:
        raise InvalidRequest("prompt must contain at least one token", param="prompt")
    if min(prompt) < 0:
        raise InvalidRequest("prompt token ids must be >= 0", param="prompt")

    s = request.sampling
    if not s.temperature >= 0:  # NaN fails too
        raise InvalidRequest(
            f"temperature must be >= 0 (0 = greedy), got {s.temperature!r}", param="temperature"
        )
    if not 0 < s.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {s.top_p!r}", param="top_p")
    if s.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 = disabled), got {s.top_k}", param="top_k")
    _range(s.min_p, 0.0, 1.0, "min_p", "in [0, 1]")
    _range(s.presence_penalty, -2.0, 2.0, "presence_penalty", "in [-2, 2]")
    _range(s.frequency_penalty, -2.0, 2.0, "frequency_penalty", "in [-2, 2]")
    if not (s.repetition_penalty > 0 and math.isfinite(s.repetition_penalty)):
        raise InvalidRequest(
            f"repetition_penalty must be a finite number > 0, got {s.repetition_penalty!r}",
            param="repetition_penalty",
        )
    if s.top_logprobs is not None and not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {s.top_logprobs}",
            param="top_logprobs",
        )
    for token_id, bias in s.logit_bias.items():
        if token_id < 0:
            raise InvalidRequest(
                f"logit_bias token ids must be >= 0, got {token_id}", param="logit_bias"
            )
        _range(bias, -100.0, 100.0, "logit_bias", "in [-100, 100]")

    stop = request.stop
    max_tokens = stop.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if stop.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {stop.min_tokens}", param="min_tokens")
    if max_tokens is not None and stop.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({stop.min_tokens}) must not exceed max_tokens ({max_tokens})",
            param="min_tokens",
        )
    if any(t < 0 for t in stop.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be >= 0", param="stop_token_ids")

    n = len(prompt)
    ctx = info.context_length
    if n >= ctx:
        raise RequestTooLarge(
            f"prompt has {n} tokens but the model's context length is {ctx}; "
            f"the prompt must be at most {ctx - 1} tokens to leave room for output",
            param="prompt",
        )
    if max_tokens is not None and n + max_tokens > ctx:
        raise RequestTooLarge(
            f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds the "
            f"model's context length of {ctx}; lower max_tokens to at most {ctx - n}",
            param="max_tokens",
        )


def _missing(info: ModelInfo, capability: str, what: str, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what} needs an engine with the {capability} capability; engine "
        f"{info.engine or 'unknown'!r} serving {info.served_model_name!r} does not advertise it",
        param=param,
    )


def _check_capabilities(request: EngineRequest, info: ModelInfo) -> None:
    caps = info.capabilities
    s = request.sampling
    if s.guided is not None and "GUIDED_DECODING" not in caps:
        raise _missing(info, "GUIDED_DECODING", "structured output", "response_format")
    if s.top_logprobs is not None and "LOGPROBS" not in caps:
        raise _missing(info, "LOGPROBS", "logprobs", "logprobs")
    if request.media and "MULTIMODAL" not in caps:
        raise _missing(info, "MULTIMODAL", "media inputs", "media")
    if request.lora_name and "LORA" not in caps:
        raise _missing(info, "LORA", f"LoRA adapter {request.lora_name!r}", "lora_name")
    resumed = request.resumed_output_tokens
    if resumed:
        if "RESUME" not in caps:
            raise _missing(info, "RESUME", "resumed_output_tokens", "resumed_output_tokens")
        if not 0 < resumed < len(request.prompt):
            raise InvalidRequest(
                f"resumed_output_tokens ({resumed}) must be less than the number of prompt "
                f"tokens ({len(request.prompt)})",
                param="resumed_output_tokens",
            )


def validate_wire_request(
    msg: wpb.GenerateRequest | wpb.PrefillRemoteRequest, info: ModelInfo
) -> None:
    """Raise InvalidRequest for contract fields of `msg` that `info`'s engine cannot honour,
    before the message is converted: media inputs need the MULTIMODAL capability (the torch
    engine's, with a multimodal model, in any role; `validate_request` checks the
    converted request again for in-process callers). Fields no engine implements at all are
    refused by kvmesh.runtime.wire when it converts the message."""
    if msg.media and "MULTIMODAL" not in info.capabilities:
        raise _missing(info, "MULTIMODAL", "media inputs", "media")
