"""Disaggregated prefill/decode: moving a prompt's KV cache from a prefill worker to a decode
worker.

Flow (see ARCHITECTURE.md, "Request flow: Disaggregated"): the gateway picks a prefill worker P
(KV-aware) and a decode worker D (load-aware). P's engine runs `prefill_remote`: it computes the
prompt's KV, samples the first token and keeps the prompt's blocks pinned under a transfer id
(`PinnedTransfers`, which also frees them when nobody releases them in time). The
`KvTransferHandle` it returns names P's NIXL agent, its metadata, the block layout and every
block's address. D's engine pulls the blocks with a one-sided NIXL READ (`NixlKvAgent`) straight
into free blocks of its own KV cache, calls ReleaseKvBlocks on P (`GrpcKvReleaser`), and uses
the pulled KV only when P confirms the blocks were still pinned during the read; otherwise it
recomputes the prompt. Then it decodes after the first token.

Modules: `nixl_agent` (NIXL wrapper, host or GPU memory, asyncio-friendly), `layout` (turning
block addresses into NIXL descriptor arrays), `pins` (pinned transfers with expiry), `release`
(the gRPC releaser the worker server gives its engine). This package imports neither NIXL,
numpy nor torch: `nixl_agent` and `layout` import them when used (the `nixl` extra);
`nixl_agent.nixl_available()` says whether NIXL can be used.
"""

from kvmesh.workers.disagg.pins import PinnedTransfers
from kvmesh.workers.disagg.release import GrpcKvReleaser

__all__ = ["GrpcKvReleaser", "PinnedTransfers"]
