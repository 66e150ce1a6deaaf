"""The OpenAPI 3.1 description of what the gateway serves (GET /openapi.json).

Written by hand next to the parsers it describes (kvmesh.frontend.protocol for the OpenAI
routes, kvmesh.frontend.kserve / kserve_http for the KServe v2 REST routes), and checked
against the running server by the schemathesis fuzz tests (tests/fuzz): every documented
request shape gets a documented status, content type and response shape, and nothing answers
5xx. Request schemas list the fields the gateway reads; like OpenAI, it ignores unknown ones.
"""

from __future__ import annotations

from typing import Any

from kvmesh.frontend.kserve import DATATYPES
from kvmesh.runtime import __version__

__all__ = ["openapi_document"]

Schema = dict[str, Any]


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_STR: Schema = {"type": "string"}
_INT: Schema = {"type": "integer"}
_BOOL: Schema = {"type": "boolean"}
_NUM: Schema = {"type": "number"}
_OBJ: Schema = {"type": "object"}
_U32 = 2**32 - 1
_SSE_EVENT: Schema = {
    "description": "One Server-Sent Event; `data` is a JSON document (or `[DONE]`)",
    "type": "object",
    "required": ["data"],
    "properties": {"data": _STR, "event": _STR, "id": _STR},
}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _openai_errors(*statuses: int) -> dict[str, Schema]:
    text = {
        400: "Invalid request",
        404: "Unknown model or route",
        405: "Method not allowed",
        413: "Request body too large",
        429: "Overloaded",
        501: "Not implemented by the backend",
        503: "No worker available, or draining",
    }
    return {str(s): _json(_ref("Error"), text[s]) for s in statuses}


def _kserve_errors(*statuses: int) -> dict[str, Schema]:
    text = {
        400: "Invalid inference request",
        404: "Unknown model or version",
        413: "Request body too large",
        429: "Overloaded",
        503: "No worker available, or draining",
    }
    return {str(s): _json(_ref("KServeError"), text[s]) for s in statuses}


_GENERATION_ERRORS = (400, 404, 413, 429, 503)

_SAMPLING: dict[str, Schema] = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": _U32}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": _U32}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0}),
    "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": _U32}),
    "stop": {
        "anyOf": [
            _STR,
            {"type": "array", "items": _STR, "maxItems": 4},
            {"type": "null"},
        ]
    },
    "stop_token_ids": _nullable(
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _U32}}
    ),
    "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": _U32}),
    "ignore_eos": _nullable(_BOOL),
    "skip_special_tokens": _nullable(_BOOL),
    "logit_bias": _nullable(
        {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
    "priority": _nullable({"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}),
    "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _BOOL}}),
    "user": _nullable(_STR),
    "response_format": _nullable(_ref("ResponseFormat")),
    "guided_json": _nullable({"anyOf": [_STR, _OBJ]}),
    "guided_regex": _nullable(_STR),
    "guided_choice": _nullable({"type": "array", "items": _STR, "minItems": 1}),
    "guided_grammar": _nullable(_STR),
    "structured_outputs": _nullable(_OBJ),
}

_CONTENT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["text"]}, "text": _STR},
}
_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": _CONTENT_PART}, {"type": "null"}]},
        "name": _STR,
        "tool_calls": {"type": "array", "items": _OBJ},
        "tool_call_id": _STR,
        "reasoning_content": _STR,
    },
}
_TOOL: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": _STR,
                "description": _STR,
                "parameters": _OBJ,
                "strict": _BOOL,
            },
        },
    },
}
_TOOL_CHOICE: Schema = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {
            "type": "object",
            "required": ["type", "function"],
            "properties": {
                "type": {"enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}},
            },
        },
        {"type": "null"},
    ]
}
_RESPONSE_FORMAT: Schema = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"enum": ["json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": _STR,
                        "description": _STR,
                        "schema": _OBJ,
                        "strict": _BOOL,
                    },
                },
            },
        },
    ]
}

_CHAT_REQUEST: Schema = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": _STR,
        "messages": {"type": "array", "items": _ref("ChatMessage"), "minItems": 1},
        **_SAMPLING,
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": _U32}),
        "logprobs": _nullable(_BOOL),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "tools": _nullable({"type": "array", "items": _ref("Tool")}),
        "tool_choice": _TOOL_CHOICE,
        "parallel_tool_calls": _nullable(_BOOL),
        "reasoning_effort": _nullable(_STR),
        "chat_template_kwargs": _nullable(_OBJ),
        "add_generation_prompt": _nullable(_BOOL),
    },
}
_COMPLETION_REQUEST: Schema = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        "model": _STR,
        "prompt": {
            "anyOf": [
                _STR,
                {"type": "array", "items": _STR, "minItems": 1},
                {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": _U32},
                    "minItems": 1,
                },
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "items": {"type": "integer", "minimum": 0, "maximum": _U32},
                    },
                },
            ]
        },
        **_SAMPLING,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
        "echo": _nullable(_BOOL),
    },
}
_EMBEDDING_REQUEST: Schema = {
    "type": "object",
    "required": ["model", "input"],
    "properties": {
        "model": _STR,
        "input": {
            "anyOf": [
                _STR,
                {"type": "array", "items": _STR, "minItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                },
            ]
        },
        "encoding_format": {"enum": ["float", "base64"]},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": _STR,
    },
}

_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _OBJ,
    },
}
_TOOL_CALL: Schema = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": _STR,
        "type": {"enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": _STR, "arguments": _STR},
        },
    },
}
_FINISH: Schema = {"enum": ["stop", "length", "tool_calls"]}
_CHAT_COMPLETION: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": _STR,
        "object": {"enum": ["chat.completion"]},
        "created": _INT,
        "model": _STR,
        "system_fingerprint": _STR,
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": _INT,
                    "finish_reason": _FINISH,
                    "logprobs": _nullable(_OBJ),
                    "message": {
                        "type": "object",
                        "required": ["role", "content"],
                        "properties": {
                            "role": {"enum": ["assistant"]},
                            "content": _nullable(_STR),
                            "refusal": {"type": "null"},
                            "reasoning_content": _STR,
                            "tool_calls": {"type": "array", "items": _TOOL_CALL},
                        },
                    },
                },
            },
        },
        "usage": _ref("Usage"),
    },
}
_TEXT_COMPLETION: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {
        "id": _STR,
        "object": {"enum": ["text_completion"]},
        "created": _INT,
        "model": _STR,
        "system_fingerprint": _STR,
        "choices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "text", "finish_reason"],
                "properties": {
                    "index": _INT,
                    "text": _STR,
                    "finish_reason": _FINISH,
                    "logprobs": _nullable(_OBJ),
                },
            },
        },
        "usage": _ref("Usage"),
    },
}
_EMBEDDINGS: Schema = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"enum": ["list"]},
        "model": _STR,
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"enum": ["embedding"]},
                    "index": _INT,
                    "embedding": {"anyOf": [{"type": "array", "items": _NUM}, _STR]},
                },
            },
        },
        "usage": _OBJ,
    },
}
_MODEL: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": _STR,
        "object": {"enum": ["model"]},
        "created": _INT,
        "owned_by": _STR,
        "max_model_len": _INT,
    },
}
_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": _STR,
                "type": _STR,
                "param": _nullable(_STR),
                "code": _nullable(_STR),
            },
        }
    },
}

# -- KServe ----------------------------------------------------------------------------------

_PARAMS: Schema = {
    "type": "object",
    "additionalProperties": {"anyOf": [_BOOL, _NUM, _STR]},
}
_DATATYPES = sorted(DATATYPES)
_TENSOR_IN: Schema = {
    "type": "object",
    "required": ["name", "datatype", "shape"],
    "properties": {
        "name": _STR,
        "datatype": {"enum": _DATATYPES},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "parameters": _PARAMS,
        "data": {"type": "array"},
    },
}
_INFER_REQUEST: Schema = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": _STR,
        "parameters": _PARAMS,
        "inputs": {"type": "array", "items": _ref("InferInputTensor")},
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": _STR, "parameters": _PARAMS},
            },
        },
    },
}
_INFER_RESPONSE: Schema = {
    "type": "object",
    "required": ["model_name", "outputs"],
    "properties": {
        "model_name": _STR,
        "model_version": _STR,
        "id": _STR,
        "parameters": _PARAMS,
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "datatype", "shape"],
                "properties": {
                    "name": _STR,
                    "datatype": _STR,
                    "shape": {"type": "array", "items": _INT},
                    "parameters": _PARAMS,
                    "data": {"type": "array"},
                },
            },
        },
    },
}
_GENERATE_REQUEST: Schema = {
    "type": "object",
    "required": ["text_input"],
    "properties": {
        "id": _STR,
        "text_input": _STR,
        "parameters": _PARAMS,
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": _U32},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": _U32},
        "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1},
        "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]},
        "exclude_input_in_output": _BOOL,
    },
}
_GENERATE_RESPONSE: Schema = {
    "type": "object",
    "required": ["model_name"],
    "properties": {
        "model_name": _STR,
        "model_version": _STR,
        "id": _STR,
        "text_output": _STR,
        "finish_reason": _STR,
        "num_input_tokens": _INT,
        "num_output_tokens": _INT,
    },
}
_KSERVE_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": _STR},
}
_MODEL_METADATA: Schema = {
    "type": "object",
    "required": ["name", "versions", "platform", "inputs", "outputs"],
    "properties": {
        "name": _STR,
        "versions": {"type": "array", "items": _STR},
        "platform": _STR,
        "inputs": {"type": "array", "items": _OBJ},
        "outputs": {"type": "array", "items": _OBJ},
        "properties": _OBJ,
    },
}


def _op(
    summary: str,
    responses: dict[str, Schema],
    *,
    body: Schema | None = None,
    params: list[Schema] | None = None,
) -> Schema:
    op: Schema = {"summary": summary, "responses": responses}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _kserve_model_paths() -> dict[str, Schema]:
    paths: dict[str, Schema] = {}
    for base, params in (
        ("/v2/models/{model}", [_path_param("model")]),
        ("/v2/models/{model}/versions/{version}", [_path_param("model"), _path_param("version")]),
    ):
        paths[base] = {
            "get": _op(
                "Model metadata",
                {"200": _json(_ref("ModelMetadata"), "Metadata"), **_kserve_errors(404)},
                params=params,
            )
        }
        paths[base + "/ready"] = {
            "get": _op(
                "Model readiness",
                {
                    "200": _json(_OBJ, "Ready"),
                    "503": _json(_OBJ, "Not ready"),
                    **_kserve_errors(404),
                },
                params=params,
            )
        }
        paths[base + "/config"] = {
            "get": _op(
                "Triton model configuration",
                {"200": _json(_OBJ, "Configuration"), **_kserve_errors(404)},
                params=params,
            )
        }
        paths[base + "/infer"] = {
            "post": _op(
                "Inference (JSON; Triton's binary tensor extension is also accepted)",
                {
                    "200": {
                        "description": "Outputs",
                        "content": {
                            "application/json": {"schema": _ref("InferResponse")},
                            "application/octet-stream": {"schema": _STR},
                        },
                    },
                    **_kserve_errors(*_GENERATION_ERRORS),
                },
                body=_ref("InferRequest"),
                params=params,
            )
        }
        paths[base + "/generate"] = {
            "post": _op(
                "Triton generate extension",
                {
                    "200": _json(_ref("GenerateResponse"), "Generated text"),
                    **_kserve_errors(*_GENERATION_ERRORS),
                },
                body=_ref("GenerateRequest"),
                params=params,
            )
        }
        paths[base + "/generate_stream"] = {
            "post": _op(
                "Triton generate extension, streamed as Server-Sent Events",
                {
                    "200": {
                        "description": "data: {generate response} events",
                        "content": {"text/event-stream": {"schema": _SSE_EVENT}},
                    },
                    **_kserve_errors(*_GENERATION_ERRORS),
                },
                body=_ref("GenerateRequest"),
                params=params,
            )
        }
    return paths


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document."""
    sse = {"text/event-stream": {"schema": _SSE_EVENT}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmesh gateway",
            "version": __version__,
            "description": "OpenAI-compatible API and KServe v2 (Open Inference Protocol) REST "
            "API of a kvmesh frontend.",
        },
        "paths": {
            "/v1/chat/completions": {
                "post": _op(
                    "Chat completion (stream: Server-Sent Events)",
                    {
                        "200": {
                            "description": "A chat.completion, or chat.completion.chunk events",
                            "content": {
                                "application/json": {"schema": _ref("ChatCompletion")},
                                **sse,
                            },
                        },
                        **_openai_errors(*_GENERATION_ERRORS),
                    },
                    body=_ref("ChatCompletionRequest"),
                )
            },
            "/v1/completions": {
                "post": _op(
                    "Text completion (stream: Server-Sent Events)",
                    {
                        "200": {
                            "description": "A text_completion, or text_completion events",
                            "content": {
                                "application/json": {"schema": _ref("TextCompletion")},
                                **sse,
                            },
                        },
                        **_openai_errors(*_GENERATION_ERRORS),
                    },
                    body=_ref("CompletionRequest"),
                )
            },
            "/v1/embeddings": {
                "post": _op(
                    "Embeddings (engines with the EMBEDDINGS capability)",
                    {
                        "200": _json(_ref("Embeddings"), "One vector per input"),
                        **_openai_errors(*_GENERATION_ERRORS, 501),
                    },
                    body=_ref("EmbeddingRequest"),
                )
            },
            "/v1/models": {
                "get": _op(
                    "Models served now",
                    {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["object", "data"],
                                "properties": {
                                    "object": {"enum": ["list"]},
                                    "data": {"type": "array", "items": _ref("Model")},
                                },
                            },
                            "Model list",
                        )
                    },
                )
            },
            "/v1/models/{model}": {
                "get": _op(
                    "One model",
                    {"200": _json(_ref("Model"), "The model"), **_openai_errors(404)},
                    params=[_path_param("model")],
                )
            },
            "/health": {
                "get": _op(
                    "Readiness",
                    {"200": _json(_OBJ, "Ready"), "503": _json(_OBJ, "Not ready")},
                )
            },
            "/live": {"get": _op("Liveness", {"200": _json(_OBJ, "Alive")})},
            "/metrics": {
                "get": _op(
                    "Prometheus metrics",
                    {
                        "200": {
                            "description": "Text exposition",
                            "content": {"text/plain": {"schema": _STR}},
                        }
                    },
                )
            },
            "/openapi.json": {"get": _op("This document", {"200": _json(_OBJ, "OpenAPI")})},
            "/v2/health/live": {
                "get": _op("KServe server liveness", {"200": _json(_OBJ, "Alive")})
            },
            "/v2/health/ready": {
                "get": _op(
                    "KServe server readiness",
                    {"200": _json(_OBJ, "Ready"), "503": _json(_OBJ, "Not ready")},
                )
            },
            "/v2": {"get": _op("KServe server metadata", {"200": _json(_OBJ, "Metadata")})},
            "/v2/repository/index": {
                "post": _op(
                    "Models served (Triton repository index)",
                    {"200": _json({"type": "array", "items": _OBJ}, "Models")},
                )
            },
            **_kserve_model_paths(),
        },
        "components": {
            "schemas": {
                "ChatCompletionRequest": _CHAT_REQUEST,
                "CompletionRequest": _COMPLETION_REQUEST,
                "EmbeddingRequest": _EMBEDDING_REQUEST,
                "ChatMessage": _MESSAGE,
                "Tool": _TOOL,
                "ResponseFormat": _RESPONSE_FORMAT,
                "ChatCompletion": _CHAT_COMPLETION,
                "TextCompletion": _TEXT_COMPLETION,
                "Embeddings": _EMBEDDINGS,
                "Usage": _USAGE,
                "Model": _MODEL,
                "Error": _ERROR,
                "InferInputTensor": _TENSOR_IN,
                "InferRequest": _INFER_REQUEST,
                "InferResponse": _INFER_RESPONSE,
                "GenerateRequest": _GENERATE_REQUEST,
                "GenerateResponse": _GENERATE_RESPONSE,
                "ModelMetadata": _MODEL_METADATA,
                "KServeError": _KSERVE_ERROR,
            }
        },
    }
