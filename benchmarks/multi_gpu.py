"""Issue 8 on nvidia-h200-x2: tensor parallelism, DP attention and replicas against one GPU.

    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py correctness OUT_DIR
    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py decode OUT_DIR
    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py offline OUT_DIR
    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu.py moe-ep OUT_DIR [LAYOUT ...]

correctness (llama-3.2-1b shape, bf16, random weights): greedy generation of 8 prompts on one GPU with
every step's logits recorded, then with tp_size=2 and with DP attention (dp_size=2, CUDA graphs on).
Logits are compared step by step while a request's tokens agree with the one-GPU run (the same
inputs, i.e. teacher-forced up to there); tokens must agree wherever the one-GPU top-2 margin exceeds
the tolerance. DP attention's other rank schedules in its own process, so its logits are compared for
the requests rank 0 served and its tokens for all. decode: decode-bs1 on llama-3.1-8b, one GPU and
tp_size=2, against the one- and two-GPU byte floors. offline: offline-throughput on llama-3.1-8b for
one GPU, tp2, DP attention dp2 and two replicas, each written with ratio_vs_peer against the one-GPU
plait run. moe-ep: offline-throughput on qwen3-30b-a3b with expert parallelism (ep 2), the gather path
against the all-to-all one (--moe-a2a-backend), under DP attention (and plain TP when named).

On a CPU (no CUDA) it runs the same code on a tiny model with gloo, to check the script itself.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import traceback
from typing import Any

import torch

from plait.bench.cli import measure_limits
from plait.bench.results import write_result
from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import (
    decode_step_bytes,
    make_engine,
    plait_decode_bs1,
    plait_throughput,
    random_prompts,
    release,
    throughput_floor_seconds,
)

CUDA = torch.cuda.is_available()
# bf16 logits of the same model through a different reduction order (TP all-reduce, other batch
# composition): the tolerance tests/gpu/test_engine_gpu.py measured between two batch sizes on one
# GPU was about 1e-2 of the logit scale; twice that here.
REL_TOL = 2e-2 if CUDA else 1e-4
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2},
    "dp2": {"dp_size": 2, "tp_size": 2, "enable_dp_attention": True},
    "replicas2": {"dp_size": 2},
}
# Run only when named (``offline OUT dp2-nccl``): DP attention with NCCL moving every round's rows, and
# tp 2 with NCCL's all-reduce, to measure the symmetric-memory paths against them in the same call;
# printed and kept in ``others``. ``decode OUT tp2-nccl`` adds the latter to decode-bs1's detail.
AB_LAYOUTS: dict[str, dict[str, Any]] = {"dp2-nccl": {**LAYOUTS["dp2"], "disable_copy_engine_rows": True},
                                         "tp2-nccl": {**LAYOUTS["tp2"], "disable_custom_all_reduce": True}}


def _model(shape: str, cpu_arch: str = "llama", cpu_layers: int | None = None) -> tuple[str, int]:
    """The shape with random weights on CUDA; on a CPU a tiny ``cpu_arch`` model (``cpu_layers``:
    other than the preset's layer count)."""
    if CUDA:
        return str(write_shape_dir(tempfile.mkdtemp(), shape)), SHAPES[shape]["vocab_size"]
    from plait.testing import make_tiny_model

    layers = {} if cpu_layers is None else {"num_hidden_layers": cpu_layers}
    return str(make_tiny_model(tempfile.mkdtemp(), cpu_arch, **layers)), 500


# The tiny model's limits when checking the script on a CPU.
HOST = {} if CUDA else {"device": "cpu", "context_length": 2048, "max_total_tokens": 4096}


def _engine(path: str, **options: Any):
    if CUDA:
        return make_engine(path, **options)
    from plait import Engine

    return Engine(model=path, device="cpu", max_total_tokens=4096, **options)


def _isolated(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a fresh spawned process. Each layout's engine runs in its own process,
    as a server's would: torch's symmetric memory pairs rendezvous only between processes that made
    equally many before, so a second tp / DP-attention engine in one process falls back to NCCL."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_put_result, args=(results, fn, args, kwargs))
    proc.start()
    while True:
        try:
            ok, value = results.get(timeout=5)  # before join: a large result must be drained first
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{fn.__name__} died without a result (exit code {proc.exitcode})") from None
    proc.join()
    if not ok:
        raise RuntimeError(f"{fn.__name__} failed in its process:\n{value}")
    return pickle.loads(value)


def _put_result(results: Any, fn: Any, args: tuple, kwargs: dict) -> None:
    try:
        # Pickled here, by value: the queue's own pickler would send a tensor as a shared-memory handle,
        # which the parent can no longer open once this process has exited.
        results.put((True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:
        results.put((False, traceback.format_exc()))
        raise


def _layout_greedy(path: str, prompts: list[list[int]], new: int, options: dict[str, Any]
                   ) -> tuple[list[list[int]], dict, bool]:
    engine = _engine(path, **options)
    graphs = getattr(getattr(engine, "runner", None), "graph_runner", None) is not None
    tokens, logits = _greedy_with_logits(engine, prompts, new)
    release(engine)
    return tokens, logits, graphs


class PositionLogits:
    """The float32 logits rows this process computed, by request id and the output position each row
    predicts (the first row seen for a position is kept)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def keep(self, rid: str, position: int, row: torch.Tensor) -> None:
        self.rows.setdefault(rid, {}).setdefault(position, row.float().cpu())


def _greedy_with_logits(engine: Any, prompts: list[list[int]], new: int, log: PositionLogits | None = None
                        ) -> tuple[list[list[int]], dict[int, dict[int, torch.Tensor]]]:
    """Greedy token ids per prompt, and {prompt index: {output position: float32 logits}} for the
    requests whose scheduler runs in this process: the plain steps' rows, and whatever else ``log``
    is given meanwhile (a speculative worker's verified rows)."""
    log = log or PositionLogits()
    sched = getattr(engine.scheduler, "local", engine.scheduler)  # DP attention: rank 0's own scheduler
    # At launch, before the request's pending count takes this step: the row predicts output num_generated.
    sched.on_logits = lambda reqs, logits: [log.keep(r.rid, r.num_generated, row)
                                            for r, row in zip(reqs, logits, strict=True)]
    outs = engine.generate(prompts, {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new})
    sched.on_logits = None
    return [o.token_ids for o in outs], {i: log.rows[o.rid] for i, o in enumerate(outs) if o.rid in log.rows}


def compare_greedy(ref_tokens: list[list[int]], ref_logits: dict[int, dict[int, torch.Tensor]],
                   tokens: list[list[int]], logits: dict[int, dict[int, torch.Tensor]]) -> dict[str, Any]:
    """A run against the one-GPU reference, request by request up to its first differing token: the
    largest logit difference (relative to the reference row's largest magnitude) at the positions the
    run's rank 0 computed, and the differing tokens where the reference's top-2 margin was clear."""
    max_rel, compared, clear_mismatch, agree = 0.0, 0, 0, 0
    for i, ref in enumerate(ref_tokens):
        got = logits.get(i, {})
        for t, (a, b) in enumerate(zip(ref, tokens[i], strict=True)):
            ref_row = ref_logits[i][t]
            scale = float(ref_row.abs().max())
            if t in got:
                max_rel = max(max_rel, float((got[t] - ref_row).abs().max()) / scale)
                compared += 1
            if a != b:
                top2 = torch.topk(ref_row, 2).values
                clear_mismatch += float(top2[0] - top2[1]) / scale > 2 * REL_TOL
                break  # later positions have other inputs: no longer comparable
            agree += 1
    return {"max_rel_logit_diff": max_rel, "positions_compared": compared, "positions_tokens_agree": agree,
            "positions_total": sum(len(t) for t in ref_tokens), "mismatches_at_a_clear_margin": clear_mismatch,
            "ok": max_rel <= REL_TOL and clear_mismatch == 0 and compared > 0}


def correctness_prompts(vocab: int) -> list[list[int]]:
    return random_prompts(8, 64, vocab, seed=11) if CUDA else [[5 + i, 7, 9 + i, 11] for i in range(8)]


def correctness(out_dir: str) -> dict[str, Any]:
    path, vocab = _model("llama-3.2-1b")
    prompts = correctness_prompts(vocab)
    new = 32 if CUDA else 8
    one = _engine(path)
    ref_tokens, ref_logits = _greedy_with_logits(one, prompts, new)
    release(one)
    report: dict[str, Any] = {"rel_tol": REL_TOL}
    for name in ("tp2", "dp2"):
        tokens, logits, graphs = _isolated(_layout_greedy, path, prompts, new, LAYOUTS[name])
        report[name] = {**compare_greedy(ref_tokens, ref_logits, tokens, logits), "cuda_graphs": graphs}
        print(name, report[name])
    with open(f"{out_dir}/multi-gpu-correctness.json", "w") as f:
        json.dump(report, f, indent=2)
    return report


def decode(out_dir: str, also: list[str] | None = None) -> None:
    """decode-bs1 on one GPU and tp 2; ``also``: A/B layouts to run beside them (``tp2-nccl``)."""
    shape = "llama-3.1-8b" if CUDA else "tiny"
    path, vocab = _model(shape)
    lim = measure_limits() if CUDA else None
    prompt = random_prompts(1, 128, vocab, seed=0)[0] if CUDA else [5, 7, 9, 11]
    new = 256 if CUDA else 8
    runs = {n: _isolated(plait_decode_bs1, shape, path, prompt, new, **HOST, **opts)
            for n, opts in (("1gpu", {}), ("tp2", LAYOUTS["tp2"]), *((a, AB_LAYOUTS[a]) for a in also or []))}
    print({n: r["tok_s"] for n, r in runs.items()})
    if lim is None:
        return
    floor1 = lim.copy_bw / decode_step_bytes(shape, [128 + new // 2])
    write_result(out_dir, "decode-bs1-tp2", shape, "decode_tok_s", runs["tp2"]["tok_s"], "plait, one GPU",
                 runs["1gpu"]["tok_s"], 2 * floor1, {"dtype": "bfloat16", "load_format": "dummy", "tp_size": 2},
                 detail=runs, floor_definition="two GPUs: 2 x copy HBM bandwidth / bytes per step (weights + KV "
                 "at the mean context); the one-GPU floor is half of it", one_gpu_floor=floor1)


def offline(out_dir: str, only: list[str] | None = None) -> None:
    """``only``: run just these layouts (e.g. ``replicas2`` after a fix); results are written with the
    runs made in this call."""
    shape = "llama-3.1-8b" if CUDA else "tiny"
    path, vocab = _model(shape)
    n = 256 if CUDA else 8
    prompts = random_prompts(n, 512, vocab, seed=0) if CUDA else [[5 + i, 7, 9] for i in range(n)]
    out_len = 128 if CUDA else 4
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": out_len}] * n
    results = {}
    for name, opts in (("1gpu", {}), *LAYOUTS.items(), *AB_LAYOUTS.items()):
        if name not in (only or ["1gpu", *LAYOUTS]):
            continue
        # No prefix cache: the warm-up run repeats the prompts, and DP attention's other rank keeps its
        # own cache, which the benchmark could not reset.
        engine_opts = {"max_running_requests": n, "disable_radix_cache": True, **HOST, **opts}
        results[name] = _isolated(plait_throughput, path, prompts, params, **engine_opts)
        print(name, results[name]["output_tok_s"])
    if not CUDA:
        return
    lim = measure_limits()
    floor1 = n * out_len / throughput_floor_seconds(shape, [512] * n, [out_len] * n, lim)
    for name, workload in (("1gpu", "offline-throughput"), ("tp2", "offline-throughput-tp2"),
                           ("dp2", "offline-throughput-dp2"), ("replicas2", "offline-throughput-replicas2")):
        if name not in results:
            continue
        gpus = 1 if name == "1gpu" else 2
        one = results.get("1gpu", {}).get("output_tok_s")
        write_result(out_dir, workload, shape, "output_tok_s", results[name]["output_tok_s"],
                     None if name == "1gpu" or one is None else "plait, one GPU",
                     None if name == "1gpu" else one, gpus * floor1,
                     {"dtype": "bfloat16", "load_format": "dummy", "requests": n, **({} if name == "1gpu" else
                                                                                    LAYOUTS[name])},
                     detail=results[name], others={k: v["output_tok_s"] for k, v in results.items()})


# Expert parallelism's two dispatch paths (--moe-a2a-backend) on the MoE shape, under DP attention and
# under plain TP: whole experts per GPU (ep_size = tp_size = 2).
EP_LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2-ep2-gather": {**LAYOUTS["dp2"], "ep_size": 2},
    "dp2-ep2-a2a": {**LAYOUTS["dp2"], "ep_size": 2, "moe_a2a_backend": "all_to_all"},
    "tp2-ep2-gather": {**LAYOUTS["tp2"], "ep_size": 2},
    "tp2-ep2-a2a": {**LAYOUTS["tp2"], "ep_size": 2, "moe_a2a_backend": "all_to_all"},
}


def moe_ep(out_dir: str, only: list[str] | None = None) -> None:
    """offline-throughput on qwen3-30b-a3b (random weights) for the EP layouts (``only``: a subset;
    default the two DP-attention ones), each in its own process; the all-to-all run of a pair is
    written with the gather run of the same parallel layout as its peer. On CUDA decode steps (DP
    attention: MAX_LEN rounds) take the gather path in both, so the difference is in the prefill
    (SUM_LEN) forwards."""
    shape = "qwen3-30b-a3b" if CUDA else "tiny"
    path, vocab = _model(shape, cpu_arch="qwen3-moe")
    n = 256 if CUDA else 8
    prompts = random_prompts(n, 512, vocab, seed=0) if CUDA else [[5 + i, 7, 9] for i in range(n)]
    out_len = 128 if CUDA else 4
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": out_len}] * n
    results = {}
    for name in only or ["dp2-ep2-gather", "dp2-ep2-a2a"]:
        engine_opts = {"max_running_requests": n, "disable_radix_cache": True, **HOST, **EP_LAYOUTS[name]}
        results[name] = _isolated(plait_throughput, path, prompts, params, **engine_opts)
        print(name, results[name]["output_tok_s"])
    if not CUDA:
        return
    lim = measure_limits()
    floor = 2 * n * out_len / throughput_floor_seconds(shape, [512] * n, [out_len] * n, lim)
    for name, result in results.items():
        if not name.endswith("-a2a"):
            continue
        peer = results.get(name.replace("-a2a", "-gather"), {}).get("output_tok_s")
        write_result(out_dir, f"offline-throughput-{name}", shape, "output_tok_s", result["output_tok_s"],
                     None if peer is None else "plait, same layout, --moe-a2a-backend none", peer, floor,
                     {"dtype": "bfloat16", "load_format": "dummy", "requests": n, **EP_LAYOUTS[name]},
                     detail=result, others={k: v["output_tok_s"] for k, v in results.items()},
                     floor_definition="two GPUs: 2 x the one-GPU offline floor of the shape")


def _kernel_table(step: Any, top: int = 20) -> list[dict[str, Any]]:
    """Run ``step()`` under the torch profiler: its top operations and kernels by device time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
    return [{"name": e.key[:90], "calls": e.count, "device_us": e.device_time_total, "cpu_us": e.cpu_time_total}
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]]


def _gpu_timeline(steps: Any, trace_path: str | None = None) -> dict[str, Any]:
    """Run ``steps()`` (several rounds) under the torch profiler and answer how busy the GPU was:
    the span from the first kernel's start to the last kernel's end, the union of kernel time in it,
    the largest idle gaps with the kernels around them, and the longest NCCL kernel (a collective
    that waited for the other rank shows as a long kernel). The trace goes to ``trace_path`` (gzip)."""
    import gzip

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        steps()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if trace_path:
        raw = trace_path.removesuffix(".gz")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f, gzip.open(trace_path, "wb") as g:
            g.write(f.read())
        os.remove(raw)
    if not kernels:
        return {"kernels": 0}
    busy, gaps, end = 0.0, [], kernels[0][0]
    prev = ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, prev[:60], name[:60]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    span = end - kernels[0][0]
    nccl = [stop - start for start, stop, name in kernels if "nccl" in name.lower()]
    return {"span_us": span, "busy_us": busy, "busy_fraction": busy / span, "kernels": len(kernels),
            "idle_us": span - busy, "gaps_over_20us": sum(1 for g in gaps if g[0] > 20),
            "top_gaps": [{"us": g[0], "after": g[1], "before": g[2]} for g in sorted(gaps, reverse=True)[:12]],
            "nccl_kernel_max_us": max(nccl, default=0.0), "nccl_kernel_us": sum(nccl)}


def profile_dp2(out_dir: str) -> dict[str, Any]:
    """Where a DP-attention (dp 2) offline-throughput run spends its time, seen from rank 0: wall time
    per lockstep round by kind (any rank extending, or all decoding), the control-plane collectives
    (gloo) inside those rounds, per-kernel tables of the first round (an extend round) and of one
    all-decode round, and a host profile of 40 all-decode rounds."""
    import cProfile
    import io
    import pstats
    import time
    from collections import defaultdict

    import plait.parallel.dp_attention as dpa

    shape = "llama-3.1-8b" if CUDA else "tiny"
    path, vocab = _model(shape)
    n, out_len = (256, 128) if CUDA else (8, 4)
    engine = _engine(path, max_running_requests=n, disable_radix_cache=True, **LAYOUTS["dp2"])
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": out_len}
    prompts = random_prompts(n, 512, vocab, seed=0) if CUDA else [[5 + i, 7, 9] for i in range(n)]
    engine.generate(prompts, params)  # warm-up
    sched, runner = engine.scheduler, engine.runner
    control_s: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            control_s[name] += time.perf_counter() - t0
            return out
        return wrapper

    dpa.exchange_objects = timed("round_exchange", dpa.exchange_objects)
    runner._sync = timed("count_sync", runner._sync)
    rounds: dict[str, list[float]] = defaultdict(list)
    kernels = extend_kernels = decode_timeline = extend_timeline = None
    host = cProfile.Profile()  # rank 0's host work over the decode rounds after the kernel table
    host_rounds = 0
    extend_counts: list[list[int]] = []  # tokens per rank in each extend round
    for p in prompts:
        sched.add_request(engine.make_request(p, params))
    t_all = time.perf_counter()
    while sched.has_work():
        before = len(runner.rounds)
        t0 = time.perf_counter()
        if extend_kernels is None:
            # The first round: both ranks prefill a chunk (a SUM_LEN extend round).
            extend_kernels = _kernel_table(sched.step)
        elif extend_timeline is None and sched.waiting:
            extend_timeline = _gpu_timeline(sched.step)
        elif kernels is None and not sched.waiting and not sched.prefilling and len(sched.running) == n:
            kernels = _kernel_table(sched.step)
        elif kernels is not None and decode_timeline is None and len(sched.running) == n:
            # Five decode rounds back to back: how much of their span the GPU computes.
            decode_timeline = _gpu_timeline(lambda: [sched.step() for _ in range(5)],
                                            f"{out_dir}/multi-gpu-dp2-decode-trace.json.gz")
        elif kernels is not None and host_rounds < 40 and len(sched.running) == n:
            host.enable()
            sched.step()
            host.disable()
            host_rounds += 1
        else:
            sched.step()
        dt = time.perf_counter() - t0
        added = len(runner.rounds) - before  # several when a timeline ran rounds back to back
        if added > 0:
            counts, extends, mode = runner.rounds[-1]
            rounds[f"{'extend' if any(extends) else 'decode'}-{mode.name}"] += [dt / added] * added
            if any(extends):
                extend_counts.append(list(counts))
        else:
            rounds["no-forward"].append(dt)
    total = time.perf_counter() - t_all
    report = {"total_s": total, "output_tok_s": n * out_len / total,
              "rounds": {k: {"count": len(v), "total_s": sum(v), "mean_ms": 1e3 * sum(v) / len(v)}
                         for k, v in rounds.items()},
              "control_plane_s": dict(control_s), "extend_round_counts": extend_counts, "decode_round_kernels": kernels,
              "extend_round_kernels": extend_kernels,
              "decode_timeline_5_rounds": decode_timeline, "extend_timeline_1_round": extend_timeline,
              "padding_modes": dict(runner.padding_modes), "idle_rounds_rank0": runner.idle_rounds}
    release(engine)
    text = io.StringIO()
    text.write(f"rank 0 host work over {host_rounds} all-decode rounds (cProfile, cumulative)\n")
    if host_rounds:
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(45)
    with open(f"{out_dir}/multi-gpu-profile-dp2-host.txt", "w") as f:
        f.write(text.getvalue())
    print(json.dumps({k: v for k, v in report.items() if not k.endswith("_kernels")}, indent=1))
    with open(f"{out_dir}/multi-gpu-profile-dp2.json", "w") as f:
        json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    if sys.argv[1] == "profile-dp2":
        profile_dp2(sys.argv[2])
    elif sys.argv[1] == "offline":
        offline(sys.argv[2], sys.argv[3:] or None)
    elif sys.argv[1] == "moe-ep":
        moe_ep(sys.argv[2], sys.argv[3:] or None)
    elif sys.argv[1] == "decode":
        decode(sys.argv[2], sys.argv[3:] or None)
    else:
        correctness(sys.argv[2])
