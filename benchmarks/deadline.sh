# Sourced by the one-call device scripts: `stage CAP_S CMD...` runs CMD for at most min(CAP_S, the
# seconds left before DEADLINE) and skips it when fewer than 20 s are left. Set DEADLINE first.
stage() {
  local cap=$1; shift
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < 20 )) && { echo "=== skipped (deadline): $*"; return; }
  (( cap > left )) && cap=$left
  echo "=== $(date +%T) [$cap s] $*"
  timeout "$cap" "$@"
}
