"""The torch device the torch-engine tests run on.

`cpu` unless `KVMESH_TEST_DEVICE` names another (`cuda`, `cuda:N`): `tests/run_gpu.sh` runs the
torch engine's tests (greedy output against transformers' generate(), the conformance suite,
LoRA, speculative decoding, KV tiers, disaggregation over NIXL, which then registers GPU memory)
on a GPU machine that way. A device that is named but absent is a usage error (conftest.py), not
a silent CPU run."""

from __future__ import annotations

import os

DEVICE = os.environ.get("KVMESH_TEST_DEVICE", "cpu")
