"""API keys and per-key rate limits at the gateway: GatewayAuth on its own (keys from flags and
the environment, constant-time check, token buckets with OpenAI's x-ratelimit-* headers), and
a real aiohttp gateway over FakeBackend (401 on /v1 and /v2, probes open, --protect-metrics,
429 with headers)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvmesh.frontend.app import build_app, serve_http
from kvmesh.frontend.auth import GatewayAuth, InvalidApiKey, RateLimited, estimate_tokens
from kvmesh.frontend.config import FrontendConfig
from kvmesh.frontend.service import OpenAIService
from kvmesh.frontend.testing import DEFAULT_TEXT, FakeBackend, model_info
from kvmesh.frontend.tokenizer import Tokenizer
from kvmesh.runtime.errors import Unauthenticated
from kvmesh.runtime.tinymodel import create_tiny_model

pytestmark = pytest.mark.unit

MODEL = "tiny"


def test_keys_from_flags_and_environment() -> None:
    config = FrontendConfig(api_key=["k-one", "k-two"])
    auth = GatewayAuth.from_config(config, {"KVMESH_API_KEY": "k-three, k-one,"})
    assert auth is not None and auth.keys == (b"k-one", b"k-two", b"k-three")
    for key in ("k-one", "k-two", "k-three"):
        assert auth.check(f"Bearer {key}") == key.encode()
    assert auth.check("bearer  k-two ") == b"k-two"
    with pytest.raises(InvalidApiKey):
        auth.check("Bearer k-four")
    with pytest.raises(InvalidApiKey):
        auth.check("Bearer k-on")  # a prefix is not a key
    for bad in (None, "", "k-one", "Basic k-one", "Bearer "):
        with pytest.raises(Unauthenticated):
            auth.check(bad)
    assert GatewayAuth.from_config(FrontendConfig(), {}) is None
    with pytest.raises(ValueError, match="protect-metrics"):
        GatewayAuth.from_config(FrontendConfig(protect_metrics=True), {})
    with pytest.raises(ValueError, match="per API key"):
        GatewayAuth.from_config(FrontendConfig(rate_limit_rpm=5), {})


def test_token_buckets_and_headers() -> None:
    now = [0.0]
    auth = GatewayAuth((b"a", b"b"), rpm=2, tpm=100, clock=lambda: now[0])
    first = auth.admit(b"a", 30)
    assert first == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "70",
        "x-ratelimit-reset-tokens": "18s",
    }
    auth.admit(b"a", 30)
    with pytest.raises(RateLimited, match="requests per minute") as info:
        auth.admit(b"a", 1)
    assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert info.value.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert auth.admit(b"b", 1)["x-ratelimit-remaining-requests"] == "1"  # per key
    now[0] = 30.0  # half a minute refills one request and 50 tokens (40 + 50 = 90)
    with pytest.raises(RateLimited, match="tokens per minute"):
        auth.admit(b"a", 95)
    assert auth.admit(b"a", 90)["x-ratelimit-remaining-tokens"] == "0"
    now[0] = 30.01
    assert auth.admit(b"b", 1)["x-ratelimit-reset-requests"] == "30s"


def test_estimate_tokens() -> None:
    assert estimate_tokens(json.dumps({"max_tokens": 500, "prompt": "hi"}).encode()) == 500
    assert estimate_tokens(json.dumps({"max_completion_tokens": 64}).encode()) == 64
    body = json.dumps({"prompt": "x" * 400}).encode()
    assert estimate_tokens(body) == (len(body) + 3) // 4
    assert estimate_tokens(b"not json") == 2


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    tok = Tokenizer.from_pretrained(create_tiny_model(tmp_path / "tiny-llama"))
    backend = FakeBackend(
        [model_info(MODEL, context_length=512)],
        tokens=tok.encode(DEFAULT_TEXT),
        eos_token_id=tok.eos_token_ids[-1],
    )
    config = FrontendConfig(
        api_key=["sk-good"], protect_metrics=True, rate_limit_rpm=3, rate_limit_tpm=1000
    )
    service = OpenAIService(backend, {MODEL: tok}, config)
    auth = GatewayAuth.from_config(config, {})
    runner, port = await serve_http(build_app(service, config, auth), "127.0.0.1", 0)
    http = aiohttp.ClientSession()
    try:
        yield f"http://127.0.0.1:{port}", http
    finally:
        await http.close()
        await runner.cleanup()


async def test_gateway_doors(gateway: tuple[str, aiohttp.ClientSession]) -> None:
    base, http = gateway
    good = {"Authorization": "Bearer sk-good"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for path in ("/v1/chat/completions", "/v1/completions", "/v2/models/tiny/infer"):
        for headers in ({}, {"Authorization": "Bearer sk-bad"}):
            async with http.post(base + path, json=chat, headers=headers) as resp:
                body = await resp.json()
                assert resp.status == 401, path
                assert body["error"]["type"] == "invalid_request_error"
                assert resp.headers["WWW-Authenticate"] == "Bearer"
    for path in ("/health", "/live", "/v2/health/live"):
        async with http.get(base + path) as resp:
            assert resp.status in (200, 503), path  # open: not 401
    async with http.get(base + "/metrics") as resp:
        assert resp.status == 401  # --protect-metrics
    async with http.get(base + "/metrics", headers=good) as resp:
        assert resp.status == 200
        assert resp.headers["x-ratelimit-remaining-requests"] == "2"
    async with http.post(base + "/v1/chat/completions", json=chat, headers=good) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["x-ratelimit-limit-requests"] == "3"
        assert resp.headers["x-ratelimit-remaining-requests"] == "1"
        assert int(resp.headers["x-ratelimit-remaining-tokens"]) < 1000
    streamed = {**chat, "stream": True}
    async with http.post(base + "/v1/chat/completions", json=streamed, headers=good) as resp:
        assert resp.status == 200
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        await resp.read()
    async with http.post(base + "/v1/chat/completions", json=chat, headers=good) as resp:
        body = await resp.json()
        assert resp.status == 429
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert body["error"]["type"] == "rate_limit_error"
        assert resp.headers["x-ratelimit-remaining-requests"] == "0"


async def test_https_certificate_rotation_under_load(tmp_path: Path) -> None:
    """The gateway's HTTPS certificate is replaced on disk while clients keep opening new
    connections: every request succeeds, and new connections get the new certificate."""
    import asyncio
    import hashlib
    import ssl

    from kvmesh.runtime.tls import ReloadingTls, ServerSslContext, write_dev_pki

    pki = write_dev_pki(tmp_path / "pki", ["gateway"])
    tok = Tokenizer.from_pretrained(create_tiny_model(tmp_path / "tiny-llama"))
    backend = FakeBackend([model_info(MODEL)], tokens=tok.encode(DEFAULT_TEXT))
    service = OpenAIService(backend, {MODEL: tok}, FrontendConfig())
    tls = ServerSslContext(ReloadingTls(pki.files("gateway"), check_s=0.05))
    runner, port = await serve_http(build_app(service), "127.0.0.1", 0, tls=tls)
    client_ssl = ssl.create_default_context(cafile=str(pki.ca))
    seen: set[str] = set()
    failures: list[str] = []
    stop = asyncio.Event()

    async def client() -> None:
        # A new connection per request: each one is a handshake.
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ssl)
                der = writer.get_extra_info("ssl_object").getpeercert(True)
                seen.add(hashlib.sha256(der).hexdigest())
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                status = (await reader.readline()).decode()
                await reader.read()
                writer.close()
                if " 200 " not in status:
                    failures.append(status)
            except (OSError, ssl.SSLError) as exc:
                failures.append(repr(exc))

    tasks = [asyncio.create_task(client()) for _ in range(4)]
    try:
        await asyncio.sleep(0.3)
        before = set(seen)
        pki.issue("gateway")  # key first, then the certificate (atomic renames)
        await asyncio.sleep(1.0)  # ReloadingTls looks every 0.05 s
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await runner.cleanup()
    assert len(before) == 1 and len(seen) == 2, "new connections did not get the new certificate"
    assert not failures, failures[:5]
