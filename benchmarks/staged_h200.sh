#!/usr/bin/env bash
# One device call of several run_h200.sh stages under one deadline:
#   BUDGET_S=560 bash benchmarks/staged_h200.sh CAP_S:stage [CAP_S:stage ...]
# Each stage runs for at most min(CAP_S, the time left); results land in $OUT/r (tar them: at most
# 8 files come back from a call).
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
# The device's copy of the tree may carry a .git whose HEAD is not the tree's commit: results record
# PLAIT_COMMIT when it is set, so pass it (PLAIT_COMMIT=$(git rev-parse --short HEAD) on this side).
echo "=== commit recorded: ${PLAIT_COMMIT:-unset, so the checkout HEAD $(git rev-parse --short HEAD 2>/dev/null)}"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
source benchmarks/deadline.sh
for spec in "$@"; do
  OUT=$R stage "${spec%%:*}" bash benchmarks/run_h200.sh "${spec#*:}"
done
echo "=== done $(date +%T)"
