"""validate_request: every rejected parameter, named in the error."""

from __future__ import annotations

import math

import pytest

from kvmesh.api.common.v1 import common_pb2 as cpb
from kvmesh.api.worker.v1 import worker_service_pb2 as wpb
from kvmesh.runtime.errors import InvalidRequest, RequestTooLarge
from kvmesh.runtime.types import (
    EngineRequest,
    GuidedDecoding,
    GuidedKind,
    ModelInfo,
    SamplingParams,
    StopParams,
)
from kvmesh.workers.validation import validate_request, validate_wire_request

pytestmark = pytest.mark.unit

INFO = ModelInfo(
    "m",
    "mocker",
    kv_block_size=16,
    kv_total_blocks=100,
    context_length=100,
    capabilities=("LOGPROBS",),
)


def request(
    prompt: list[int] | None = None, stop: StopParams | None = None, **sampling: object
) -> EngineRequest:
    return EngineRequest(
        "r",
        [1, 2, 3] if prompt is None else prompt,
        SamplingParams(**sampling),  # type: ignore[arg-type]
        stop or StopParams(),
    )


def test_valid_requests_pass() -> None:
    validate_request(request(), INFO)
    validate_request(
        request(
            stop=StopParams(max_tokens=97, min_tokens=97, stop_token_ids=(5,)),
            temperature=0.0,
            top_p=1.0,
            top_k=0,
            min_p=1.0,
            presence_penalty=-2.0,
            frequency_penalty=2.0,
            repetition_penalty=0.5,
            top_logprobs=20,
            logit_bias={7: -100.0, 8: 100.0},
            seed=-5,
        ),
        INFO,
    )
    validate_request(request(temperature=5.0, top_logprobs=0), INFO)
    validate_request(request(prompt=list(range(99))), INFO)


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("top_p", {"top_p": math.nan}),
        ("top_k", {"top_k": -1}),
        ("min_p", {"min_p": -0.5}),
        ("min_p", {"min_p": 1.5}),
        ("presence_penalty", {"presence_penalty": 2.5}),
        ("frequency_penalty", {"frequency_penalty": -2.5}),
        ("frequency_penalty", {"frequency_penalty": math.nan}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": math.inf}),
        ("top_logprobs", {"top_logprobs": 21}),
        ("top_logprobs", {"top_logprobs": -1}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": {1: 101.0}}),
    ],
)
def test_bad_sampling(param: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_request(request(**kwargs), INFO)
    assert e.value.param == param and param in e.value.message
    assert not isinstance(e.value, RequestTooLarge)


@pytest.mark.parametrize(
    ("param", "stop"),
    [
        ("max_tokens", StopParams(max_tokens=0)),
        ("max_tokens", StopParams(max_tokens=-3)),
        ("min_tokens", StopParams(min_tokens=-1)),
        ("min_tokens", StopParams(max_tokens=3, min_tokens=4)),
        ("stop_token_ids", StopParams(stop_token_ids=(1, -2))),
    ],
)
def test_bad_stop(param: str, stop: StopParams) -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_request(request(stop=stop), INFO)
    assert e.value.param == param and param in e.value.message


def test_bad_prompt() -> None:
    with pytest.raises(InvalidRequest) as e:
        validate_request(request(prompt=[]), INFO)
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        validate_request(request(prompt=[3, -1]), INFO)
    assert e.value.param == "prompt"


def test_too_large() -> None:
    with pytest.raises(RequestTooLarge) as e:
        validate_request(request(prompt=list(range(100))), INFO)
    assert (
        e.value.param == "prompt" and "100" in e.value.message and "context length" in str(e.value)
    )
    assert e.value.http_status == 400
    with pytest.raises(RequestTooLarge) as e:
        validate_request(request(prompt=list(range(50)), stop=StopParams(max_tokens=51)), INFO)
    assert e.value.param == "max_tokens" and "50" in e.value.message
    validate_request(request(prompt=list(range(50)), stop=StopParams(max_tokens=50)), INFO)


@pytest.mark.parametrize(
    ("capability", "param", "req"),
    [
        (
            "GUIDED_DECODING",
            "response_format",
            EngineRequest(
                "r", [1, 2], SamplingParams(guided=GuidedDecoding(GuidedKind.JSON_OBJECT))
            ),
        ),
        ("LOGPROBS", "logprobs", EngineRequest("r", [1, 2], SamplingParams(top_logprobs=0))),
        ("LORA", "lora_name", EngineRequest("r", [1, 2], lora_name="sql")),
    ],
)
def test_fields_needing_a_capability_are_refused_without_it(
    capability: str, param: str, req: EngineRequest
) -> None:
    """Nothing is served as if the field were absent: without the capability in the model card
    the request is refused, naming the field and the capability; with it, it passes."""
    bare = ModelInfo("m", "mocker", 16, 100, 100)
    with pytest.raises(InvalidRequest) as e:
        validate_request(req, bare)
    assert e.value.param == param and capability in e.value.message
    validate_request(req, ModelInfo("m", "mocker", 16, 100, 100, capabilities=(capability,)))


def test_media_needs_the_multimodal_capability() -> None:
    media = [cpb.MediaInput(mime_type="image/png", data=b"\x89PNG")]
    for msg in (
        wpb.GenerateRequest(token_ids=[1], media=media),
        wpb.PrefillRemoteRequest(token_ids=[1], media=media),
    ):
        with pytest.raises(InvalidRequest) as e:
            validate_wire_request(msg, INFO)
        assert e.value.param == "media" and "MULTIMODAL" in e.value.message
        validate_wire_request(type(msg)(token_ids=[1]), INFO)  # text only: fine
