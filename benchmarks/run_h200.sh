#!/usr/bin/env bash
# All GPU work of one step, on the device machine, from the checkout (no pip there):
#   bash benchmarks/run_h200.sh tests|latency-1b|latency-8b|offline|nano|fused|profile-graph|profile-host|...
# Logs and JSON land in $OUT (copied back and committed under benchmarks/results/).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/plait-out}
mkdir -p "$OUT"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) python -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25 ;;
    latency-1b) python -m plait bench latency --shape llama-3.2-1b --out "$OUT" 2>&1 | tail -40 ;;
    latency-8b) python -m plait bench latency --shape llama-3.1-8b --prefill --out "$OUT" 2>&1 | tail -40 ;;
    offline) python -m plait bench offline --workload offline-throughput --peer --overlap-check --out "$OUT" 2>&1 | tail -40 ;;
    profile-throughput) python benchmarks/profile_throughput.py "$OUT" 2>&1 | tail -25 ;;
    profile) python benchmarks/profile_step.py "$OUT" 2>&1 | tail -25 ;;
    latency-1b-fast) python -m plait bench latency --shape llama-3.2-1b --no-compile-peer --out "$OUT" 2>&1 | tail -5 ;;
    latency-8b-fast) python -m plait bench latency --shape llama-3.1-8b --no-compile-peer --prefill --out "$OUT" 2>&1 | tail -8 ;;
    fused) python benchmarks/fused_layers_bench.py "$OUT" 2>&1 | tail -40 ;;
    profile-graph) python benchmarks/profile_graph_step.py "$OUT" 2>&1 | tail -60 ;;
    profile-host) python benchmarks/profile_host.py "$OUT" 2>&1 | tail -120 ;;
    nano) python -m plait bench offline --workload nano-vllm --out "$OUT" 2>&1 | tail -40 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
