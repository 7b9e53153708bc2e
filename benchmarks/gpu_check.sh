#!/usr/bin/env bash
# Build the patched server with CUDA and park real conversations on a GPU.
#
#   benchmarks/gpu_check.sh SRC_TARBALL OUT_DIR
#
# For a machine with an NVIDIA GPU but no network: SRC_TARBALL is the pinned llama.cpp tree
# (vendor/llama.cpp of the pinned sdist, packed by `benchmarks/gpu_bundle.sh`); the patch
# series is applied by build_llama.sh as usual (--src). The server preemption tests then run
# against the CUDA binary with every layer offloaded (-ngl 99), and the park/restore
# throughput benchmark measures the device<->host copies. Logs land in OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
tarball=${1:?usage: gpu_check.sh SRC_TARBALL OUT_DIR}
out=${2:?usage: gpu_check.sh SRC_TARBALL OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 LLAMA_SIDECAR_CACHE=${LLAMA_SIDECAR_CACHE:-/tmp/llama-sidecar-cache}
# Everything ends by BUDGET_S seconds after the start, the build's time included.
deadline=$(( $(date +%s) + ${BUDGET_S:-540} ))
left() { echo $(( deadline - $(date +%s) - ${1:-0} )); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
src=/tmp/llama-src
rm -rf "$src" && mkdir -p "$src" && tar -C "$src" -xzf "$tarball"

t0=$(date +%s)
bin=$(CUDA_ARCH=${CUDA_ARCH:-90} JOBS=${JOBS:-$(nproc)} \
      LLAMA_CMAKE_ARGS="-DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF" \
      ./build_llama.sh --cuda --src "$src" 2> "$out/build.log") || { tail -40 "$out/build.log"; exit 1; }
echo "cuda build: $(( $(date +%s) - t0 )) s -> $bin" | tee -a "$out/gpu.txt"

# The preemption and notice suites on the GPU build (the stock comparisons need a stock build: skipped here).
LLAMA_SERVER_BIN=$bin LLAMA_SERVER_EXTRA_ARGS="-ngl 99" \
    timeout "$(left 100)" python3 -m pytest -p no:cacheprovider -o addopts="" -q -rA \
    -m "not stock" ${PYTEST_K:+-k "$PYTEST_K"} tests/server/test_preempt_*.py 2>&1 | tee "$out/pytest.log" | tail -15

# Park/restore throughput with the KV cache in GPU memory.
if [ -f benchmarks/preempt_bench.py ]; then
    LLAMA_SERVER_BIN=$bin LLAMA_SERVER_EXTRA_ARGS="-ngl 99" timeout "$(left 5)" \
        python3 -m benchmarks.preempt_bench --only swap --json "$out/swap.json" 2>&1 | tee "$out/swap.log" | tail -15
fi
