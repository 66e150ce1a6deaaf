"""Settings of a worker process (engine-specific settings live in each engine's config)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmesh.runtime.config import opt
from kvmesh.runtime.metrics import METRICS_PORT_HELP
from kvmesh.runtime.types import Role


class EngineKind(enum.Enum):
    """Engine adapters `kvmesh worker --engine` knows."""

    MOCKER = "mocker"
    TORCH = "torch"
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


@dataclass
class WorkerConfig:
    """Settings of one worker process (engine-specific settings live in the engine's config)."""

    engine: EngineKind = opt(EngineKind.MOCKER, "engine adapter to run")
    model: str = opt("", "local Hugging Face model directory; empty: the built-in tiny model")
    served_model_name: str = opt("", "model name clients use; empty: the model directory's name")
    host: str = opt("127.0.0.1", "address to bind the gRPC server to")
    advertise_host: str = opt(
        "", "host other machines use to reach this worker; empty: --host (or 127.0.0.1)"
    )
    port: int = opt(0, "gRPC port; 0 picks a free one")
    role: Role = opt(
        Role.AGGREGATED,
        "worker role: aggregated (prefill and decode), prefill (serves PrefillRemote for decode "
        "workers), decode (pulls prompt KV from prefill workers)",
    )
    kv_pin_timeout_s: float = opt(
        30.0, "prefill role: free pinned prompt KV that no decode worker released after this long"
    )
    kv_transfer_timeout_s: float = opt(
        10.0, "decode role: give up pulling prompt KV after this long (and recompute the prompt)"
    )
    discovery: str = opt("", "discovery URL (file:///dir, etcd://h:p); empty: do not register")
    worker_id: str = opt("", "unique worker id; empty: a random one")
    drain_timeout_s: float = opt(
        30.0,
        "grace period of a shutdown or scale-down: how long in-flight requests may take to "
        "finish before they are cancelled",
    )
    leave_delay_s: float = opt(
        0.5,
        "on shutdown, keep serving this long after leaving discovery, so that routers stop "
        "sending before the worker refuses new requests (0: refuse at once)",
    )
    metrics_port: int = opt(-1, METRICS_PORT_HELP)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0 or not self.leave_delay_s >= 0:
            raise ValueError("--drain-timeout-s and --leave-delay-s must be >= 0")
