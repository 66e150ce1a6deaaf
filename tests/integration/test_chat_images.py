"""Images in chat messages through the official `openai` client: loaded (data URIs, local files
under the allowed directory, remote URLs only when allowed), decoded and checked at the gateway,
carried to the engine as bytes in `media` (through the worker contract's protobuf and back),
and refused with clear 400s: over the limits, undecodable, disallowed, or for an engine without
the MULTIMODAL capability.
"""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from aiohttp import web
from openai.types.chat import ChatCompletionMessageParam
from PIL import Image

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime.tinymodel import create_tiny_model
from tests.integration.test_openai_features import WireBackend

pytestmark = pytest.mark.integration

VISION, TEXT = "vision", "text-only"


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(*urls: str) -> list[ChatCompletionMessageParam]:
    parts: list[dict[str, object]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    parts.append({"type": "text", "text": "What is in the picture?"})
    return [{"role": "user", "content": parts}]  # type: ignore[list-item]


@dataclass
class Gateway:
    backend: FakeBackend
    client: openai.AsyncOpenAI
    media_dir: Path
    remote: str


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[Gateway]:
    tok = Tokenizer.from_pretrained(create_tiny_model(tmp_path / "tiny"))
    backend = WireBackend(
        [model_info(VISION, capabilities=("LOGPROBS", "MULTIMODAL")), model_info(TEXT)],
        tokens=tok.encode("A red square."),
        eos_token_id=tok.eos_token_ids[-1],
    )
    media_dir = tmp_path / "media"
    media_dir.mkdir()

    # a local "remote" image server
    async def red(_request: web.Request) -> web.Response:
        return web.Response(body=png(), content_type="image/png")

    files = web.Application()
    files.router.add_get("/red.png", red)
    files_runner, files_port = await serve_http(files, "127.0.0.1", 0)
    config = FrontendConfig(
        allowed_local_media_path=str(media_dir),
        max_image_bytes=4096,
        max_image_side=64,
        max_images_per_request=2,
    )
    service = OpenAIService(backend, {VISION: tok, TEXT: tok}, config)
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
    )
    try:
        yield Gateway(backend, client, media_dir, f"http://127.0.0.1:{files_port}/red.png")
    finally:
        await client.close()
        await runner.cleanup()
        await files_runner.cleanup()


async def test_images_reach_the_engine_as_bytes(gw: Gateway) -> None:
    red, blue = png(), png(color=(0, 0, 255))
    (gw.media_dir / "blue.png").write_bytes(blue)
    resp = await gw.client.chat.completions.create(
        model=VISION,
        messages=chat(data_uri(red), f"file://{gw.media_dir / 'blue.png'}"),
        max_tokens=5,
    )
    assert resp.choices[0].message.content
    media = gw.backend.calls[-1].request.media
    assert [(m.mime_type, m.data) for m in media] == [("image/png", red), ("image/png", blue)]
    # an absolute path works as a file URL does
    await gw.client.chat.completions.create(
        model=VISION, messages=chat(str(gw.media_dir / "blue.png")), max_tokens=1
    )
    assert gw.backend.calls[-1].request.media[0].data == blue


async def _refused(gw: Gateway, model: str, *urls: str) -> str:
    before = len(gw.backend.calls)
    with pytest.raises(openai.BadRequestError) as info:
        await gw.client.chat.completions.create(model=model, messages=chat(*urls), max_tokens=1)
    assert len(gw.backend.calls) == before  # nothing reached the engine
    assert info.value.param == "messages"  # type: ignore[attr-defined]
    return info.value.message


async def test_bad_images_get_clear_400s(gw: Gateway) -> None:
    big = png(100, 10)
    assert "over the limit of 64 per side" in await _refused(gw, VISION, data_uri(big))
    noisy = Image.frombytes("RGB", (60, 60), bytes(range(256)) * 42 + bytes(48))
    buf = io.BytesIO()
    noisy.save(buf, "BMP")  # 10 KiB uncompressed
    assert "over the limit of 4096" in await _refused(gw, VISION, data_uri(buf.getvalue()))
    assert "cannot be decoded" in await _refused(gw, VISION, data_uri(b"not an image at all"))
    truncated = png(40, 40)[:-30]
    assert "cannot be decoded" in await _refused(gw, VISION, data_uri(truncated))
    assert "not valid base64" in await _refused(gw, VISION, "data:image/png;base64,@@@")
    assert "3 images is over the limit of 2" in await _refused(gw, VISION, *[data_uri(png())] * 3)
    assert "remote image URLs are not allowed" in await _refused(gw, VISION, gw.remote)
    outside = gw.media_dir.parent / "secret.png"
    outside.write_bytes(png())
    assert "outside the allowed directory" in await _refused(gw, VISION, str(outside))
    sneaky = f"file://{gw.media_dir}/../secret.png"
    assert "outside the allowed directory" in await _refused(gw, VISION, sneaky)
    assert "cannot read" in await _refused(gw, VISION, str(gw.media_dir / "missing.png"))
    message = await _refused(gw, TEXT, data_uri(png()))
    assert "MULTIMODAL" in message and "does not take images" in message


async def test_remote_images_only_when_allowed(gw: Gateway, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(create_tiny_model(tmp_path / "tiny2"))
    backend = WireBackend([model_info(VISION, capabilities=("MULTIMODAL",))], tokens=[5, 6])
    config = FrontendConfig(allow_remote_media=True, media_fetch_timeout_s=5)
    service2 = OpenAIService(backend, {VISION: tok}, config)
    runner, port = await serve_http(build_app(service2), "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    try:
        await client.chat.completions.create(model=VISION, messages=chat(gw.remote), max_tokens=1)
        assert backend.calls[-1].request.media[0].data == png()
        with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
            await client.chat.completions.create(
                model=VISION, messages=chat(gw.remote + "x"), max_tokens=1
            )
        with pytest.raises(openai.BadRequestError, match="local image files are not allowed"):
            await client.chat.completions.create(
                model=VISION, messages=chat("/etc/hostname"), max_tokens=1
            )
    finally:
        await client.close()
        await runner.cleanup()


async def test_image_placeholders_count_in_usage_and_count_tokens(tmp_path: Path) -> None:
    """On a model with image placeholders (its card's image_token_id / tokens_per_image), each
    image counts as the placeholder tokens it expands to: in the prompt the engine gets, in the
    OpenAI usage's prompt_tokens, and in Anthropic's count_tokens (image blocks, base64 and url
    sources, become the same images)."""
    import dataclasses

    import anthropic

    from kvmesh.runtime.tinymodel import IMAGE_CHAT_TEMPLATE, IMAGE_TOKEN

    path = create_tiny_model(
        tmp_path / "llava-tok", extra_tokens=(IMAGE_TOKEN,), chat_template=IMAGE_CHAT_TEMPLATE
    )
    tok = Tokenizer.from_pretrained(path)
    image_id = tok.encode(IMAGE_TOKEN, add_special_tokens=False)
    assert len(image_id) == 1
    per_image = 5
    info = dataclasses.replace(
        model_info(VISION, capabilities=("MULTIMODAL",)),
        image_token_id=image_id[0],
        tokens_per_image=per_image,
    )
    backend = WireBackend([info], tokens=tok.encode("Red."), eos_token_id=tok.eos_token_ids[-1])
    service = OpenAIService(backend, {VISION: tok}, FrontendConfig(allow_remote_media=True))
    files = web.Application()
    files.router.add_get("/red.png", _png_response)
    files_runner, files_port = await serve_http(files, "127.0.0.1", 0)
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    oa = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
    red, blue = png(), png(color=(0, 0, 255))
    try:
        resp = await oa.chat.completions.create(
            model=VISION, messages=chat(data_uri(red), data_uri(blue)), max_tokens=3
        )
        prompt = backend.calls[-1].request.prompt
        assert prompt.count(image_id[0]) == 2 * per_image
        assert resp.usage is not None and resp.usage.prompt_tokens == len(prompt)
        text_only = await oa.chat.completions.create(
            model=VISION, messages=[{"role": "user", "content": "What is in the picture?"}],
            max_tokens=1,
        )  # fmt: skip
        assert text_only.usage is not None
        # the template's two <image> tokens became 2 * per_image placeholders
        assert resp.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 * per_image

        b64 = base64.b64encode(red).decode()
        blocks: list[anthropic.types.ContentBlockParam] = [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "image", "source": {"type": "url", "url": f"http://127.0.0.1:{files_port}/red.png"}},
            {"type": "text", "text": "What is in the picture?"},
        ]  # fmt: skip
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": blocks}]
        counted = await an.messages.count_tokens(model=VISION, messages=messages)
        assert counted.input_tokens == len(prompt)
        answer = await an.messages.create(model=VISION, max_tokens=3, messages=messages)
        assert backend.calls[-1].request.prompt == prompt
        assert [m.data for m in backend.calls[-1].request.media] == [red, red]
        assert answer.usage.input_tokens == len(prompt)
        with pytest.raises(anthropic.BadRequestError, match="cannot be decoded"):
            bad = [{**blocks[0], "source": {**blocks[0]["source"], "data": "aGVsbG8="}}]  # type: ignore[typeddict-item]
            await an.messages.count_tokens(
                model=VISION,
                messages=[{"role": "user", "content": bad}],  # type: ignore[typeddict-item]
            )
        with pytest.raises(anthropic.BadRequestError, match="user turns"):
            await an.messages.count_tokens(
                model=VISION,
                messages=[*messages, {"role": "assistant", "content": blocks[:1]}],  # type: ignore[list-item]
            )
    finally:
        await oa.close()
        await an.close()
        await runner.cleanup()
        await files_runner.cleanup()


async def _png_response(_request: web.Request) -> web.Response:
    return web.Response(body=png(), content_type="image/png")
