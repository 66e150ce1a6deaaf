"""Images of chat requests: loaded, decoded and checked at the gateway, sent as bytes.

An `image_url` content part names its image by
- a `data:` URI (`data:image/png;base64,...`): always accepted;
- a local file (`file:///abs/path` or an absolute path): only under
  `--allowed-local-media-path` (the resolved path, so `..` and links cannot leave it);
- an `http(s)://` URL: only with `--allow-remote-media`; fetched with a time limit and a size
  cap (the body is read up to the cap, never further).

Every image is decoded with Pillow (header and full decode, so a truncated file is refused),
must be PNG, JPEG, GIF, WebP or BMP, at most `--max-image-bytes` and `--max-image-side` pixels
wide and high, and a request carries at most `--max-images-per-request`. Any failure is an
InvalidRequest (HTTP 400) that says which image and why. Workers receive the image bytes
(kvmesh.runtime.types.MediaInput), never a URL.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from pathlib import Path
from urllib.parse import unquote, urlparse

import aiohttp

from kvmesh.frontend.config import FrontendConfig
from kvmesh.runtime.errors import InvalidRequest
from kvmesh.runtime.types import MediaInput

__all__ = ["check_image", "load_image", "load_images"]

_FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "GIF": "image/gif",
    "WEBP": "image/webp",
    "BMP": "image/bmp",
}


def _bad(index: int, problem: str) -> InvalidRequest:
    return InvalidRequest(f"image {index}: {problem}", param="messages")


def check_image(data: bytes, index: int, config: FrontendConfig) -> MediaInput:
    """Decode `data` with Pillow and check it against the limits; the MediaInput to send."""
    from PIL import Image

    if len(data) > config.max_image_bytes:
        raise _bad(index, f"{len(data)} bytes is over the limit of {config.max_image_bytes}")
    if not data:
        raise _bad(index, "the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                fmt = img.format or ""
                width, height = img.size
                limit = config.max_image_side
                if width > limit or height > limit:
                    raise _bad(
                        index, f"{width}x{height} pixels is over the limit of {limit} per side"
                    )
                img.load()  # the whole image decodes (a truncated file fails here)
    except InvalidRequest:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Warning) as exc:
        raise _bad(index, f"cannot be decoded as an image ({exc})") from None
    mime = _FORMATS.get(fmt)
    if mime is None:
        raise _bad(index, f"format {fmt or 'unknown'} is not accepted (PNG, JPEG, GIF, WebP, BMP)")
    return MediaInput(mime, data)


def _data_uri(url: str, index: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise _bad(index, "a data: URI must be base64 encoded (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(index, "the data: URI is not valid base64") from None


def _local_file(url: str, index: int, config: FrontendConfig) -> bytes:
    root = config.allowed_local_media_path
    if not root:
        raise _bad(
            index, "local image files are not allowed (start the gateway with "
            "--allowed-local-media-path DIR)"
        )  # fmt: skip
    raw = unquote(urlparse(url).path) if url.startswith("file://") else url
    base = Path(root).resolve()
    path = Path(raw).resolve()
    if not path.is_relative_to(base):
        raise _bad(index, f"{raw} is outside the allowed directory {base}")
    try:
        size = path.stat().st_size
        if size > config.max_image_bytes:
            raise _bad(index, f"{size} bytes is over the limit of {config.max_image_bytes}")
        return path.read_bytes()
    except OSError as exc:
        raise _bad(index, f"cannot read {raw} ({exc.strerror or exc})") from None


async def _remote(url: str, index: int, config: FrontendConfig) -> bytes:
    if not config.allow_remote_media:
        raise _bad(
            index,
            "remote image URLs are not allowed (send a data: URI, or start the gateway with "
            "--allow-remote-media)",
        )
    cap = config.max_image_bytes
    timeout = aiohttp.ClientTimeout(total=config.media_fetch_timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url) as resp:
            if resp.status != 200:
                raise _bad(index, f"fetching {url} answered HTTP {resp.status}")
            data = await resp.content.read(cap + 1)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _bad(index, f"cannot fetch {url} ({type(exc).__name__})") from None
    if len(data) > cap:
        raise _bad(index, f"the image at {url} is over the limit of {cap} bytes")
    return data


async def load_image(url: str, index: int, config: FrontendConfig) -> MediaInput:
    """The checked image an `image_url` names (see the module docstring)."""
    if url.startswith("data:"):
        data = _data_uri(url, index)
    elif url.startswith(("http://", "https://")):
        data = await _remote(url, index, config)
    elif url.startswith("file://") or url.startswith("/"):
        data = _local_file(url, index, config)
    else:
        raise _bad(index, "the URL must be a data: URI, a file path or an http(s) URL")
    return check_image(data, index, config)


async def load_images(urls: list[str], config: FrontendConfig) -> tuple[MediaInput, ...]:
    """Every image of a request, in order, within --max-images-per-request."""
    if len(urls) > config.max_images_per_request:
        raise InvalidRequest(
            f"{len(urls)} images is over the limit of {config.max_images_per_request} per request",
            param="messages",
        )
    return tuple([await load_image(url, i, config) for i, url in enumerate(urls)])
