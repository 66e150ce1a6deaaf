"""Each engine fake states the upstream version it was read from, and the engine extras in
pyproject.toml allow that version (SGLang, TensorRT-LLM; vLLM's fake is built from vLLM's own
classes, installed by tests/install_vllm.sh).

The reference lists below were read from the upstream files named in each fake's
UPSTREAM_SOURCES, not from the fakes: SGLang's from the sglang 0.5.18 wheel
(`pip download --no-deps sglang==0.5.18`, sglang/srt/entrypoints/engine.py and
sglang/srt/sampling/sampling_params.py), TensorRT-LLM's from its GitHub sources
(tensorrt_llm/llmapi/llm.py; sampling_params.py at commit 000a01de).
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement

from tests.adapter_fakes import sglang_fake, trtllm_fake

pytestmark = pytest.mark.unit

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

SGLANG_0_5_18_ASYNC_GENERATE = [
    "prompt", "sampling_params", "input_ids", "image_data", "audio_data", "video_data",
    "mm_hashes", "mm_content_hashes", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "lora_path", "custom_logit_processor", "require_reasoning",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "stream",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "external_trace_header", "rid",
    "session_params", "priority", "session_id", "cache_salt",
]  # fmt: skip
SGLANG_0_5_18_SAMPLING_FIELDS = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias",
    "sampling_seed", "custom_params",
]  # fmt: skip
TRTLLM_GENERATE_ASYNC = [
    "inputs", "sampling_params", "lora_request", "prompt_adapter_request", "streaming",
    "kv_cache_retention_config", "disaggregated_params", "trace_headers", "_postproc_params",
    "scheduling_params", "conversation_params", "cache_salt", "priority",
]  # fmt: skip
TRTLLM_SAMPLING_FIELDS = [
    "end_id", "pad_id", "max_tokens", "bad", "bad_token_ids", "stop", "stop_token_ids",
    "include_stop_str_in_output", "embedding_bias", "logits_processor",
    "apply_batched_logits_processor", "n", "best_of", "use_beam_search", "top_k", "top_p",
    "top_p_min", "top_p_reset_ids", "top_p_decay", "seed", "temperature", "min_tokens",
    "beam_search_diversity_rate", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "length_penalty", "early_stopping", "no_repeat_ngram_size", "min_p", "beam_width_array",
    "logprobs", "prompt_logprobs", "return_context_logits", "return_generation_logits",
    "exclude_input_from_output", "return_encoder_output", "return_perf_metrics",
    "additional_model_outputs", "lookahead_config", "guided_decoding", "ignore_eos",
    "detokenize", "add_special_tokens", "truncate_prompt_tokens", "skip_special_tokens",
    "spaces_between_special_tokens",
]  # fmt: skip


def _extra_requirement(extra: str, dist: str) -> Requirement:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for line in extras[extra]:
        req = Requirement(line)
        if req.name.replace("-", "_") == dist.replace("-", "_"):
            return req
    raise AssertionError(f"the {extra!r} extra does not name {dist}")


@pytest.mark.parametrize(
    ("extra", "fake"), [("sglang", sglang_fake), ("trtllm", trtllm_fake)], ids=["sglang", "trtllm"]
)
def test_extra_allows_the_version_the_fake_was_read_from(extra: str, fake: ModuleType) -> None:
    assert fake.UPSTREAM_SOURCES and all(p.endswith(".py") for p in fake.UPSTREAM_SOURCES)
    req = _extra_requirement(extra, fake.UPSTREAM_DIST)
    assert req.specifier.contains(fake.UPSTREAM_VERSION, prereleases=True), (
        f"pyproject's {extra!r} extra ({req}) excludes {fake.UPSTREAM_VERSION}, the version "
        f"tests/adapter_fakes/{fake.__name__.rsplit('.', 1)[-1]}.py was read from"
    )
    # A range, not a floor: a later release the fake was not read from is not promised.
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), str(req)


def test_sglang_fake_speaks_0_5_18() -> None:
    assert sglang_fake.UPSTREAM_VERSION == "0.5.18"
    params = list(inspect.signature(sglang_fake.FakeSglangEngine.async_generate).parameters)
    assert params[1:] == SGLANG_0_5_18_ASYNC_GENERATE
    assert list(sglang_fake._SAMPLING_DEFAULTS) == SGLANG_0_5_18_SAMPLING_FIELDS


def test_sglang_fake_tokenizer_manager_is_0_5_18() -> None:
    """0.5.18's load query is get_loads(include, dp_rank); get_load() is gone (the adapter
    polls get_loads() and falls back to get_load() only where a manager lacks it)."""
    manager = sglang_fake.FakeTokenizerManager
    assert hasattr(manager, "get_loads") and not hasattr(manager, "get_load")
    params = list(inspect.signature(manager.get_loads).parameters)
    assert params == ["self", "include", "dp_rank"]


def test_trtllm_fake_speaks_the_sources_it_names() -> None:
    params = list(inspect.signature(trtllm_fake.FakeLLM.generate_async).parameters)
    assert params[1:] == TRTLLM_GENERATE_ASYNC
    fields = [f.name for f in dataclasses.fields(trtllm_fake.TrtSamplingParams)]
    assert fields == TRTLLM_SAMPLING_FIELDS
