"""Structured output on the torch engine (random-weight tiny Llama): every kind of constraint
forces valid output, greedy and sampled, alone and mixed with unconstrained requests in one
batch (which keep their exact greedy output); bad constraints are refused at submit."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install kvmesh[torch])")
pytest.importorskip("llguidance", reason="llguidance is not installed (pip install kvmesh[torch])")

import jsonschema
from tokenizers import Tokenizer

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import EngineRequest, FinishReason, GuidedDecoding, GuidedKind
from kvmesh.workers.pytorch.engine import TorchEngine
from tests.unit.test_torch_engine import (  # noqa: F401 (fixtures)
    Env,
    assert_idle,
    engine,
    env,
    loaded,
    model_dir,
    prompt_of,
    req,
    run,
)

pytestmark = pytest.mark.unit

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def guided(
    kind: GuidedKind, value: str = "", choices: tuple[str, ...] = (), **kw: Any
) -> EngineRequest:
    r = req(prompt_of(9, kw.pop("salt", 0)), kw.pop("max_tokens", 96), **kw)
    r.sampling.guided = GuidedDecoding(kind, value, choices)
    return r


async def text_of(eng: TorchEngine, tok: Tokenizer, r: EngineRequest) -> str:
    ids, last = await run(eng, r)
    assert last.finish_reason is FinishReason.STOP, (last.finish_reason, tok.decode(ids))
    return tok.decode([t for t in ids if t not in eng.info.eos_token_ids])


def test_capability_is_advertised(engine: TorchEngine) -> None:  # noqa: F811
    assert "GUIDED_DECODING" in engine.info.capabilities


async def test_json_schema_greedy_and_sampled(
    engine: TorchEngine,  # noqa: F811
    tokenizer: Tokenizer,
) -> None:
    schema = json.dumps(SCHEMA)
    requests = [guided(GuidedKind.JSON_SCHEMA, schema, salt=1)]
    requests += [
        guided(GuidedKind.JSON_SCHEMA, schema, salt=s, temperature=1.0, seed=s) for s in range(8)
    ]
    texts = await asyncio.gather(*(text_of(engine, tokenizer, r) for r in requests))
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled outputs differ: the grammar constrains, not fixes
    assert_idle(engine)


async def test_other_constraint_kinds(
    engine: TorchEngine,  # noqa: F811
    tokenizer: Tokenizer,
) -> None:
    regex = guided(GuidedKind.REGEX, r"[a-f]{3}-[0-9]{2,4}", temperature=1.0, seed=3)
    choice = guided(GuidedKind.CHOICE, choices=("yes", "no", "maybe"), temperature=1.0, seed=4)
    grammar = guided(
        GuidedKind.GRAMMAR, 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]', seed=5
    )
    # A random model writes long keys; a bias toward closing keeps it short, inside the grammar.
    bias = {tokenizer.token_to_id(c): 30.0 for c in ('"', "}")}
    obj = guided(GuidedKind.JSON_OBJECT, logit_bias=bias)
    t_regex, t_choice, t_grammar, t_obj = await asyncio.gather(
        *(text_of(engine, tokenizer, r) for r in (regex, choice, grammar, obj))
    )
    assert re.fullmatch(r"[a-f]{3}-[0-9]{2,4}", t_regex), t_regex
    assert t_choice in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", t_grammar), t_grammar
    assert isinstance(json.loads(t_obj), dict), t_obj


async def test_unconstrained_rows_keep_their_greedy_output(
    engine: TorchEngine,  # noqa: F811
    env: Env,  # noqa: F811
    tokenizer: Tokenizer,
) -> None:
    """Guided and plain requests in the same steps: the plain ones equal transformers' greedy
    output, the guided ones validate."""
    plain = [prompt_of(n, salt) for salt, n in enumerate((5, 16, 40))]
    schema = json.dumps(SCHEMA)
    results = await asyncio.gather(
        *(run(engine, req(p, 12)) for p in plain),
        *(
            text_of(engine, tokenizer, guided(GuidedKind.JSON_SCHEMA, schema, salt=s, seed=s))
            for s in range(3)
        ),
    )
    for p, result in zip(plain, results[:3], strict=True):
        ids, _ = result  # type: ignore[misc]
        assert ids == env.reference(p, 12)
    for text in results[3:]:
        jsonschema.validate(json.loads(text), SCHEMA)  # type: ignore[arg-type]


async def test_min_tokens_yield_to_a_complete_grammar(
    engine: TorchEngine,  # noqa: F811
    tokenizer: Tokenizer,
) -> None:
    r = guided(GuidedKind.CHOICE, choices=("yes", "no"), min_tokens=20)
    assert await text_of(engine, tokenizer, r) in ("yes", "no")


async def test_bad_constraints_are_refused(engine: TorchEngine) -> None:  # noqa: F811
    bad = [
        guided(GuidedKind.JSON_SCHEMA, "{not json"),
        guided(GuidedKind.JSON_SCHEMA, '{"type": "no-such-type"}'),
        guided(GuidedKind.REGEX, "[unclosed"),
        guided(GuidedKind.GRAMMAR, "root ::= undefined_rule"),
        guided(GuidedKind.JSON_OBJECT, ignore_eos=True),
    ]
    for r in bad:
        with pytest.raises(InvalidRequest) as e:
            await anext(engine.generate(r))
        assert e.value.param in ("response_format", "ignore_eos"), e.value
    assert_idle(engine)
