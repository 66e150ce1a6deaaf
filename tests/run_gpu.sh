#!/usr/bin/env bash
# The checks that need a CUDA GPU (CI has none): the torch engine's tests on the GPU
# (KVMESH_TEST_DEVICE=cuda, tests/devices.py): greedy output against transformers' generate()
# run on the same GPU, the engine conformance suite, LoRA, speculative decoding, guided decoding,
# KV tiers, images, embeddings, workers over gRPC, and disaggregation where NIXL reads the
# prefill engine's KV cache out of GPU memory ("VRAM"); then the torch engine's throughput and
# the NIXL transfer benchmark on the GPU.
# Usage: bash tests/run_gpu.sh [pytest args]
#   $PYTHON (default python3) must import kvmesh, torch with CUDA and, for the disaggregation
#   tests, nixl (pip install -e '.[dev]' with a CUDA torch on a GPU machine).
#   $KVMESH_GPU_OUT (default /tmp/kvmesh-gpu): where the benchmark JSON goes.
#   $KVMESH_GPU_STEPS (default "tests bench"): which of the two parts run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${KVMESH_GPU_OUT:-/tmp/kvmesh-gpu}
mkdir -p "$OUT"
step() { printf '\n== %s\n' "$*"; }
STEPS=${KVMESH_GPU_STEPS:-tests bench}
rc=0

step "device"
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())' || exit 1
"$PY" -c 'import nixl, nixl._api as a; print("nixl", a.__file__)' || echo "nixl: not importable (the disaggregation tests will skip)"

if [[ " $STEPS " == *" tests "* ]]; then
step "torch engine tests on cuda"
# -W default: the suite makes warnings errors for the CI environment's pinned versions; a GPU
# machine may bring other torch and transformers releases, whose deprecation notices are shown,
# not failures.
KVMESH_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -W default --durations=10 \
  -o timeout=300 \
  tests/unit/test_torch_engine.py tests/unit/test_torch_sampler.py tests/unit/test_torch_lora.py \
  tests/unit/test_torch_speculative.py tests/unit/test_torch_guided.py \
  tests/unit/test_torch_tiers.py tests/unit/test_torch_llava.py tests/unit/test_disagg_torch.py \
  tests/unit/test_disagg_llava.py tests/conformance/test_engine_conformance.py \
  tests/integration/test_torch_worker.py tests/integration/test_disagg_torch.py \
  tests/integration/test_torch_embeddings.py \
  "$@" || rc=1
fi

[[ " $STEPS " == *" bench "* ]] || exit $rc

step "torch engine on cuda: prefix caching, throughput against transformers' generate(), profile"
"$PY" tests/benchmarks/bench_torch_engine.py --model tiny --device cuda --dtype float32 \
  --prefix 1024 --prompt 128 --new 128 || rc=1
"$PY" tests/benchmarks/bench_torch_engine.py --model large --device cuda --dtype bfloat16 \
  --prefix 1024 --prompt 128 --new 128 --profile 16 || rc=1

step "NIXL transfer on cuda (GPU memory to GPU memory, another process)"
for poll in 1 0; do
  echo "-- read side's progress every $poll ms"
  "$PY" tests/benchmarks/bench_kv_transfer.py --device cuda --blocks 1 10 100 1000 \
    --block-sizes 16 64 --repeat 3 --holder-poll-ms $poll --json "$OUT/kv_transfer_cuda_$poll.json" \
    2>&1 | grep -v ' NIXL INFO ' || rc=1
done
exit $rc
