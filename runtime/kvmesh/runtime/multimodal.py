"""Image placeholders in token ids: expanding them (gateway) and salting them for block hashes
(router and engine alike).

A LLaVA-style model's prompt holds, for each image, `tokens_per_image` copies of its image token
(`ModelInfo.image_token_id`); the engine substitutes the image's features for their embeddings.
The chat template renders one image token per image; `expand_placeholders` repeats each, as the
model's own processor does.

Block hashes cover token ids only, so two prompts with the same text and different images would
hash alike. `salt_placeholders` returns the token ids to hash instead (as SGLang pads image
tokens with an image hash): the `j`-th placeholder of image `k` becomes

    SALT_BIT | (xxh3_64(j as uint32 LE, seed=media_hash(image k)) >> 33)

a 31-bit value keyed by the image's bytes and the position in the image, with the top bit set,
so it never equals a real token id (vocabularies are far below 2**31) and still fits the uint32
of the wire and of KV events. Everything else is unchanged: blocks before the first placeholder
hash as plain text (same text prefix, shared blocks), the block holding an image's first
placeholder and every block after it (hashes are chained) differ with the image. The engine hashes
its blocks over these ids and publishes them in its KV events; the router hashes a request's
salted ids; so both agree, and the router's index stays exact.

The placeholders of a request are the first `len(media) * tokens_per_image` image tokens of its
prompt, image k taking the k-th run of `tokens_per_image` of them (in the prompt's order, as
transformers' LLaVA scatters image features); an image token after those (generated, say) is a
plain token.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from xxhash import xxh3_64_intdigest

from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import MediaInput

__all__ = [
    "SALT_BIT",
    "decode_images",
    "expand_placeholders",
    "media_hash",
    "placeholder_positions",
    "salt_id",
    "salt_placeholders",
]

SALT_BIT = 1 << 31
"""Set in every salted placeholder id (never set in a real token id)."""
_MEDIA_TAG = b"kvmesh-media\0"


def media_hash(media: MediaInput) -> int:
    """64-bit hash of an image's bytes and MIME type (stable across processes)."""
    return xxh3_64_intdigest(_MEDIA_TAG + media.mime_type.encode() + b"\0" + media.data)


def placeholder_positions(
    tokens: Sequence[int], image_token_id: int, num_media: int, tokens_per_image: int
) -> list[int]:
    """Positions of the request's placeholders in `tokens` (see the module docstring).

    Raises InvalidRequest when `tokens` holds fewer than `num_media * tokens_per_image` image
    tokens.
    """
    need = num_media * tokens_per_image
    positions: list[int] = []
    if need:
        for i, t in enumerate(tokens):
            if t == image_token_id:
                positions.append(i)
                if len(positions) == need:
                    break
    if len(positions) != need:
        raise InvalidRequest(
            f"the prompt holds {len(positions)} image placeholder tokens (id {image_token_id}); "
            f"{num_media} image(s) need {tokens_per_image} each ({need})",
            param="media",
        )
    return positions


def salt_placeholders(
    tokens: Sequence[int],
    image_token_id: int,
    media: Sequence[MediaInput],
    tokens_per_image: int,
) -> list[int]:
    """`tokens` with the placeholders of `media` replaced by their salted ids (see the module
    docstring): what block hashes cover. Raises InvalidRequest like placeholder_positions."""
    out = list(tokens)
    positions = placeholder_positions(out, image_token_id, len(media), tokens_per_image)
    for k, image in enumerate(media):
        seed = media_hash(image)
        base = k * tokens_per_image
        for j in range(tokens_per_image):
            out[positions[base + j]] = salt_id(seed, j)
    return out


def salt_id(seed: int, j: int) -> int:
    """The salted id of the `j`-th placeholder of the image whose media_hash is `seed`."""
    return SALT_BIT | (xxh3_64_intdigest(j.to_bytes(4, "little"), seed) >> 33)


def decode_images(media: Sequence[MediaInput]) -> list[Any]:
    """`media` decoded with Pillow, as RGB PIL images. InvalidRequest names an image that cannot
    be decoded."""
    from PIL import Image, UnidentifiedImageError

    decoded: list[Any] = []
    for i, m in enumerate(media):
        try:
            with Image.open(io.BytesIO(m.data)) as img:
                decoded.append(img.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise InvalidRequest(
                f"media[{i}] ({m.mime_type or 'no MIME type'}) is not a decodable image: {exc}",
                param="media",
            ) from None
    return decoded


def expand_placeholders(
    tokens: Sequence[int], image_token_id: int, tokens_per_image: int, num_media: int
) -> list[int]:
    """`tokens` (a rendered chat template: one image token per image) with each image token
    repeated `tokens_per_image` times. Raises InvalidRequest when the template did not render
    exactly one per image."""
    found = sum(1 for t in tokens if t == image_token_id)
    if found != num_media:
        raise InvalidRequest(
            f"the chat template rendered {found} image placeholder(s) for {num_media} image(s)",
            param="messages",
        )
    if tokens_per_image == 1:
        return list(tokens)
    out: list[int] = []
    for t in tokens:
        if t == image_token_id:
            out.extend([t] * tokens_per_image)
        else:
            out.append(t)
    return out
