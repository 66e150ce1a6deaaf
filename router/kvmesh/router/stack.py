"""The routing stack a frontend or router process runs: discovery -> worker pool -> router.

`MeshConfig` says how a process finds workers and routes to them; `build_router` builds the
worker pool and the router (in-process KV-aware or simple, or a client of a standalone
`kvmesh router`) from it, explicitly, when the process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.router.backend import BackendConfig
from kvmesh.router.kv_policy import KvPolicyFlags
from kvmesh.router.kv_router import KvRouter
from kvmesh.router.kv_scheduler import KvRouterConfig
from kvmesh.router.kv_state import DISK_HIT_WEIGHT, HOST_HIT_WEIGHT
from kvmesh.router.pool import HealthConfig, WorkerPool
from kvmesh.router.routing import Router, RouterMode, SimpleRouter
from kvmesh.router.service import RemoteRouter
from kvmesh.runtime.config import opt
from kvmesh.runtime.discovery import open_discovery
from kvmesh.runtime.grpcutil import MeshSecurity


@dataclass
class MeshConfig(BackendConfig, HealthConfig, KvPolicyFlags):
    """How a frontend or router finds workers and routes to them (with the conditional
    disaggregation thresholds, migration and admission settings of BackendConfig, the health
    checks and per-worker limits of HealthConfig, and the scoring flags of KvPolicyFlags)."""

    discovery: str = opt("", "discovery URL: file:///dir, static://h:p,h:p or etcd://h:p")
    router_mode: RouterMode = opt(
        RouterMode.KV,
        "routing policy of the in-process router; kv: KV-cache-aware (approximate for engines "
        "without KV events)",
    )
    router_address: str = opt("", "use a standalone `kvmesh router` at host:port instead")
    router_overlap_weight: float = opt(
        1.0, "kv: weight of blocks still to prefill against blocks decoding in the cost"
    )
    router_temperature: float = opt(
        0.0, "kv: 0 picks the lowest cost (ties at random); > 0 samples softmax(-cost/T)"
    )
    router_busy_kv_fraction: float = opt(
        0.0, "kv: skip workers whose KV usage reaches this fraction (0 disables)"
    )
    router_busy_waiting: int = opt(
        0, "kv: skip workers with at least this many queued requests (0 disables)"
    )
    router_approx_ttl_s: float = opt(
        120.0, "kv, engines without KV events: seconds a routed prompt counts as cached"
    )
    router_seed: int = opt(0, "seed of the router's tie-breaking and sampling")
    router_chunk_tokens: int = opt(
        8192, "kv ttft: the engines' prefill token budget per step (max_num_batched_tokens)"
    )
    router_timing_profile: str = opt(
        "",
        "kv ttft: the engines' step timing (JSON table, see kvmesh.runtime.timing); empty: the "
        "mocker's model",
    )
    router_host_hit_weight: float = opt(
        HOST_HIT_WEIGHT,
        "kv: what a prompt block on a worker's host KV tier counts for in the cost, a device "
        "block counting 1 (the share of recompute that onboarding it saves)",
    )
    router_disk_hit_weight: float = opt(
        DISK_HIT_WEIGHT, "kv: the same for a block only on a worker's disk KV tier"
    )
    router_peers: list[str] = opt(
        [], "kv: host:port of peer `kvmesh router` replicas to share predicted load with"
    )
    router_peers_discovery: bool = opt(
        False,
        "kv: also share predicted load with every KV router replica registered in --discovery "
        "(`kvmesh router` processes, frontends with --router-sync-port), as they come and go",
    )

    @property
    def kv_in_process(self) -> bool:
        """Whether the process routes with its own KV router (not a standalone one's)."""
        return not self.router_address and self.router_mode is RouterMode.KV


def build_router(
    mesh: MeshConfig, security: MeshSecurity | None = None
) -> tuple[WorkerPool, Router]:
    """The worker pool and the router a frontend or router process uses; `security`: how they
    authenticate to workers and router services (None: plaintext)."""
    if not mesh.discovery:
        raise ValueError("--discovery is required (file:///dir, static://host:port,...)")
    pool = WorkerPool(open_discovery(mesh.discovery), health=mesh, security=security)
    router: Router
    if mesh.router_address:
        router = RemoteRouter(mesh.router_address, pool)
    elif mesh.router_mode is RouterMode.KV:
        config = KvRouterConfig(
            overlap_weight=mesh.router_overlap_weight,
            temperature=mesh.router_temperature,
            busy_kv_fraction=mesh.router_busy_kv_fraction,
            busy_waiting_requests=mesh.router_busy_waiting,
            approx_ttl_s=mesh.router_approx_ttl_s,
            seed=mesh.router_seed,
            policy=mesh.router_policy,
            itl_weight=mesh.router_itl_weight,
            itl_penalty_cap_ms=mesh.router_itl_penalty_cap_ms,
            itl_penalty_ratio=mesh.router_itl_penalty_ratio,
            decode_delay_weight=mesh.router_decode_delay_weight,
            ttft_slo_ms=mesh.router_ttft_slo_ms,
            itl_slo_ms=mesh.router_itl_slo_ms,
            inflight_prefixes=mesh.router_inflight_prefixes,
            chunk_tokens=mesh.router_chunk_tokens,
            timing_profile=mesh.router_timing_profile,
            host_hit_weight=mesh.router_host_hit_weight,
            disk_hit_weight=mesh.router_disk_hit_weight,
        )
        router = KvRouter(
            pool, config, peers=mesh.router_peers, peer_discovery=mesh.router_peers_discovery
        )
    else:
        router = SimpleRouter(pool, mesh.router_mode, seed=mesh.router_seed)
    return pool, router


async def close_router(router: Router) -> None:
    """Stop a router's background tasks (subscriptions, peer sync), if it has any."""
    close = getattr(router, "close", None)
    if close is not None:
        await close()
