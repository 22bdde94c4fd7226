#!/usr/bin/env bash
# Side-by-side benchmark on one GPU with the real π0.5 dimensions (random weights), bf16.
#
# Runs the libero N × k sweep for N ∈ {10, 30} (every k dividing N) with action-only, isolated,
# shared, oxygen and oxygen-adaptive, then the peak-memory probes (a fresh process per system,
# torch.cuda.max_memory_allocated), and prints the same summary table as `oxygen-ros bench`.
# The two-process 'parallel' baseline is left out: each worker would receive a pickled copy of
# the 3.3B weights, which alone costs minutes. Budget: < 8 minutes on one H100/H200-class GPU
# (most of it is building random 3.3B-parameter models: once here, once per memory probe).
#
# Needs a python with CUDA torch, numpy, pillow, safetensors, sentencepiece, tqdm, matplotlib
# (requirements.txt); nothing is downloaded.
#
# Usage: scripts/gpu_bench.sh [extra `oxygen-ros bench` options]
#   PYTHON=/path/to/python  interpreter with CUDA torch (default: first of .venv/bin/python,
#                           python3 that sees a GPU)
#   OUT=dir                 output folder (default bench-results/gpu)
#   BENCH_TIMEOUT=seconds   hard limit (default 470)
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
    local candidate
    for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" > /dev/null 2>&1 || continue
        if "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
            2> /dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "gpu_bench.sh: no python with CUDA torch found (set PYTHON=...)" >&2
    return 1
}

PY=$(pick_python)
"$PY" -c 'import numpy, PIL, safetensors, sentencepiece, tqdm, matplotlib' || {
    echo "gpu_bench.sh: $PY lacks a dependency (see above)" >&2; exit 1; }
OUT=${OUT:-bench-results/gpu}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true

start=$(date +%s)
timeout "${BENCH_TIMEOUT:-470}" "$PY" -m oxygen_ros.cli bench \
    --preset pi05 --device cuda --dtype bfloat16 --threads 4 \
    --workloads libero --parts nk memory --ns 10 30 --frames 10 --memory-frames 3 \
    --systems action-only isolated shared oxygen oxygen-adaptive --parallel none \
    --out "$OUT" --no-progress "$@"
echo "gpu_bench.sh: done in $(( $(date +%s) - start )) s; results in $OUT/"
