"""Configuration of the HTTP gateway (one dataclass; the CLI is generated from it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmesh.runtime.config import opt

__all__ = ["FrontendConfig"]


@dataclass(slots=True)
class FrontendConfig:
    """Settings of the OpenAI-compatible HTTP gateway (and its KServe v2 front doors)."""

    http_host: str = opt("127.0.0.1", "address the HTTP server binds")
    http_port: int = opt(8000, "HTTP port (0: pick a free one)")
    http_tls_cert: str = opt(
        "",
        "PEM certificate (chain) of the gateway: HTTPS, and TLS on the KServe gRPC port "
        "(reloaded when the file changes); empty: plaintext",
    )
    http_tls_key: str = opt("", "PEM private key of --http-tls-cert")
    api_key: list[str] = opt(
        [],
        "API keys clients must send (Authorization: Bearer KEY) on /v1 and /v2 routes and "
        "the KServe gRPC port; several allowed; $KVMESH_API_KEY (comma-separated) adds "
        "more; none: open",
    )
    protect_metrics: bool = opt(
        False, "/metrics needs an API key too (/health, /live and /v2/health stay open)"
    )
    rate_limit_rpm: int = opt(0, "requests per minute allowed per API key (0: no limit)")
    rate_limit_tpm: int = opt(
        0,
        "tokens per minute allowed per API key, counted as a request's max_tokens or "
        "body length / 4, whichever is larger (0: no limit)",
    )
    model: str = opt("", "local Hugging Face model directory (tokenizer, chat template, config)")
    served_model_name: str = opt(
        "", "name clients use in the `model` field (empty: the model directory's name)"
    )
    max_request_bytes: int = opt(
        16 * 1024 * 1024, "largest accepted request body in bytes (larger: HTTP 413)"
    )
    max_n: int = opt(64, "largest accepted `n` (choices per request)")
    default_completion_max_tokens: int = opt(
        16, "max_tokens of /v1/completions when the request has none (OpenAI's default)"
    )
    tokenizer_cache_entries: int = opt(
        32768,
        "pieces kept by the exact prefix-chunk tokenization cache (0 disables it); "
        "see kvmesh.frontend.tokencache",
    )
    keepalive_timeout_s: float = opt(75.0, "idle keep-alive connections are closed after this")
    backlog: int = opt(4096, "listen backlog (many clients connecting at once)")
    drain_timeout_s: float = opt(
        30.0,
        "on shutdown, how long in-flight requests may run before they are cancelled (streams "
        "then end with an error event and [DONE]; a second SIGINT/SIGTERM cancels them at once)",
    )
    stream_write_timeout_s: float = opt(
        60.0,
        "a streaming client that reads nothing for this long (its socket's buffer stays full) is "
        "cut off; meanwhile its request is paused on its worker. 0: never cut",
    )
    send_buffer_bytes: int = opt(
        262144,
        "kernel send buffer of each HTTP connection (SO_SNDBUF; it bounds what a streaming client "
        "that does not read holds in the kernel, which otherwise grows it to megabytes). 0: the "
        "kernel's default",
    )
    gateway_processes: int = opt(
        1,
        "gateway processes serving --http-port (and the KServe gRPC port) together, for more "
        "than one core's worth of requests: the kernel spreads connections between them "
        "(SO_REUSEPORT); each routes with its own KV router, sharing predicted load with the "
        "others, and /metrics from any of them sums all. 0: one per CPU this process may use "
        "(its affinity and its container's CPU limit)",
    )
    router_sync_port: int = opt(
        -1,
        "serve the in-process KV router as RouterService on this port of --http-host, so "
        "other gateways' --router-peers share its bookings (SubscribeLoadEventBatches); 0: a "
        "free one (logged); -1: off",
    )
    router_sync_advertise_host: str = opt(
        "",
        "host other gateways use to reach --router-sync-port, registered in --discovery for "
        "their --router-peers-discovery; empty: --http-host (127.0.0.1 for a wildcard)",
    )
    gateway_group: str = opt(
        "",
        "set by --gateway-processes for each of its processes (DIRECTORY,INDEX,COUNT): bind "
        "the ports with SO_REUSEPORT, serve this process's metrics to the others",
    )
    kserve_grpc_port: int = opt(
        -1,
        "port of the KServe v2 gRPC server (inference.GRPCInferenceService, incl. Triton's "
        "ModelStreamInfer) on --http-host; 0: pick a free one (logged), -1: no KServe gRPC "
        "server",
    )
    tool_call_parser: str = opt(
        "auto",
        "how tool calls are read from model output: hermes, llama3_json, mistral, pythonic, "
        "qwen3_coder, glm45, deepseek_v3, deepseek_v31, kimi_k2, none, or auto (from the "
        "chat template); per model: 'model=parser,...' (an entry "
        "without 'model=' is the default)",
    )
    reasoning_parser: str = opt(
        "auto",
        "how <think> reasoning is split from the answer (reasoning_content): qwen3, "
        "deepseek_r1, none, or auto (from the chat template); per model as for "
        "--tool-call-parser",
    )

    allowed_local_media_path: str = opt(
        "",
        "directory whose image files chat requests may name (file:// URLs or absolute paths); "
        "empty: local files are refused",
    )
    allow_remote_media: bool = opt(
        False, "let chat requests name http(s) image URLs, which the gateway fetches"
    )
    max_image_bytes: int = opt(20 << 20, "largest accepted image file, in bytes")
    max_image_side: int = opt(4096, "largest accepted image width or height, in pixels")
    max_images_per_request: int = opt(8, "most images one chat request may carry")
    media_fetch_timeout_s: float = opt(10.0, "time limit of fetching one remote image")

    def __post_init__(self) -> None:
        if min(self.max_image_bytes, self.max_image_side, self.max_images_per_request) < 1:
            raise ValueError("image limits must be >= 1")
        if self.http_port < 0:
            raise ValueError("http_port must be >= 0 (0: pick a free one)")
        if self.rate_limit_rpm < 0 or self.rate_limit_tpm < 0:
            raise ValueError("rate limits must be >= 0 (0: no limit)")
        if self.kserve_grpc_port < -1:
            raise ValueError("kserve_grpc_port must be >= -1 (-1: off, 0: pick a free one)")
        if not self.stream_write_timeout_s >= 0 or not self.drain_timeout_s >= 0:
            raise ValueError("stream_write_timeout_s and drain_timeout_s must be >= 0")
        if self.gateway_processes < 0:
            raise ValueError("gateway_processes must be >= 0 (0: one per usable CPU)")
        if self.router_sync_port < -1:
            raise ValueError("router_sync_port must be >= -1 (-1: off, 0: pick a free one)")
        if self.gateway_processes != 1 and self.router_sync_port >= 0:
            raise ValueError(
                "--router-sync-port serves one process's router: with --gateway-processes, "
                "each process's is chosen for it"
            )
        if self.send_buffer_bytes < 0:
            raise ValueError("send_buffer_bytes must be >= 0")

    def model_name(self) -> str:
        """The served model name: `served_model_name`, else the model directory's name."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name if self.model else ""
