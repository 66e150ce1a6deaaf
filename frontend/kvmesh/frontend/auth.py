"""API keys and per-key rate limits at the gateway's doors (OpenAI, KServe REST, KServe gRPC).

`GatewayAuth.from_config` reads the keys (`--api-key`, several allowed, and/or
$KVMESH_API_KEY, comma-separated) and the limits. `check(authorization)` returns the key an
`Authorization: Bearer <key>` header carries, comparing it with every configured key in
constant time (`hmac.compare_digest`, no early exit on the first match), or raises
Unauthenticated (HTTP 401 / gRPC UNAUTHENTICATED). Keys are never logged.

Rate limits (`--rate-limit-rpm`, `--rate-limit-tpm`, per key) are token buckets refilled
continuously over a minute, as OpenAI's are: a request costs one request and its estimated
tokens (the larger of its max_tokens and a quarter of its body's length, OpenAI's estimate
from characters); over either budget it gets HTTP 429 (`rate_limit_exceeded`). Every answer
to a limited key carries OpenAI's headers: x-ratelimit-limit-requests / -tokens,
x-ratelimit-remaining-requests / -tokens, x-ratelimit-reset-requests / -tokens (e.g. "1s",
"6m0s": how long until the bucket is full again).
"""

from __future__ import annotations

import hmac
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from kvmesh.frontend.config import FrontendConfig
from kvmesh.runtime.errors import ResourceExhausted, Unauthenticated

__all__ = ["API_KEY_ENV", "GatewayAuth", "InvalidApiKey", "RateLimited", "estimate_tokens"]

API_KEY_ENV = "KVMESH_API_KEY"
"""Environment variable with API keys (comma-separated), in addition to --api-key."""

_WINDOW_S = 60.0


class RateLimited(ResourceExhausted):
    """Over a key's requests- or tokens-per-minute limit (HTTP 429, OpenAI's code
    `rate_limit_exceeded`); `headers`: the x-ratelimit-* headers of the answer."""

    openai_code = "rate_limit_exceeded"

    def __init__(self, message: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.headers = headers


class InvalidApiKey(Unauthenticated):
    """A key was given but is not one of the gateway's (HTTP 401, OpenAI's code
    `invalid_api_key`)."""

    openai_code = "invalid_api_key"


class _Budget(msgspec.Struct):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None


_budget_decoder = msgspec.json.Decoder(_Budget)


def estimate_tokens(body: bytes) -> int:
    """What a request counts against a tokens-per-minute limit before it runs: the larger of
    its max_tokens (or max_completion_tokens) and len(body) / 4."""
    try:
        budget = _budget_decoder.decode(body)
        asked = budget.max_completion_tokens or budget.max_tokens or 0
    except (msgspec.DecodeError, msgspec.ValidationError):
        asked = 0  # the handler reports the malformed body
    return max(asked if asked > 0 else 0, math.ceil(len(body) / 4), 1)


@dataclass
class _Bucket:
    """A token bucket holding at most `limit`, refilled at limit per minute."""

    limit: int
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.at) * self.limit / _WINDOW_S)
        self.at = now

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.limit - self.level) * _WINDOW_S / self.limit


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "6m0s"."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass
class _KeyLimits:
    requests: _Bucket | None
    tokens: _Bucket | None


@dataclass
class GatewayAuth:
    """The gateway's API keys and per-key limits (see the module docstring)."""

    keys: tuple[bytes, ...]
    rpm: int = 0
    tpm: int = 0
    protect_metrics: bool = False
    clock: Callable[[], float] = time.monotonic
    _limits: dict[bytes, _KeyLimits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.rpm or self.tpm) and not self.keys:
            raise ValueError("rate limits are per API key: set --api-key (or $KVMESH_API_KEY)")

    @classmethod
    def from_config(
        cls, config: FrontendConfig, environ: dict[str, str] | None = None
    ) -> GatewayAuth | None:
        """The gateway's keys and limits, or None when it has no keys (open doors)."""
        env = (environ if environ is not None else os.environ).get(API_KEY_ENV, "")
        keys = _keys([*config.api_key, *env.split(",")])
        if not keys and not (config.rate_limit_rpm or config.rate_limit_tpm):
            if config.protect_metrics:
                raise ValueError("--protect-metrics needs API keys (--api-key or $KVMESH_API_KEY)")
            return None
        return cls(
            keys,
            rpm=config.rate_limit_rpm,
            tpm=config.rate_limit_tpm,
            protect_metrics=config.protect_metrics,
        )

    @property
    def limited(self) -> bool:
        """Whether requests are rate limited."""
        return bool(self.rpm or self.tpm)

    def check(self, authorization: str | None) -> bytes:
        """The key `authorization` ("Bearer <key>") carries, or Unauthenticated."""
        if not authorization:
            raise Unauthenticated(
                "You didn't provide an API key. Send it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."
            )
        scheme, _, given = authorization.strip().partition(" ")
        given_bytes = given.strip().encode()
        if scheme.lower() != "bearer" or not given_bytes:
            raise Unauthenticated("Malformed Authorization header: expected 'Bearer YOUR_KEY'.")
        found: bytes | None = None
        for key in self.keys:  # every key compared: the time does not tell which one matched
            if hmac.compare_digest(given_bytes, key):
                found = key
        if found is None:
            raise InvalidApiKey("Incorrect API key provided.")
        return found

    def admit(self, key: bytes, tokens: int) -> dict[str, str]:
        """Charge one request and `tokens` to `key`; the x-ratelimit-* headers to send, or
        RateLimited (whose `headers` are the same) when over a limit."""
        limits = self._limits.get(key)
        now = self.clock()
        if limits is None:
            limits = _KeyLimits(
                _Bucket(self.rpm, self.rpm, now) if self.rpm else None,
                _Bucket(self.tpm, self.tpm, now) if self.tpm else None,
            )
            self._limits[key] = limits
        for bucket in (limits.requests, limits.tokens):
            if bucket is not None:
                bucket.refill(now)
        over: str | None = None
        if limits.requests is not None and limits.requests.level < 1:
            over = f"requests per minute (RPM): limit {self.rpm}"
        elif limits.tokens is not None and limits.tokens.level < tokens:
            over = (
                f"tokens per minute (TPM): limit {self.tpm}, remaining "
                f"{int(limits.tokens.level)}, requested {tokens}"
            )
        if over is None:
            if limits.requests is not None:
                limits.requests.level -= 1
            if limits.tokens is not None:
                limits.tokens.level -= tokens
        headers = _headers(limits)
        if over is not None:
            raise RateLimited(f"Rate limit reached on {over}.", headers)
        return headers


def _headers(limits: _KeyLimits) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, bucket in (("requests", limits.requests), ("tokens", limits.tokens)):
        if bucket is not None:
            out[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(bucket.level)))
            out[f"x-ratelimit-reset-{name}"] = _duration(bucket.reset_s())
    return out


def _keys(values: Sequence[str]) -> tuple[bytes, ...]:
    keys: list[bytes] = []
    for value in values:
        key = value.strip()
        if not key:
            continue
        if any(c.isspace() for c in key):
            raise ValueError("an API key cannot contain whitespace")
        if key.encode() not in keys:
            keys.append(key.encode())
    return tuple(keys)
