"""KvEventTranslator's prompt walk (kvmesh.workers.adapters.kv_translate.cached_prefix_tokens):
what the engine adapters subtract from a request's prompt when they report pending prefill."""

from __future__ import annotations

import pytest

from kvmesh.runtime.kv_events import KvEventLog, KvTier
from kvmesh.workers.adapters.kv_translate import KvEventTranslator, StoredChain

pytestmark = pytest.mark.unit


def test_the_translator_walks_a_prompt_by_tokens() -> None:
    """Published device blocks by (LoRA, parent, tokens): a removed block ends the walk there,
    an opaque one is never found, other tiers do not count, a cleared cache holds nothing, and
    a prompt that is all cached still computes its last token."""
    tr = KvEventTranslator(KvEventLog(), 4)
    tr.stored(StoredChain(None, [1, 2, 3], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]))
    tr.stored(StoredChain(None, [9], [[0, 1, 2, 3]], lora_name="sql"))
    tr.stored(StoredChain(3, [4], [[12, 13, 14, 15]], opaque=[True]))
    tr.stored(StoredChain(None, [5], [[6, 6, 6, 6]]), KvTier.HOST)
    prompt = list(range(20))
    assert tr.cached_prefix_tokens(prompt) == 12  # the opaque fourth block is not published
    assert tr.cached_prefix_tokens(prompt[:12]) == 11
    assert tr.cached_prefix_tokens(prompt[:14]) == 12  # a partial last block is never cached
    assert tr.cached_prefix_tokens([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert tr.cached_prefix_tokens([6, 6, 6, 6, 1]) == 0  # on the host tier only
    assert tr.cached_prefix_tokens(prompt, "sql") == 4
    assert tr.cached_prefix_tokens(prompt, "other") == 0
    assert tr.cached_prefix_tokens([]) == 0
    tr.removed([2])
    assert tr.cached_prefix_tokens(prompt) == 4
    tr.stored(StoredChain(1, [2], [[4, 5, 6, 7]]))  # stored again: found again
    assert tr.cached_prefix_tokens(prompt) == 12
    tr.cleared()
    assert tr.cached_prefix_tokens(prompt) == 0
