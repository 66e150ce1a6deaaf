"""kvmesh.runtime.multimodal: placeholder expansion and the salted ids block hashes cover."""

from __future__ import annotations

import pytest

from kvmesh.router.hashing import block_hashes
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.multimodal import (
    SALT_BIT,
    expand_placeholders,
    placeholder_positions,
    salt_placeholders,
)
from kvmesh.runtime.types import MediaInput

pytestmark = pytest.mark.unit

IMG = 9
A, B = MediaInput("image/png", b"a"), MediaInput("image/png", b"b")


def test_expand_repeats_each_image_token() -> None:
    assert expand_placeholders([1, IMG, 2, IMG], IMG, 3, 2) == [1, 9, 9, 9, 2, 9, 9, 9]
    assert expand_placeholders([1, 2], IMG, 3, 0) == [1, 2]
    with pytest.raises(InvalidRequest, match="rendered 1 image placeholder") as err:
        expand_placeholders([1, IMG], IMG, 3, 2)
    assert err.value.param == "messages"


def test_positions_are_the_first_placeholders() -> None:
    assert placeholder_positions([IMG, 1, IMG, IMG, IMG], IMG, 1, 2) == [0, 2]
    with pytest.raises(InvalidRequest, match="holds 1 image placeholder tokens"):
        placeholder_positions([IMG, 1], IMG, 1, 2)


def test_salt_depends_on_the_image_and_position_only() -> None:
    prompt = [1, 2, IMG, IMG, 3, IMG, IMG, IMG]  # two images of 2 tokens, then a plain IMG
    a = salt_placeholders(prompt, IMG, [A, B], 2)
    assert a[:2] == [1, 2] and a[4] == 3 and a[7] == IMG
    salted = [a[2], a[3], a[5], a[6]]
    assert all(t & SALT_BIT for t in salted) and len(set(salted)) == 4
    assert salt_placeholders(prompt, IMG, [A, B], 2) == a  # deterministic
    swapped = salt_placeholders(prompt, IMG, [B, A], 2)
    assert swapped[2:4] == a[5:7] and swapped[5:7] == a[2:4]
    assert salt_placeholders(prompt, IMG, [A, A], 2)[5:7] == a[2:4]


def test_blocks_before_the_image_hash_as_text() -> None:
    text = list(range(100, 132))
    prompt = [*text, IMG, IMG, IMG, IMG, *range(200, 212)]
    a = block_hashes(salt_placeholders(prompt, IMG, [A], 4), 16)
    b = block_hashes(salt_placeholders(prompt, IMG, [B], 4), 16)
    plain = block_hashes(prompt, 16)
    assert a[:2] == b[:2] == plain[:2]
    assert a[2] != b[2] and a[2] != plain[2]
