#!/usr/bin/env bash
# Pack what benchmarks/gpu_check.sh needs on a machine without network into .device/:
# the pinned llama.cpp tree (without models, docs and tests: about 10 MB) and the tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
source server_patch/upstream.env
cache=${LLAMA_SIDECAR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-sidecar}
src="$cache/src/llama.cpp-${SDIST_SHA256:0:16}"
[ -f "$src/.extracted" ] || ./build_llama.sh --stock >/dev/null
mkdir -p .device/cache/models
tar -C "$src" -czf .device/llama-src.tar.gz --exclude=./models --exclude=./docs \
    --exclude=./tests --exclude=./benches --exclude=./examples --exclude=./media \
    --exclude=./gguf-py --exclude=./conversion --exclude=./.github --exclude=./.extracted .
.venv/bin/python -m tests.support.tinymodel tiny >/dev/null
cp "$cache"/models/llama-sidecar-tiny-*.gguf .device/cache/models/
du -sh .device
