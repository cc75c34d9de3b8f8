#!/usr/bin/env bash
# The session's last device call, in priority order under one deadline (the device allows 10 min a
# call): GPU tests, decode-bs1 (both shapes), offline-throughput, speculative benchmarks, attention
# backends. Results under $OUT/r; the caller tars them (at most 8 files come back).
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
source benchmarks/deadline.sh
# The fused decode merge compiles inline PTX: if it cannot build here, everything runs two-stage.
stage 60 python -c "
import torch
from plait.attention.triton import kernels as K
q = torch.randn(2, 32, 128, device='cuda', dtype=torch.bfloat16)
kv = torch.randn(600, 8, 128, device='cuda', dtype=torch.bfloat16)
ind = torch.arange(600, device='cuda', dtype=torch.int32); ptr = torch.tensor([0, 300, 600], device='cuda', dtype=torch.int32)
o = torch.empty_like(q); o2 = torch.empty_like(q); c = torch.zeros(16, device='cuda', dtype=torch.int32)
lg = torch.empty(2, 32, 8, 128, device='cuda'); ls = torch.empty(2, 32, 8, device='cuda'); sp = torch.full((2,), 4, device='cuda', dtype=torch.int32)
K.decode_attention_fwd(q, kv, kv, o, ptr, ind, lg, ls, sp, 8, 0.1)
K.decode_attention_fwd(q, kv, kv, o2, ptr, ind, lg, ls, sp, 8, 0.1, split_counters=c)
torch.cuda.synchronize(); assert torch.equal(o, o2) and not c.any(); print('fused decode merge OK')
" || { echo "fused decode merge unavailable: two-stage"; export PLAIT_TRITON_DECODE_TWO_STAGE=1; }
stage 170 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider -o addopts="" 2>&1 | tee "$R/gpu-tests.log" | tail -20
OUT=$R stage 75 bash benchmarks/run_h200.sh latency-8b-fast
OUT=$R stage 60 bash benchmarks/run_h200.sh latency-1b-fast
OUT=$R stage 60 bash benchmarks/run_h200.sh offline
OUT=$R stage 150 bash benchmarks/run_h200.sh spec
stage 25 python benchmarks/attention_backends_bench.py --out-dir "$R" 2>&1 | grep '^#' | tail -8
for pair in "--attention-backend torch_flash" "--prefill-attention-backend torch_flash --decode-attention-backend triton" \
            "--attention-backend triton"; do
  # shellcheck disable=SC2086  # $pair is several flags
  stage 30 python -m plait bench latency --shape llama-3.1-8b --prefill --prefill-only $pair --out "$R" 2>&1 | tail -2
done
for pair in "--attention-backend torch_flash" "--prefill-attention-backend torch_flash --decode-attention-backend triton"; do
  # shellcheck disable=SC2086
  stage 35 python -m plait bench offline --workload offline-throughput $pair --out "$R" 2>&1 | tail -2
done
echo "=== done $(date +%T)"
