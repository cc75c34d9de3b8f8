#!/usr/bin/env bash
# serving-burst in one device call (about 150 s on one H200 for the 1b shape): `plait bench serve
# --workload serving-burst` twice, each run serving SHAPE (dummy weights) to N requests of IN / OUT
# tokens sent at once and then running the offline Engine on the same requests:
#   cold: an empty Triton cache (TRITON_CACHE_DIR fresh), so the server compiles on the request path;
#   warm: a second start on the cache the first run filled.
# Then the Poisson `serving` check at 20 requests/s (TTFT must stay low while the burst gets faster).
# Each run's JSON lands in $OUT/serving-burst/{cold,warm,poisson}/; the three are summed up in
# $OUT/serving-burst/summary.json (server and offline output tok/s, ratio_vs_peer, TTFT p50 of both)
# and printed.
#   bash benchmarks/serving_burst.sh            # SHAPE=llama-3.2-1b N=256 IN=512 OUT_LEN=128 PROCS=4
# MODEL_ARGS replaces "--shape $SHAPE" (a CPU smoke run: MODEL_ARGS="--model DIR --device cpu" N=8 IN=8 OUT_LEN=4);
# SERVE_FLAGS adds engine flags to every run (e.g. "--stream-interval 4").
set -uo pipefail
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/plait-out}
R=$OUT/serving-burst
mkdir -p "$R/cold" "$R/warm" "$R/poisson"
SHAPE=${SHAPE:-llama-3.2-1b} N=${N:-256} IN=${IN:-512} OUT_LEN=${OUT_LEN:-128} PROCS=${PROCS:-4}
# uvicorn serves on httptools and uvloop when they are installed (about a third less CPU per streamed
# chunk than h11 on asyncio), and the events are encoded with orjson when it is: install them from
# carried wheels if any (.whl/).
if [[ -d .whl ]]; then
  for pkg in httptools uvloop orjson; do
    python -m pip install -q --no-index --find-links .whl "$pkg" 2>&1 | tail -1
  done
fi
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-300} ))
source benchmarks/deadline.sh
TRITON_CACHE_DIR=$(mktemp -d /tmp/plait-triton-cold-XXXX)
export TRITON_CACHE_DIR
# shellcheck disable=SC2206  # MODEL_ARGS and SERVE_FLAGS are several words on purpose
model=(${MODEL_ARGS:---shape $SHAPE})
# shellcheck disable=SC2206
flags=(${SERVE_FLAGS:-})
burst=(python -m plait bench serve --workload serving-burst "${model[@]}" --num-prompts "$N" --input-len "$IN"
       --output-len "$OUT_LEN" --client-procs "$PROCS" "${flags[@]}")
for run in cold warm; do
  stage 200 "${burst[@]}" --out "$R/$run" 2>&1 | grep -E '^\{|Error|error' | tail -3
done
# INTERVAL=N (optional, about 45 s more): the warm burst again with --stream-interval N.
if [[ -n ${INTERVAL:-} ]]; then
  mkdir -p "$R/interval"
  stage 120 "${burst[@]}" --stream-interval "$INTERVAL" --out "$R/interval" 2>&1 | grep -E '^\{|Error|error' | tail -3
fi
# WORKERS=N (optional, about 45 s more): the warm burst again with N HTTP processes (--tokenizer-worker-num N;
# the cold and warm runs take the server's default, one per 4 CPUs, 1 to 4: WORKERS=1 compares one).
if [[ -n ${WORKERS:-} ]]; then
  mkdir -p "$R/workers"
  stage 120 "${burst[@]}" --tokenizer-worker-num "$WORKERS" --out "$R/workers" 2>&1 | grep -E '^\{|Error|error' | tail -3
fi
stage 90 python -m plait bench serve --workload serving "${model[@]}" --num-prompts "${POISSON_N:-200}" \
  --request-rate 20 --input-len "$IN" --output-len "$OUT_LEN" --client-procs 2 "${flags[@]}" --out "$R/poisson" 2>&1 \
  | grep -E '^\{|Error|error' | tail -3
python - "$R" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
keys = ("plait", "peer", "tokens_per_chunk", "triton_compiled_during_run", "ratio_vs_peer", "ttft_p50_ms", "peer_ttft_p50_ms", "ttft_p50_ratio_vs_peer",
        "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "errors", "kv_slots_in_use_after", "scheduler_loop", "timeline_ms", "scheduler_timeline_ms", "scheduler_steps", "peer_detail", "host_cpu")
import importlib.util
have = {m: importlib.util.find_spec(m) is not None for m in ("httptools", "uvloop", "orjson")}
summary = {"workload": "serving-burst", "metric": "output_tok_s",
           "uvicorn_http": "httptools" if have["httptools"] else "h11",
           "uvicorn_loop": "uvloop" if have["uvloop"] else "asyncio", "orjson": have["orjson"]}
for run in ("cold", "warm", "interval", "workers", "poisson"):
    files = sorted((root / run).glob("*.json"))
    if files:
        r = json.loads(files[-1].read_text())
        summary[run] = {k: r.get(k) for k in keys} | {"file": str(files[-1]), "shape": r.get("shape"),
                                                       "device": r.get("device"), "commit": r.get("commit")}
(root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=1))
def num(v, f):
    return "n/a" if v is None else format(v, f)
for run in ("cold", "warm", "interval", "workers"):
    r = summary.get(run)
    if r:
        print(f"{run:8s} server {num(r['plait'], '.0f')} tok/s vs offline {num(r['peer'], '.0f')}: "
              f"ratio_vs_peer {num(r['ratio_vs_peer'], '.3f')} (bar 0.90); TTFT p50 {num(r['ttft_p50_ms'], '.0f')} ms vs "
              f"{num(r['peer_ttft_p50_ms'], '.0f')} ms: ratio {num(r['ttft_p50_ratio_vs_peer'], '.2f')} (bar 1.5); "
              f"tokens/event {num(r['tokens_per_chunk'], '.2f')}; errors {r['errors']}")
        loop = r.get("scheduler_loop") or {}
        if loop.get("iterations"):
            per = loop["ms_per_iteration"]
            print(f"{'':8s} scheduler loop: {loop['iterations']} iterations, ms each: step {per['step']:.2f}, "
                  f"collect {per['collect']:.2f}, send {per['send']:.2f}, recv {per['recv']:.2f}; step of the "
                  f"{loop.get('prefill_iterations')} prefilling ones {num(loop.get('step_ms_per_prefill_iteration'), '.2f')}, "
                  f"of the decode-only ones {num(loop.get('step_ms_per_decode_iteration'), '.2f')}")
        cpu = r.get("host_cpu") or {}
        if cpu:
            print(f"{'':8s} host CPUs in use during the load (of {cpu['cpus']}): all {cpu['busy_cpus']:.1f}, stolen "
                  f"{cpu['steal_cpus']:.2f}; scheduler process {num(cpu.get('scheduler_cpus'), '.2f')}, HTTP processes "
                  f"{num(cpu.get('http_cpus'), '.2f')}, client {num(cpu.get('client_cpus'), '.2f')} + "
                  f"{num(cpu.get('children_cpus'), '.2f')} in its processes")
        peer_loop = (r.get("peer_detail") or {}).get("loop") or {}
        if peer_loop.get("iterations"):
            print(f"{'':8s} offline Engine: {peer_loop['iterations']} steps; of the {peer_loop['prefill_iterations']} "
                  f"prefilling ones {num(peer_loop['step_ms_per_prefill_iteration'], '.2f')} ms each, of the "
                  f"decode-only ones {num(peer_loop['step_ms_per_decode_iteration'], '.2f')}")
        for who, steps in (("server", r.get("scheduler_steps")), ("offline", (r.get("peer_detail") or {}).get("steps"))):
            dec = (steps or {}).get("decode") or {}
            if dec:
                print(f"{'':8s} {who} decode steps: {dec['count']}, wall median {dec['median_ms']:.2f} ms, device median "
                      f"{num(dec.get('device_median_ms'), '.2f')} ms, device busy {num(dec.get('device_busy_fraction'), '.2f')}")
        st = r.get("scheduler_timeline_ms")
        if st:
            print(f"{'':8s} scheduler, ms after the first send: first message {num(st['first_message'], '.0f')}, all "
                  f"requests taken {num(st['all_requests_taken'], '.0f')}, first step {num(st['first_step'], '.0f')}; "
                  "first iterations (at ms, messages, step ms, waiting, running): "
                  + " ".join(f"({i['at']:.0f}, {i['messages']}, {i['step_ms']:.1f}, {i['waiting']}, {i['running']})"
                             for i in st["iterations"]))
            if st.get("slowest_steps"):
                print(f"{'':8s} slowest steps (iteration, step ms, collector's pause ms, prefilling, running): "
                      + " ".join(f"({i['index']}, {i['step_ms']:.1f}, {i['gc_ms']:.1f}, {int(i['prefills'])}, {i['running']})"
                                 for i in st["slowest_steps"])
                      + f"; the collector's pauses over the run {st['gc_pause_ms']:.1f} ms")
        for who, tl in (("server", r.get("timeline_ms")), ("offline", (r.get("peer_detail") or {}).get("timeline_ms"))):
            if tl:
                print(f"{'':8s} {who} timeline, ms after the first send: last sent {tl['last_sent']:.0f}, first token "
                      f"{tl['first_token']:.0f}, last first token {tl['last_first_token']:.0f}, last done {tl['last_done']:.0f}")
if summary.get("poisson"):
    p = summary["poisson"]
    print(f"poisson  TTFT p50 {num(p['ttft_p50_ms'], '.1f')} ms, p99 {num(p['ttft_p99_ms'], '.1f')} ms; "
          f"ITL p50 {num(p['itl_p50_ms'], '.2f')} ms; errors {p['errors']}")
EOF
rm -rf "$TRITON_CACHE_DIR"
echo "=== done $(date +%T); JSON under $R"
