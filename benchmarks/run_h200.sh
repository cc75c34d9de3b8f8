#!/usr/bin/env bash
# All GPU work of one step, on the device machine, from the checkout (no pip there):
#   bash benchmarks/run_h200.sh tests|latency-1b|latency-8b|offline|nano|fused|fp8-tests|fp8|moe-kernel|profile-moe|profile-graph|profile-host|profile-spec|
#                               backends-tests|backends|spec-tests|spec|spec-ngram-full|moe|x2|x2-profile|x2-moe-ep|x2-features|x2-moe-correctness|x2-spec|x2-tbo|x2-moe (x2*: on nvidia-h200-x2)|...
# moe: decode-bs1 and offline-throughput for qwen3-30b-a3b and gpt-oss-20b (random weights of the real
# shapes) against transformers generate / generate_batch in the same run; generate_batch runs the first
# 16 of the 256 offline requests (same lengths; the JSON's peer_requests / peer_note say so).
# moe-fp8: block-FP8 experts: their GPU tests, the FP8 fused MoE layer (bs 1..256) and decode-bs1 with
# --quantization fp8 for qwen3-30b-a3b.
# profile-moe: the bs-1 MoE decode step's kernels per layer and the MoE layer alone at M = 1..8.
# moe-tune-small: tune the small-batch MoE path and its per-bucket path choice into $OUT/moe-configs
# (PLAIT_MOE_CONFIG_DIR for the stages after it), then moe-latency.
# backends (about 3-4 min): extend kernels per attention backend/kernel path, then prefill MFU (8b, 8 x 2048)
# and offline-throughput (1b) for triton, torch_flash and the hybrid pair (prefill torch_flash, decode
# triton); no transformers peer in these runs. backends-tests: the torch_flash GPU tests alone.
# gemv-tests / gemv / gemv-bf16-ab: the small-M GEMV's GPU tests; its tuning, then gemm and FP8 decode-bs1 on
# the fresh configs; bf16 decode-bs1 8b with cuBLAS and with the GEMV (docs/quantization.md#small-m-gemv).
# piecewise-ab: --enable-piecewise-cuda-graph off and on: piecewise-tests (GPU test), piecewise-offline (nano-vllm,
# offline-throughput 1b), piecewise-ttft (prefill-ttft 1b and 8b).
# fp8-mma: the FP8 GEMV's W8A8 form: GPU tests, tuning, weight-only vs W8A8 per shape, decode-bs1 A/B.
# Logs and JSON land in $OUT (copied back and committed under benchmarks/results/).
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/plait-out}
mkdir -p "$OUT"
OFFLINE_SET="offline-throughput:llama-3.2-1b offline-throughput:llama-3.1-8b nano-vllm:qwen3-0.6b"

# env_ab VAR "VALUES" NAME "WORKLOAD:SHAPE ...": each offline workload under VAR=value for each value,
# back to back, results in $OUT/NAME-value.
env_ab() {
  local var=$1 values=$2 name=$3 workload value
  for workload in $4; do
    for value in $values; do
      env "$var=$value" python -m plait bench offline --workload "${workload%%:*}" --shape "${workload#*:}" \
        --out "$OUT/$name-$value" 2>&1 | grep -E '^\{"workload|Error'
    done
  done
}

# spec_env_ab NAME: spec-ngram-repeat (8b, 16 x 64) through each_env, rounds 1..SPEC_AB_ROUNDS.
spec_env_ab() {
  each_env 1 "${SPEC_AB_ROUNDS:-1}" "$1" python -m plait bench spec --workload spec-ngram-repeat \
    --shape llama-3.1-8b --num-prompts 16 --output-len 64
}

# each_env FIRST LAST NAME COMMAND...: COMMAND once per comma-separated AB_ENVS entry (VAR=value words), the
# entries alternated for rounds FIRST..LAST (round 0: the first entry only, a run that fills the Triton cache),
# each with --out $OUT/NAME-r<round>-<entry index> appended; prints the result lines.
each_env() {
  local first=$1 last=$2 name=$3 r i settings
  shift 3
  IFS=, read -ra settings <<< "${AB_ENVS:?AB_ENVS: comma-separated VAR=value lists}"
  for r in $(seq "$first" "$last"); do
    for i in "${!settings[@]}"; do
      [[ $r == 0 && $i != 0 ]] && continue
      echo "--- $name r$r ${settings[$i]}"
      # shellcheck disable=SC2086  # an entry is several VAR=value words
      env ${settings[$i]} "$@" --out "$OUT/$name-r$r-$i" 2>&1 | grep -E '^\{"workload|Error' | cut -c1-400
    done
  done
}

for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests) python -m pytest -q -m gpu tests/gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -25 ;;
    # The GPU suite with piecewise CUDA graphs on in every engine whose options allow them
    # (PLAIT_PIECEWISE_CUDA_GRAPH): whether they can be on by default.
    tests-piecewise) PLAIT_PIECEWISE_CUDA_GRAPH=1 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu-tests-piecewise.log" | tail -25 ;;
    latency-1b) python -m plait bench latency --shape llama-3.2-1b --out "$OUT" 2>&1 | tail -40 ;;
    latency-8b) python -m plait bench latency --shape llama-3.1-8b --prefill --out "$OUT" 2>&1 | tail -40 ;;
    offline) python -m plait bench offline --workload offline-throughput --peer --overlap-check --out "$OUT" 2>&1 | tail -40 ;;
    offline-nopeer)  # offline-throughput 1b and 8b, plait alone (the peers' ratios are in earlier runs)
      for shape in llama-3.2-1b llama-3.1-8b; do
        python -m plait bench offline --workload offline-throughput --shape $shape --out "$OUT" 2>&1 \
          | grep -E '^\{"workload|Error'
      done ;;
    agreement) python -m plait bench agreement --out "$OUT" 2>&1 | grep -E '^agreement|^\{"workload|Error' ;;
    warm-start) python -m plait bench warm-start --out "$OUT" 2>&1 | grep -E '^warm-start|^\{"workload|Error' ;;
    feature-tests) python -m pytest -q -m gpu tests/gpu/test_structured_gpu.py tests/gpu/test_fp8_gpu.py \
        tests/gpu/test_gguf_gpu.py tests/gpu/test_sglang_api_gpu.py tests/gpu/test_fused_moe_gpu.py \
        -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 ;;
    structured) python -m plait bench structured --tokenizer bench-tokenizer --out "$OUT" 2>&1 | tail -4 ;;
    tbo-cost) python -m plait bench offline --workload offline-throughput --shape llama-3.1-8b --tbo-peer \
        --out "$OUT" 2>&1 | tail -2 ;;
    warm-start-cold) python -m plait bench warm-start --ttft-shape llama-3.1-8b --offline-shape llama-3.2-1b \
                       --no-disk-start --out "$OUT" 2>&1 | grep -E '^warm-start|^\{"workload|Error' ;;
    profile-throughput) python benchmarks/profile_throughput.py "$OUT" 2>&1 | tail -25 ;;
    profile) python benchmarks/profile_step.py "$OUT" 2>&1 | tail -25 ;;
    latency-1b-fast) python -m plait bench latency --shape llama-3.2-1b --no-compile-peer --out "$OUT" 2>&1 | tail -5 ;;
    latency-8b-fast) python -m plait bench latency --shape llama-3.1-8b --no-compile-peer --prefill --out "$OUT" 2>&1 | tail -8 ;;
    fused) python benchmarks/fused_layers_bench.py "$OUT" 2>&1 | tail -40 ;;
    fp8-tests) python -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/fp8-tests.log" | tail -15 ;;
    fp8) python -m plait bench quant --workload gemm decode-bs1 offline-throughput --sweep --out "$OUT" 2>&1 \
           | tee "$OUT/fp8-bench.log" | grep -E '^\{"workload|measured|Error' ;;
    profile-moe) python benchmarks/profile_moe_step.py --out "$OUT" 2>&1 | grep -v "^   " | tail -40 ;;
    # The same without programmatic dependent launch: each kernel's own time (under PDL they overlap).
    profile-moe-nopdl) mkdir -p "$OUT/nopdl" && PLAIT_PDL=0 python benchmarks/profile_moe_step.py --out "$OUT/nopdl" 2>&1 \
        | grep -v "^   " | tail -40 ;;
    moe-kernel) python benchmarks/moe_kernel_bench.py --batch-sizes 1,8,32,256,1024,4096 --out-dir "$OUT" 2>&1 | tail -14 ;;
    # The offline workloads with a mixed step's decode rows in the extend kernel (PLAIT_TRITON_MIXED_EXTEND=1,
    # the tree before) and through the decode kernel (0, the default), each pair back to back.
    mixed-ab) env_ab PLAIT_TRITON_MIXED_EXTEND "1 0" mixed-extend "${MIXED_WORKLOADS:-$OFFLINE_SET}" ;;
    # The offline workloads with fresh prompts on the extend kernel (PLAIT_TRITON_PREFILL_FLASH=0) and on
    # PyTorch's fused kernels (1), each pair back to back.
    prefill-flash-ab) env_ab PLAIT_TRITON_PREFILL_FLASH "0 1" prefill-flash "${FLASH_WORKLOADS:-$OFFLINE_SET}" ;;
    # The GPU test files GPU_TESTS names (space-separated paths under tests/gpu), log in $OUT/gpu-tests-some.log.
    gpu-test-files) python -m pytest -q -m gpu ${GPU_TESTS:?GPU_TESTS: test files} -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu-tests-some.log" | tail -6 ;;
    torch-flash-tests) python -m pytest -q -m gpu tests/gpu/test_torch_flash_gpu.py -p no:cacheprovider 2>&1 | tail -4 ;;
    prefill-flash-tests) python -m pytest -q -m gpu tests/gpu/test_triton_kernels_gpu.py -k "fresh or mixed" \
        -p no:cacheprovider 2>&1 | tail -3 ;;
    # One layer's attention over offline-throughput's prefill chunk (16 x 512, no prefix) at the 1b, 8b and
    # qwen3-0.6b heads: the extend kernel, the Triton backend on the fused kernels, torch_flash, raw SDPA.
    attn-prefill-16x512)
      for heads in 32,8,64 32,8,128 16,8,128; do
        python benchmarks/attention_backends_bench.py --heads $heads --batch 16x512 --out-dir "$OUT" 2>&1 | tail -1
      done ;;
    mixed-tests) python -m pytest -q -m gpu tests/gpu/test_triton_kernels_gpu.py -k "mixed" -p no:cacheprovider 2>&1 \
        | tail -3 ;;
    # Extend attention over offline-throughput's prefill chunk (16 prompts of 512 tokens, no prefix) at the
    # 1b (d 64), qwen3-0.6b and 8b (d 128) heads: every launch config.
    # Also at 1024-token prompts and 1024-token chunks over a 1024-token prefix (nano-vllm's prefill).
    attn-extend-short)
      python benchmarks/kernels_bench.py --heads 32,8,64 --sweep-extend 16x512+0,16x1024+0,4x1024+1024 2>&1 | tail -4
      python benchmarks/kernels_bench.py --heads 16,8,128 --sweep-extend 16x512+0,16x1024+0,4x1024+1024 2>&1 | tail -3
      python benchmarks/kernels_bench.py --heads 32,8,128 --sweep-extend 16x512+0,16x1024+0,4x1024+1024 2>&1 | tail -3 ;;
    sync-audit) python benchmarks/sync_audit.py "$OUT" llama-3.2-1b 64 2>&1 | grep -v " INFO " | tail -60 ;;
    # The same at nano-vllm's lengths (qwen3-0.6b, 128 requests finishing at different steps).
    sync-audit-nano) python benchmarks/sync_audit.py "$OUT" qwen3-0.6b 128 nano 2>&1 | grep -v " INFO " | tail -60 ;;
    profile-prefill) python benchmarks/profile_prefill.py "$OUT" 2>&1 | grep -v " INFO " | tail -50 ;;
    profile-graph) python benchmarks/profile_graph_step.py "$OUT" 2>&1 | tail -60 ;;
    # offline-throughput's decode steps: bs 256 at about its context (512-token prompts).
    profile-graph-256) python benchmarks/profile_graph_step.py "$OUT" llama-3.2-1b:256:512 llama-3.1-8b:256:512 2>&1 \
      | grep -v "^   " | tail -4 ;;
    profile-host) python benchmarks/profile_host.py "$OUT" 2>&1 | tail -120 ;;
    profile-spec) python benchmarks/profile_spec.py "$OUT" 2>&1 | grep -v " INFO " | tail -6 ;;
    # The same without programmatic dependent launch: each kernel's own time, so the bs-1 verify step's
    # device time splits into kernels and the host gap shows (under PDL the kernels overlap).
    profile-spec-nopdl) mkdir -p "$OUT/nopdl" && PLAIT_PDL=0 python benchmarks/profile_spec.py "$OUT/nopdl" 2>&1 \
        | grep -v " INFO " | tail -6 ;;
    nano) python -m plait bench offline --workload nano-vllm --out "$OUT" 2>&1 | tail -40 ;;
    gemv-tests) python -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py -k "gemv" -p no:cacheprovider 2>&1 \
                  | tee "$OUT/gemv-tests.log" | tail -8 ;;
    gemv)  # tune the small-M GEMV, then the GEMM rows and FP8 decode-bs1 on the fresh configs
      python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" --budget-s "${GEMV_TUNE_S:-50}" 2>&1 \
        | tee "$OUT/gemv-tune.log" | grep -E 'M= 1:|precompiled|budget|wrote|Error'
      PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python -m plait bench quant --workload gemm decode-bs1 --out "$OUT" \
        2>&1 | tee "$OUT/gemv-bench.log" | grep -E '^\{"workload|measured|Error' ;;
    gemv-fp8)  # re-tune the FP8 per-channel M=1 GEMV at the 8b shapes over the shipped table, then FP8 decode-bs1 on it
      mkdir -p "$OUT/gemv-configs" && cp plait/layers/quantization/configs/gemv_*.json "$OUT/gemv-configs/"
      python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" --shapes llama-3.1-8b --kinds fp8_channel --m 1 \
        --budget-s "${GEMV_TUNE_S:-40}" 2>&1 | tee "$OUT/gemv-fp8-tune.log" | grep -E 'M= 1:|wrote|Error'
      PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python -m plait bench quant --workload decode-bs1 --out "$OUT" \
        2>&1 | grep -E '^\{"workload|Error' ;;
    fp8-mma)  # the FP8 GEMV's W8A8 form (docs/quantization.md#small-m-gemv), about 3 min: the FP8 GPU tests,
      # its kinds tuned at the 8b shapes for M 1 and 16 over the shipped table, weight-only vs W8A8 per shape
      # (marking the cases where W8A8 is faster), then FP8 decode-bs1 8b with the tables' choice (table), W8A8 (1)
      # and weight-only (0), each JSON kept
      python -m pytest -q -m gpu tests/gpu/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/fp8-mma-tests.log" \
        | tail -6
      mkdir -p "$OUT/gemv-configs" && cp -n plait/layers/quantization/configs/gemv_*.json "$OUT/gemv-configs/"
      PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" \
        --shapes llama-3.1-8b --kinds fp8_channel_mma,fp8_block_mma --m 1,16 --budget-s "${GEMV_TUNE_S:-90}" \
        --compare 2>&1 | tee "$OUT/fp8-mma-tune.log" | grep -E 'M= ?[0-9]+:|precompiled|budget|wrote|Error'
      for on in table 1 0; do
        PLAIT_FP8_GEMV_W8A8=${on#table} PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python -m plait bench quant \
          --workload decode-bs1 --out "$OUT/fp8-w8a8-$on" 2>&1 | grep -E '^\{"workload|Error'
      done ;;
    gemv-wide)  # the tensor-core GEMV at 2..16 tokens searched wider (tune_gemv.py --wide: bf16, the 8b shapes, over the
      # shipped table), then spec-ngram (a bs-1 verify is 5 rows) on the shipped table and on the fresh one
      mkdir -p "$OUT/gemv-configs" && cp plait/layers/quantization/configs/gemv_*.json "$OUT/gemv-configs/" 2>/dev/null
      python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" --shapes llama-3.1-8b --kinds bf16 --m 2,4,8,16 --wide \
        --budget-s "${GEMV_TUNE_S:-120}" 2>&1 | tee "$OUT/gemv-wide-tune.log" | grep -E 'M= ?[0-9]+:|precompiled|budget|wrote|Error'
      for table in shipped wide; do
        PLAIT_GEMV_CONFIG_DIR=$([ $table = wide ] && echo "$OUT/gemv-configs") python -m plait bench spec \
          --workload spec-ngram-repeat --shape llama-3.1-8b --num-prompts 16 --output-len 64 \
          --out "$OUT/gemv-wide-$table" 2>&1 | tail -2
      done ;;
    gemv-moe)  # tune the bf16 GEMV at the MoE shapes' attention projections and routers (M 1-8) over the shipped table
      mkdir -p "$OUT/gemv-configs" && cp -n plait/layers/quantization/configs/gemv_*.json "$OUT/gemv-configs/"
      python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" --shapes qwen3-30b-a3b,gpt-oss-20b --kinds bf16 \
        --m 1,2,4,8 --budget-s "${GEMV_TUNE_S:-60}" 2>&1 | tee "$OUT/gemv-moe-tune.log" | grep -E 'M= 1:|wrote|Error' ;;
    pdl-ab)  # programmatic dependent launch (PLAIT_PDL): its GPU test, then decode-bs1 1b and 8b without (0) and with it (1)
      python -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -p no:cacheprovider 2>&1 | tail -3
      for on in 0 1; do
        PLAIT_PDL=$on python -m plait bench latency --shape llama-3.2-1b llama-3.1-8b --no-peer --out "$OUT/pdl-$on" \
          2>&1 | grep -E '^\{"workload|Error'
      done ;;
    fp8-decode)  # FP8 decode-bs1 8b (weight-only GEMV, the shipped configs) against plait bf16 in the same run
      python -m plait bench quant --workload decode-bs1 --out "$OUT" 2>&1 | grep -E '^\{"workload|Error' ;;
    pdl-test) python -m pytest -q -m gpu tests/gpu/test_pdl_gpu.py -p no:cacheprovider 2>&1 | tail -3 ;;
    moe-latency-nopeer) python -m plait bench latency --shape qwen3-30b-a3b gpt-oss-20b --no-peer --out "$OUT" 2>&1 \
                          | grep -E '^\{"workload|Error' ;;
    gemv-bf16-ab)  # bf16 decode-bs1 1b and 8b with cuBLAS (0) and with the GEMV (1), on the configs the gemv stage tuned
      for on in 0 1; do
        PLAIT_BF16_GEMV=$on PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python -m plait bench latency \
          --shape llama-3.2-1b llama-3.1-8b --no-peer --out "$OUT/bf16-gemv-$on" 2>&1 | grep -E '^\{"workload|Error'
      done ;;
    piecewise-ab) OUT=$OUT bash "$0" piecewise-tests piecewise-offline piecewise-ttft ;;
    piecewise-tests) python -m pytest -q -m gpu tests/gpu/test_piecewise_gpu.py -p no:cacheprovider 2>&1 \
        | tee "$OUT/piecewise-tests.log" | tail -5 ;;
    piecewise-offline)  # nano-vllm (qwen3-0.6b) and offline-throughput (1b) with piecewise graphs off (0) and on (1)
      for on in 0 1; do
        flag=$([ $on = 1 ] && echo --enable-piecewise-cuda-graph)
        for workload in nano-vllm offline-throughput; do
          python -m plait bench offline --workload $workload $flag --out "$OUT/piecewise-$on" 2>&1 \
            | grep -E '^\{"workload|Error'
        done
      done ;;
    # The offline workloads' mixed steps (an 8192-token chunk and the running decode rows) under piecewise graphs (the default maximum, 2048,
    # leaves them eager), each beside its eager baseline in the same call.
    piecewise-8k-ab)
      for workload in ${PW_WORKLOADS:-offline-throughput:llama-3.2-1b offline-throughput:llama-3.1-8b nano-vllm:qwen3-0.6b}; do
        for on in 0 1; do
          flag=$([ $on = 1 ] && echo --enable-piecewise-cuda-graph --piecewise-cuda-graph-max-tokens ${PW_MAX:-8448})
          python -m plait bench offline --workload ${workload%%:*} --shape ${workload#*:} $flag \
            --out "$OUT/piecewise8k-$on" 2>&1 | grep -E '^\{"workload|Error'
        done
      done ;;
    piecewise-ttft)  # short prompts' TTFT (16-2048 tokens), piecewise graphs off and on in one run per shape
      python -m plait bench prefill-ttft --shape llama-3.2-1b llama-3.1-8b --out "$OUT/piecewise-ttft" 2>&1 \
        | grep -E '^\{"workload|Error' ;;
    moe) OUT=$OUT bash "$0" moe-latency moe-offline ;;
    # About 2-3 minutes: the small-batch MoE tables of both shapes (the small path's tiles and, per
    # bucket, whether it beats the aligned pipeline) into $OUT/moe-configs, then moe-latency on them.
    # Later stages of the same invocation (profile-moe, moe-offline) read them too (and the GEMV tables
    # of a gemv-moe stage run before it).
    moe-tune-small)
      python benchmarks/tune_fused_moe.py --small-batch --shape qwen3-30b-a3b --shape gpt-oss-20b \
        --out-dir "$OUT/moe-configs" --budget-s "${MOE_TUNE_S:-80}" --report "$OUT/moe-tune-small.json" 2>&1 \
        | tee "$OUT/moe-tune-small.log" | grep -E 'M=|precompiled|budget|Error'
      export PLAIT_MOE_CONFIG_DIR=$OUT/moe-configs
      # The router and projection GEMV tables too, where a gemv-moe stage of this run tuned them.
      if [ -d "$OUT/gemv-configs" ]; then export PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs; fi
      python -m plait bench latency --shape qwen3-30b-a3b gpt-oss-20b ${MOE_PEER:---no-peer} --out "$OUT" 2>&1 | tail -6 ;;
    # The small-batch path's down kernel given its own tiles over the shipped joint ones (M 1, 2, 4 of
    # qwen3-30b-a3b, about 1-2 min), then decode-bs1 on the shipped table and on the new one, back to back.
    moe-tune-down)
      mkdir -p "$OUT/moe-configs"
      python benchmarks/tune_fused_moe.py --small-batch --from-table --down-sweep --shape qwen3-30b-a3b \
        --batch-sizes 1,2,4 --out-dir "$OUT/moe-configs" --budget-s "${MOE_TUNE_S:-90}" \
        --report "$OUT/moe-tune-down.json" 2>&1 | tee "$OUT/moe-tune-down.log" | grep -E 'M=|budget|Error'
      for table in shipped tuned; do
        dir=$([ $table = tuned ] && echo "$OUT/moe-configs")
        PLAIT_MOE_CONFIG_DIR=$dir python -m plait bench latency --shape qwen3-30b-a3b --no-peer --eager-output-len 32 \
          --out "$OUT/moe-down-$table" 2>&1 | grep -E '^\{"workload|Error'
      done ;;
    moe-latency) python -m plait bench latency --shape qwen3-30b-a3b gpt-oss-20b --no-compile-peer --out "$OUT" 2>&1 | tail -6 ;;
    moe-offline)
      for shape in ${MOE_SHAPES:-qwen3-30b-a3b gpt-oss-20b}; do
        python -m plait bench offline --workload offline-throughput --shape $shape --peer --peer-requests 16 \
          --out "$OUT" 2>&1 | tail -3
      done ;;
    moe-tests) python -m pytest -q -m gpu tests/gpu/test_fused_moe_gpu.py tests/gpu/test_qk_norm_gpu.py -p no:cacheprovider \
                 2>&1 | tee "$OUT/moe-tests.log" | tail -8 ;;
    # Block-FP8 experts (qwen3-30b-a3b shape): the GPU tests, decode-bs1 with --quantization fp8 (experts
    # quantized at load to 128x128 blocks; floor from the FP8 bytes + scales), the FP8 fused MoE layer
    # at bs 1..256 (about 3 min in all).
    moe-fp8) python -m pytest -q -m gpu tests/gpu/test_fused_moe_fp8_gpu.py -p no:cacheprovider 2>&1 \
               | tee "$OUT/moe-fp8-tests.log" | tail -8
      python benchmarks/moe_kernel_bench.py --fp8 --shape qwen3-30b-a3b --batch-sizes 1,8,32,256 --out-dir "$OUT" 2>&1 \
        | tail -6
      python -m plait bench latency --shape qwen3-30b-a3b --quantization fp8 --no-peer --output-len 128 \
        --out "$OUT" 2>&1 | tail -6 ;;
    backends-tests) python -m pytest -q -m gpu tests/gpu/test_torch_flash_gpu.py -p no:cacheprovider 2>&1 \
                      | tee "$OUT/gpu-tests-torch-flash.log" | tail -25 ;;
    backends)
      python benchmarks/attention_backends_bench.py --out-dir "$OUT" 2>&1 | grep '^#' | tail -8
      for pair in "--attention-backend triton" "--attention-backend torch_flash" \
                  "--prefill-attention-backend torch_flash --decode-attention-backend triton"; do
        echo "--- $pair"
        # shellcheck disable=SC2086  # $pair is several flags
        python -m plait bench latency --shape llama-3.1-8b --prefill --prefill-only $pair --out "$OUT" 2>&1 | tail -2
        # shellcheck disable=SC2086
        python -m plait bench offline --workload offline-throughput $pair --out "$OUT" 2>&1 | tail -2
      done ;;
    # spec-ngram-repeat (8b, 16 x 64) from the carried .ab/prev (`git archive <commit> plait | tar -x -C
    # .ab/prev`; "prevstage": with PLAIT_SPEC_STAGE_NEXT=1, for a tree from before it was on), from this
    # tree as shipped ("head"), with verifies launched ahead ("ahead", PLAIT_SPEC_LAUNCH_AHEAD=1) and
    # without the next verify staged for its guessed outcome ("nostage", PLAIT_SPEC_STAGE_NEXT=0), in turn
    # for SPEC_AB_ROUNDS rounds (default 1): speculative changes against the tree before them. SPEC_AB_RUNS
    # picks the runs (default "prev head ahead").
    spec-tree-ab)
      for r in $(seq 1 "${SPEC_AB_ROUNDS:-1}"); do
        for run in ${SPEC_AB_RUNS:-prev head ahead}; do
          tree=$(case $run in prev*) echo "$PWD/.ab/prev" ;; *) echo "$PWD" ;; esac)
          case $run in ahead) lever=PLAIT_SPEC_LAUNCH_AHEAD=1 ;; nostage) lever=PLAIT_SPEC_STAGE_NEXT=0 ;;
            prevstage) lever=PLAIT_SPEC_STAGE_NEXT=1 ;; *) lever=PLAIT_UNSET=1 ;; esac
          # A run named twice in a round ("head prev head") gets a directory of its own each time.
          dir=$OUT/spec-ab-r$r-$run; n=2
          while [[ -e $dir ]]; do dir=$OUT/spec-ab-r$r-$run-$n; n=$((n + 1)); done
          env "$lever" PYTHONPATH="$tree" python -m plait bench spec \
            --workload spec-ngram-repeat --shape llama-3.1-8b --num-prompts 16 --output-len 64 \
            --out "$dir" 2>&1 | tail -2 | cut -c1-400
        done
      done ;;
    # A graph launched onto an idle GPU against one queued behind work (benchmarks/graph_launch.py): the
    # synthetic chain, then the 8b decode and verify graphs with the verify graph in one piece and segmented.
    graph-launch)
      for seg in 0 1; do
        PLAIT_SEGMENTED_VERIFY_GRAPHS=$seg python benchmarks/graph_launch.py --shape llama-3.1-8b \
          $([ $seg = 1 ] && echo --skip-synthetic) 2>&1 | grep -v " INFO " | tee "$OUT/graph-launch-seg$seg.log" | tail -5
      done ;;
    # spec-ngram-repeat (8b, 16 x 64) with the verify graphs in one piece and segmented (AB_ENVS' default), alternated
    # for SPEC_AB_ROUNDS rounds; results under $OUT/spec-segment-ab-r<round>-<i>/.
    spec-segment-ab)
      AB_ENVS=${AB_ENVS:-PLAIT_SEGMENTED_VERIFY_GRAPHS=0,PLAIT_SEGMENTED_VERIFY_GRAPHS=1} spec_env_ab spec-segment-ab ;;
    # spec-ngram-repeat (8b, 16 x 64) once per comma-separated AB_ENVS entry, alternated for SPEC_AB_ROUNDS
    # rounds (default 1); results under $OUT/spec-env-ab-r<round>-<i>/.
    spec-env-ab) spec_env_ab spec-env-ab ;;
    # The host time of a small host-to-device copy while the stream is busy: pinned, pageable, a persistent
    # pinned buffer (benchmarks/h2d_copy.py; PLAIT_PAGEABLE_H2D's premise).
    h2d-copy) python benchmarks/h2d_copy.py | tee "$OUT/h2d-copy.json" ;;
    # The verify graph (width 4) against the decode graph of as many requests, replayed alone: device us per
    # replay and per kernel class (benchmarks/profile_verify_graph.py), at VERIFY_BS (default "1 16").
    profile-verify-graph) for bs in ${VERIFY_BS:-1 16}; do
        python benchmarks/profile_verify_graph.py "$OUT" --bs "$bs" 2>&1 | grep -v " INFO " \
          | tee -a "$OUT/profile-verify-graph.log" | tail -36; done ;;
    # A candidate GEMV table (GEMV_CANDIDATE: a directory holding this device's file; default the H100's
    # swapped-operand tiles at 2-16 tokens over the shipped one-token entries, which on another device holds
    # no file, so both arms run the shipped table there) against the shipped table:
    # the graphs replayed alone as in profile-verify-graph (tags shipped, candidate), then spec-ngram-repeat
    # alternated for SPEC_AB_ROUNDS rounds (spec-gemv-ab-r<round>-<0 shipped|1 candidate>/; the JSON counts
    # the second half's forwards by kind, so a change in plain steps shows apart from the verifies).
    gemv-candidate-ab)
      cand=${GEMV_CANDIDATE:-$PWD/benchmarks/gemv_candidates/h100-swap-2to16}
      for bs in ${VERIFY_BS:-1 16}; do
        for tag in shipped candidate; do
          PLAIT_GEMV_CONFIG_DIR=$([ $tag = candidate ] && echo "$cand") python benchmarks/profile_verify_graph.py \
            "$OUT" --bs "$bs" --tag $tag 2>&1 | grep -v " INFO " | tee -a "$OUT/profile-verify-graph.log" | sed -n 1,9p
        done
      done
      AB_ENVS="PLAIT_GEMV_CONFIG_DIR=,PLAIT_GEMV_CONFIG_DIR=$cand" spec_env_ab spec-gemv-ab ;;
    # spec_host.py at bs 16 under the shipped GEMV table and the candidate (GEMV_CANDIDATE, as above): the
    # verify forwards' device time and the device's idle gaps by kind, with each table.
    spec-host-gemv)
      cand=${GEMV_CANDIDATE:-$PWD/benchmarks/gemv_candidates/h100-swap-2to16}
      for tag in shipped candidate; do
        PLAIT_GEMV_CONFIG_DIR=$([ $tag = candidate ] && echo "$cand") python benchmarks/spec_host.py 16 \
          --shape llama-3.1-8b 2>&1 | grep -v " INFO " | tee "$OUT/spec-host-bs16-$tag.log" | tail -22
      done ;;
    # Host work right after a blocking wait for the GPU, a polled wait, an idle sleep, against back to back
    # (benchmarks/host_after_wait.py).
    host-after-wait) python benchmarks/host_after_wait.py | tee "$OUT/host-after-wait.json" ;;
    # The small-M GEMV (the config in force) against cuBLAS at 1-16 tokens, 8b projections and lm_head.
    # A bf16 GEMM's first call at a new row count against the same call again (a burst's steps meet new ones).
    gemm-new-rows) python benchmarks/gemm_new_rows.py "$OUT" 2>&1 | tail -4 ;;
    gemv-cublas) python benchmarks/gemv_cublas.py "$OUT" 2>&1 | tee "$OUT/gemv-cublas.log" | tail -30 ;;
    # The bf16 GEMV re-tuned past one token (swapped-operand tiles among the candidates, cuBLAS timed beside
    # them: prefer_cublas) into $OUT/gemv-configs over a copy of the shipped table, those kernels against
    # cuBLAS, then spec-ngram-repeat on the shipped table against the fresh one (SPEC_AB_ROUNDS rounds;
    # results spec-gemv-ab-r<round>-<i>/, i = 0 shipped, 1 fresh).
    gemv-retune-ab)
      mkdir -p "$OUT/gemv-configs"
      cp plait/layers/quantization/configs/gemv_*.json "$OUT/gemv-configs/" 2>/dev/null
      python benchmarks/tune_gemv.py --out "$OUT/gemv-configs" --kinds bf16 --m 2,4,8,16 --budget-s "${TUNE_S:-90}" \
        2>&1 | tee "$OUT/gemv-retune.log" | tail -25
      PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python benchmarks/gemv_cublas.py "$OUT/gemv-configs" 2>&1 \
        | tee "$OUT/gemv-cublas-retuned.log" | tail -25
      AB_ENVS="PLAIT_GEMV_CONFIG_DIR=,PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs" spec_env_ab spec-gemv-ab ;;
    # Speculative graphs (verify replay vs eager logits, engines through both graph kinds).
    spec-tests) python -m pytest -q -m gpu tests/gpu/test_spec_graphs_gpu.py -x -p no:cacheprovider \
        ${SPEC_TESTS_K:+-k "$SPEC_TESTS_K"} 2>&1 \
        | tee "$OUT/gpu-spec-tests.log" | tail -15 ;;
    # spec-overhead (graph-replayed verify at bs 1/16/64 + EAGLE3 draft steps), then the n-gram pair
    # shortened (16 prompts, 64 tokens) to stay within ~4 minutes of GPU time.
    spec)
      python -m plait bench spec --workload spec-overhead --shape llama-3.1-8b --out "$OUT" 2>&1 | tail -5
      for w in spec-ngram-repeat spec-ngram-miss; do
        python -m plait bench spec --workload $w --shape llama-3.1-8b --num-prompts 16 --output-len 64 \
          --out "$OUT" 2>&1 | tail -5
      done ;;
    # bs-1 decode attention at short contexts: split heuristics x stage-1 configs (graph us per layer).
    # Decode attention with several KV heads per program (kv_pack) at the 1b (d 64) and qwen3-0.6b (16/8 heads, d 128)
    # shapes, then offline-throughput 1b with each pack forced (PLAIT_DECODE_KV_PACK).
    attn-decode-pack)
      python benchmarks/kernels_bench.py --heads 32,8,64 --sweep-decode 256x640,64x1024,16x512 2>&1 | tail -4
      python benchmarks/kernels_bench.py --heads 16,8,128 --sweep-decode 256x640 2>&1 | tail -2
      python benchmarks/kernels_bench.py --heads 32,8,128 --sweep-decode 256x640 2>&1 | tail -2 ;;
    kvpack-ab)
      for pack in ${KV_PACKS:-1 2 4}; do
        mkdir -p "$OUT/kvpack-$pack"
        PLAIT_DECODE_KV_PACK=$pack python -m plait bench offline --workload offline-throughput --shape llama-3.2-1b \
          --out "$OUT/kvpack-$pack" 2>&1 | grep -E '^\{"workload|Error'
      done ;;
    # Decode attention at head dim 128 over nano-vllm's longer contexts (qwen3-0.6b's 16/8 heads, then the
    # 8b's 32/8): whether the packed 32-token tile's loss end to end on nano-vllm comes from long contexts.
    # Decode attention over the three KV slot layouts of kernels_bench.py (--kv-layout): how much of the
    # gap to the byte floor is the pool's slot scatter (1b heads at offline-throughput's context, nano-vllm's).
    attn-decode-layout)
      for layout in random decode contiguous; do
        echo "# kv layout $layout"
        python benchmarks/kernels_bench.py --kv-layout $layout --heads 32,8,64 --sweep-decode 256x640 2>&1 | tail -1
        python benchmarks/kernels_bench.py --kv-layout $layout --heads 16,8,128 --sweep-decode 256x1024 2>&1 | tail -1
      done ;;
    attn-decode-d128)
      python benchmarks/kernels_bench.py --heads 16,8,128 --sweep-decode 256x1024,128x1536,64x2048 2>&1 | tail -3
      python benchmarks/kernels_bench.py --heads 32,8,128 --sweep-decode 256x1024,128x1536 2>&1 | tail -2 ;;
    kvpack-tests) python -m pytest -q -m gpu tests/gpu/test_triton_kernels_gpu.py -k "pack" -p no:cacheprovider 2>&1 \
        | tee "$OUT/kvpack-tests.log" | tail -4 ;;
    # The n-gram pair (shortened as in `spec`) with chained verifies off (0) and on (1).
    spec-chain-ab)
      for on in 0 1; do
        for w in ${SPEC_CHAIN_WORKLOADS:-spec-ngram-repeat spec-ngram-miss}; do
          PLAIT_SPEC_CHAIN_VERIFIES=$on python -m plait bench spec --workload $w --shape llama-3.1-8b --num-prompts 16 \
            --output-len 64 --out "$OUT/spec-chain-$on" 2>&1 | grep -E '^\{"workload|Error'
        done
      done ;;
    # offline-throughput 8b, nano-vllm (qwen3-0.6b) and offline-throughput 1b with decode attention's kv_pack
    # forced to 1 (the tiles before packing) and at its default, each pair back to back.
    kvpack-offline-ab) env_ab PLAIT_DECODE_KV_PACK "1 0" kvpack-off \
        "offline-throughput:llama-3.1-8b nano-vllm:qwen3-0.6b offline-throughput:llama-3.2-1b" ;;
    # nano-vllm with decode attention at its default tiles (0: one KV head per program at qwen3-0.6b's groups
    # of 2) and with two KV heads per program in 32-token tiles (2), two rounds of the pair back to back.
    kvpack-nano-ab)
      for round in 1 2; do env_ab PLAIT_DECODE_KV_PACK "0 2" "kvpack-nano-r$round" nano-vllm:qwen3-0.6b; done ;;
    # Decode attention over ragged contexts (uniform in [100, 1900], nano-vllm's spread) at qwen3-0.6b's heads:
    # the split planner's programs per SM (pps) x tiles, at bs 256 and 128.
    attn-decode-ragged)
      python benchmarks/kernels_bench.py --heads 16,8,128 --ragged 100 --sweep-decode 256x1000,128x1000 2>&1 | tail -2 ;;
    # nano-vllm at split-planner targets (PLAIT_DECODE_PROGRAMS_PER_SM) and KV packs (PLAIT_DECODE_KV_PACK, 0:
    # the default), "pps:pack" each, in two rounds; results in $OUT/pps-<round>-<pps>-<pack>.
    pps-nano-ab)
      for round in 1 2; do
        for pair in ${PPS_PAIRS:-4:0 8:0 16:0 16:2}; do
          PLAIT_DECODE_PROGRAMS_PER_SM=${pair%%:*} PLAIT_DECODE_KV_PACK=${pair#*:} python -m plait bench offline \
            --workload nano-vllm --shape qwen3-0.6b --out "$OUT/pps-$round-${pair%%:*}-${pair#*:}" 2>&1 \
            | grep -E '^\{"workload|Error'
        done
      done ;;
    # The GPU tests of the long-extend tiles and of the speculative graphs (chained verifies by default).
    tests-extend-spec) python -m pytest -q -m gpu tests/gpu/test_triton_kernels_gpu.py -k extend \
        tests/gpu/test_spec_graphs_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-extend-spec.log" | tail -4 ;;
    # The NGRAM verify loop's host stages and the device's idle gaps inside chains and across scheduler
    # steps (llama-3.1-8b, dummy weights, spec-ngram-repeat's pattern), bs 1 then bs 16.
    spec-host) for bs in 1 16; do python benchmarks/spec_host.py $bs --shape llama-3.1-8b --rounds 2 2>&1 \
        | grep -v " INFO " | tee "$OUT/spec-host-bs$bs.log" | tail -22; done ;;
    # The same at bs 1 as shipped and without the next verify staged for its guessed outcome
    # (PLAIT_SPEC_STAGE_NEXT=0): the device's idle gaps inside chains with each.
    spec-host-levers) for lever in PLAIT_UNSET=1 PLAIT_SPEC_STAGE_NEXT=0; do
        env "$lever" python benchmarks/spec_host.py 1 --shape llama-3.1-8b 2>&1 | grep -v " INFO " \
          | tee "$OUT/spec-host-bs1-${lever%=*}.log" | tail -22; done ;;
    # The same at bs 16 with a cProfile of the timed host stages (the forward excluded): which calls
    # make the critical path between a verify's result and the next launch.
    spec-host-profile) python benchmarks/spec_host.py 16 --shape llama-3.1-8b --rounds 3 --profile 2>&1 \
        | grep -v " INFO " | tee "$OUT/spec-host-bs16-profile.log" | tail -60 ;;
    # Kernel variants that compiled on the request path: the split planner's one-variant test, then the
    # nano-vllm audit with each variant's specialisations.
    variant-tests) python -m pytest -q -m gpu tests/gpu/test_triton_kernels_gpu.py -k "split_planner or mixed or extend or decode" \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-variants.log" | tail -4 ;;
    # Temperature-only draws in one Triton pass (PLAIT_FUSED_GUMBEL_MAX): the GPU test, then nano-vllm (temperature
    # 0.6) with the separate passes (0) and the one-pass draw (1), two rounds of the pair back to back.
    gumbel-tests) python -m pytest -q -m gpu tests/gpu/test_triton_ops_gpu.py -k "gumbel or argmax" -p no:cacheprovider \
        2>&1 | tail -3 ;;
    gumbel-ab) for round in 1 2; do env_ab PLAIT_FUSED_GUMBEL_MAX "0 1" "gumbel-r$round" nano-vllm:qwen3-0.6b; done ;;
    # The extend kernel's launch configs at head dim 128 alone (qwen3-0.6b's and the 8b's heads).
    attn-extend-d128)
      python benchmarks/kernels_bench.py --heads 16,8,128 --sweep-extend 16x512+0,16x1024+0,4x1024+1024 2>&1 | tail -3
      python benchmarks/kernels_bench.py --heads 32,8,128 --sweep-extend 16x512+0,16x1024+0,4x1024+1024 2>&1 | tail -3 ;;
    attn-decode-short) python benchmarks/kernels_bench.py --sweep-decode 1x128,1x256,1x384,1x1024,16x384 2>&1 | tail -6 ;;
    serving-burst) BUDGET_S=${BURST_S:-280} OUT=$OUT bash benchmarks/serving_burst.sh 2>&1 | tail -12 ;;
    # The burst (1b, 256 x 512/128) with clients that do not stream (one JSON answer each), twice: the first
    # run fills the Triton cache.
    serving-burst-nostream)
      for run in warmup r1; do
        python -m plait bench serve --workload serving-burst --shape llama-3.2-1b --num-prompts 256 --input-len 512 \
          --output-len 128 --client-procs 4 --no-stream --out "$OUT/nostream-$run" 2>&1 | grep -E '^\{"workload|Error' \
          | cut -c1-300
      done ;;
    # The warm burst (1b, 256 x 512/128) served and loaded from another tree (.ab/base: carry it, made with
    # `git archive <commit> plait | tar -x -C .ab/base`) and from this one, alternated after a run of each that
    # fills the Triton cache: a regression of the serving path between two commits, found in one call (no
    # offline peer: the server's output tok/s and loop times compare between runs).
    serving-burst-tree-ab)  # TREE_AB_ROUNDS measured rounds (default 2) after the warm-ups
      for run in warmup-base warmup-head $(for r in $(seq 1 "${TREE_AB_ROUNDS:-2}"); do echo "r$r-base r$r-head"; done); do
        tree=$([ "${run##*-}" = base ] && echo "$PWD/.ab/base" || echo "$PWD")
        PYTHONPATH=$tree python -m plait bench serve --workload serving-burst --shape llama-3.2-1b --num-prompts 256 \
          --input-len 512 --output-len 128 --client-procs 4 --no-peer --out "$OUT/tree-ab-$run" 2>&1 \
          | grep -E '^\{"workload|Error' | cut -c1-300
      done ;;
    # ab_compare.py's workloads (AB_WORKLOADS, default offline-throughput-1b) from the carried tree AB_TREE (default
    # .ab/base) as A and from HEAD as B, AB_ROUNDS alternated rounds (default 3).
    tree-ab) python benchmarks/ab_compare.py "$OUT/tree-ab" "${AB_TREE:-.ab/base}" "$PWD" --rounds "${AB_ROUNDS:-3}" \
               --workloads ${AB_WORKLOADS:-offline-throughput-1b} 2>&1 | grep -E 'round|median|Error|^(offline|nano|decode)' | tail -12 ;;
    # nano-vllm (qwen3-0.6b) from the carried .ab/base (A) and from HEAD (B), alternated in one call, fresh
    # prompts each round: whether a code change slowed its prefill steps or the machine did ($OUT/tree-ab).
    nano-tree-ab) AB_WORKLOADS=nano-vllm-0.6b OUT=$OUT bash "$0" tree-ab ;;
    # The burst (1b, 256 x 512/128) with the scheduler detokenizing every request (0) and the HTTP process
    # detokenizing those without stop strings (1, the default), alternated after one run that fills the
    # Triton cache; each run's JSON under $OUT/frontend-detok-<round>-<value>/. No offline peer: the A/B
    # compares the server's output tok/s and loop times between runs of one call.
    # The warm burst (1b, 256 x 512/128) with 1, 2 and 4 HTTP processes (--tokenizer-worker-num), after a run
    # that fills the Triton cache, no offline peer (the server's tok/s and TTFT compare between runs).
    serving-burst-workers-ab)
      for run in warmup-1 r1-1 r1-2 r1-4 r2-4 r2-1; do
        python -m plait bench serve --workload serving-burst --shape llama-3.2-1b --num-prompts 256 --input-len 512 \
          --output-len 128 --client-procs 4 --no-peer --tokenizer-worker-num "${run##*-}" \
          --out "$OUT/http-workers-$run" 2>&1 | grep -E '^\{"workload|Error' | cut -c1-400
      done ;;
    # Whether a started engine's first request (and the server's first step, 80 ms for one 512-token
    # request against 22 ms for an 8192-token chunk) is slow because the device idled or because a
    # kernel is loaded on its first launch: benchmarks/first_request.py (1b) with CUDA's lazy module
    # loading (the default, nvidia-smi clock samples beside) and then with CUDA_MODULE_LOADING=EAGER.
    first-request)
      NVSMI=1 python benchmarks/first_request.py --shape llama-3.2-1b --out "$OUT/first-request-lazy" 2>&1 \
        | grep -v " INFO " | cut -c1-1500 | tail -60
      if [[ ${FIRST_EAGER:-0} == 1 ]]; then
        CUDA_MODULE_LOADING=EAGER python benchmarks/first_request.py --shape llama-3.2-1b \
          --out "$OUT/first-request-eager" 2>&1 | grep -v " INFO " | cut -c1-400 | tail -14
      fi ;;
    # The burst (1b, 256 x 512/128, no peer) with the HTTP processes of TRACE_WORKERS (default "4 1") in turn:
    # when the first request and the last reached the scheduler and its first iterations, on the clients'
    # clock (the result's timeline_ms and scheduler_timeline_ms, from PLAIT_LOOP_TRACE).
    serving-burst-trace)
      for n in ${TRACE_WORKERS:-4 1}; do
        python -m plait bench serve --workload serving-burst --shape llama-3.2-1b --num-prompts 256 --input-len 512 \
          --output-len 128 --client-procs 4 --no-peer --tokenizer-worker-num "$n" --out "$OUT/trace${TRACE_TAG:-}-$n" 2>&1 \
          | grep -E '^\{"workload|Error' | cut -c1-200
        python -c 'import json, glob, sys
d = json.load(open(glob.glob(sys.argv[1] + "/*.json")[0])); st = d["scheduler_timeline_ms"]
print("client ms", {k: round(v) for k, v in d["timeline_ms"].items()})
print("scheduler ms", {k: v if v is None else round(v) for k, v in st.items() if k != "iterations"})
print("first iterations (at, messages, recv / step / updates ms)", [(round(i["at"]), i["messages"], round(i["recv_ms"], 1), round(i["step_ms"], 1), round(i["updates_ms"], 1)) for i in st["iterations"]])' "$OUT/trace${TRACE_TAG:-}-$n"
      done ;;
    # The same trace with every CUDA module loaded at process start (server and client): whether the server's
    # slow first step is kernels loaded on first use.
    serving-burst-trace-eager)
      OUT=$OUT CUDA_MODULE_LOADING=EAGER TRACE_TAG=-eager bash "$0" serving-burst-trace ;;
    # The warm burst (1b, 256 x 512/128) with its offline peer timed right after its untimed pass (0) and
    # after idling 2 s (2), after one run that fills the Triton cache: whether a device that
    # idled, as the server's does through the bench's set-up, starts the burst slower.
    serving-burst-peer-idle)
      for run in warmup-0 r1-0 r1-2; do
        python -m plait bench serve --workload serving-burst --shape llama-3.2-1b --num-prompts 256 --input-len 512 \
          --output-len 128 --client-procs 4 --peer-idle-s "${run##*-}" --out "$OUT/peer-idle-$run" 2>&1 \
          | grep -E '^\{"workload|Error' | cut -c1-400
      done ;;
    serving-burst-detok-ab)
      for run in warmup-1 r1-0 r1-1 r2-0 r2-1; do
        PLAIT_FRONTEND_DETOKENIZE=${run##*-} python -m plait bench serve --workload serving-burst --shape llama-3.2-1b \
          --num-prompts 256 --input-len 512 --output-len 128 --client-procs 4 --no-peer \
          --out "$OUT/frontend-detok-$run" 2>&1 \
          | grep -E '^\{"workload|Error' | cut -c1-400
      done ;;
    # The n-gram pair alone, shortened as in `spec`.
    spec-ngram)
      for w in spec-ngram-repeat spec-ngram-miss; do
        python -m plait bench spec --workload $w --shape llama-3.1-8b --num-prompts 16 --output-len 64 \
          --out "$OUT" 2>&1 | tail -3
      done ;;
    # The n-gram pair as the issue names them (64 prompts x 128 tokens; about 5 minutes of GPU time).
    spec-ngram-full)
      for w in spec-ngram-repeat spec-ngram-miss; do
        python -m plait bench spec --workload $w --shape llama-3.1-8b --out "$OUT" 2>&1 | tail -3
      done ;;
    # nvidia-h200-x2 only (issue 8): TP / DP attention / replicas against one GPU.
    x2) python -m pytest -q -m gpu tests/gpu/test_engine_gpu.py -k "replica or nccl_row or copy_engine" -p no:cacheprovider 2>&1 | tail -3
        for what in correctness decode offline; do
          NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py $what "$OUT" 2>&1 | grep -v " INFO " | tail -8
        done ;;
    # nvidia-h200-x2 only: expert parallelism's all-to-all dispatch (--moe-a2a-backend) on NCCL (its GPU
    # tests), then qwen3-30b-a3b offline-throughput with ep 2 under DP attention, gather path vs all-to-all.
    x2-moe-ep) python -m pytest -q -m gpu tests/gpu/test_moe_a2a_gpu.py -p no:cacheprovider 2>&1 | tail -3
        NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py moe-ep "$OUT" 2>&1 | grep -v " INFO " | tail -8 ;;
    # nvidia-h200-x2: speculation (NGRAM, EAGLE3) at tp 2 and DP attention dp 2, two-batch overlap, and
    # qwen3-30b-a3b at tp 2 and ep 2, against one GPU (benchmarks/multi_gpu_features.py), in stages of a
    # few minutes each (staged_h200.sh puts several in one call): x2-features (their two-GPU tests, then
    # the speculative layouts' teacher-forced logits), x2-moe-correctness (the MoE layouts' logits and
    # routing flips), x2-spec (spec-ngram-repeat at tp 2), x2-tbo (offline-throughput with two-batch
    # overlap on and off at tp 2 and dp 2) and x2-moe (qwen3-30b-a3b offline-throughput at 1 GPU, tp 2, ep 2).
    x2-features) python -m pytest -q -m gpu tests/gpu/test_spec_dp_gpu.py tests/gpu/test_tbo_dp_gpu.py -p no:cacheprovider 2>&1 | tail -3
        NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu_features.py correctness "$OUT" spec 2>&1 | grep -v " INFO " | tail -6 ;;
    x2-moe-correctness) NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu_features.py correctness "$OUT" moe 2>&1 | grep -v " INFO " | tail -4 ;;
    x2-spec|x2-tbo|x2-moe) NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu_features.py speed "$OUT" "${stage#x2-}" 2>&1 | grep -v " INFO " | tail -8 ;;
    # nvidia-h200-x2: where DP attention's offline time goes (rounds by kind, control plane, kernels).
    x2-profile) NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py profile-dp2 "$OUT" 2>&1 | grep -v " INFO " | tail -40 ;;
    # offline-throughput 1b with the offline Engine's startup heap frozen during generate off (0) and on (1,
    # the default); each JSON's detail.gc_pauses has the collector's stalls inside the timed run. $OUT/gc-<v>/.
    gc-ab)
      for v in 0 1; do
        mkdir -p "$OUT/gc-$v"
        PLAIT_GC_FREEZE=$v python -m plait bench offline --workload offline-throughput --shape llama-3.2-1b \
          --out "$OUT/gc-$v" 2>&1 | grep -E '^\{"workload|Error'
      done ;;
    # The offline benchmark's per-step device times (tests/gpu/test_bench_gpu.py).
    bench-test) python -m pytest -q -m gpu tests/gpu/test_bench_gpu.py -p no:cacheprovider 2>&1 | tail -3 ;;
    # decode-bs1 of each AB_SHAPES shape (space-separated; default qwen3-30b-a3b) once per comma-separated
    # AB_ENVS entry, each entry a space-separated list of VAR=value set for that run alone (e.g.
    # AB_ENVS="PLAIT_PDL=0,PLAIT_PDL=1"); results under $OUT/env-ab-<shape>-<i>/, the settings in each
    # JSON's plait_env.
    env-ab)
      IFS=, read -ra settings <<< "${AB_ENVS:?AB_ENVS: comma-separated VAR=value lists}"
      for shape in ${AB_SHAPES:-qwen3-30b-a3b}; do
        for i in "${!settings[@]}"; do
          echo "--- $shape ${settings[$i]}"
          # shellcheck disable=SC2086  # an entry is several VAR=value words
          env ${settings[$i]} python -m plait bench latency --shape "$shape" --no-peer \
            --eager-output-len 32 --out "$OUT/env-ab-$shape-$i" 2>&1 | grep -E '^\{"workload|Error'
        done
      done ;;
    # offline-throughput of each AB_SHAPES shape (default llama-3.2-1b) once per comma-separated AB_ENVS entry,
    # the entries alternated for AB_ROUNDS rounds (default 1); results under $OUT/offline-env-ab-<shape>-r<round>-<i>/.
    offline-env-ab)
      for shape in ${AB_SHAPES:-llama-3.2-1b}; do
        each_env 1 "${AB_ROUNDS:-1}" "offline-env-ab-$shape" python -m plait bench offline \
          --workload offline-throughput --shape "$shape"
      done ;;
    # The burst (1b, 256 x 512/128, no peer, 4 HTTP processes) once per comma-separated AB_ENVS entry (set for the
    # server and client), alternated for AB_ROUNDS rounds (default 2) after one run that fills the Triton cache;
    # results under $OUT/burst-env-ab-r<round>-<i>/.
    serving-burst-env-ab)
      each_env 0 "${AB_ROUNDS:-2}" burst-env-ab python -m plait bench serve --workload serving-burst \
        --shape llama-3.2-1b --num-prompts 256 --input-len 512 --output-len 128 --client-procs 4 --no-peer \
        --tokenizer-worker-num 4 ;;
    # DESIGN 7's Poisson `serving` with prompt and output lengths uniform in [RANGE * len, len] (RANGE default
    # 0.25, lengths 512/128, 20 requests/s, 200 requests) once per comma-separated AB_ENVS entry, after one run
    # that fills the Triton cache: time to first token when nearly every prompt length is new to the server.
    serving-poisson-env-ab)
      each_env 0 1 poisson-env-ab python -m plait bench serve --workload serving --shape llama-3.2-1b \
        --num-prompts 200 --request-rate 20 --input-len 512 --output-len 128 --range-ratio "${RANGE:-0.25}" \
        --client-procs 2 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
