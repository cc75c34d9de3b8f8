"""Two GPUs (nvidia-h200-x2): speculative decoding under TP and DP attention, two-batch overlap, and a
mixture of experts at tp 2 and ep 2, each against one GPU in the same call.

    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu_features.py correctness OUT_DIR [PART ...]
    PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 python benchmarks/multi_gpu_features.py speed OUT_DIR [PART ...]

correctness (PART: ``spec``, ``moe``; both by default. bf16, random weights; every layout in a process of its
own, as ``multi_gpu.py`` runs them):
greedy decoding of the same prompts on one GPU, plain, with each step's logits kept, then

- NGRAM and EAGLE3 (a random head) at tp 2 and under DP attention dp 2 (llama-3.2-1b shape): the logits
  of every node on a verify's accepted path, and of every plain decode step between verifies, against
  the one-GPU logits of the same position while the tokens agree (the same inputs: teacher-forced), and
  the tokens wherever the one-GPU top-2 margin is clear of the tolerance;
- the qwen3-30b-a3b shape at tp 2 and at ep 2 (plain, eager, so that each layer's routing reaches the
  host): the same checks, and the rate of top-k routing flips: the share of (token, layer) pairs whose
  expert set differs from one GPU's, over the forwards both runs made on the same inputs.

speed (PART: ``spec``, ``tbo``, ``moe``; all three by default), each against its baseline in this call:

- ``spec-ngram-repeat-tp2``: spec-ngram-repeat at bs 1 on llama-3.1-8b with NGRAM at tp 2, against one
  GPU with NGRAM (``speedup_over_accept_length`` of both in the detail);
- ``offline-throughput-tp2-tbo`` / ``offline-throughput-dp2-tbo``: llama-3.1-8b with two-batch overlap,
  against the same layout without it;
- ``offline-throughput-tp2`` / ``offline-throughput-ep2`` on qwen3-30b-a3b, against one GPU (the ep 2
  bar: 1.7x).

Every JSON's ``config`` names tp_size, dp_size, ep_size, enable_dp_attention, enable_two_batch_overlap
and the speculative algorithm. On a CPU the same code runs on tiny models over gloo, to check the
script itself (nothing is written then).
"""

from __future__ import annotations

import json
import sys
import tempfile
from typing import Any

import torch

# Run as a script: this folder is on sys.path.
from multi_gpu import (  # noqa: E402
    CUDA,
    HOST,
    LAYOUTS,
    REL_TOL,
    PositionLogits,
    _engine,
    _greedy_with_logits,
    _isolated,
    compare_greedy,
    correctness_prompts,
)
from multi_gpu import _model as mg_model  # noqa: E402

from plait.bench.cli import measure_limits
from plait.bench.results import write_result
from plait.bench.spec import NGRAM, spec_ngram_repeat
from plait.bench.workloads import plait_throughput, random_prompts, release, throughput_floor_seconds
from plait.layers.moe.routing_stats import RoutedExpertCounter, sparse_blocks
from plait.models.eagle_heads import make_eagle_head

EP2 = {**LAYOUTS["tp2"], "ep_size": 2}
TBO = {"enable_two_batch_overlap": True}


def layout_config(options: dict[str, Any]) -> dict[str, Any]:
    """The parallel layout and features a result ran with, every field named."""
    return {"tp_size": options.get("tp_size", 1), "dp_size": options.get("dp_size", 1),
            "ep_size": options.get("ep_size", 1), "enable_dp_attention": bool(options.get("enable_dp_attention")),
            "enable_two_batch_overlap": bool(options.get("enable_two_batch_overlap")),
            "speculative_algorithm": options.get("speculative_algorithm")}


def _model(shape: str, cpu_arch: str = "llama") -> tuple[str, int]:
    """``multi_gpu._model`` with three layers on a CPU: the fewest EAGLE3's captured target layers allow."""
    return mg_model(shape, cpu_arch, cpu_layers=3)


class RoutingRecorder(RoutedExpertCounter):
    """Keeps every recorded layer call's expert sets on the host, in call order (each call a sync:
    correctness runs only, eager only)."""

    def __init__(self, num_experts: int, device: torch.device | str) -> None:
        super().__init__(num_experts, device, capacity=1)
        self.sets: list[torch.Tensor] = []  # per call: int64 [tokens, top_k], each row sorted

    def record(self, topk_ids: torch.Tensor, fused: bool | None = None) -> None:
        self.sets.append(topk_ids.sort(dim=-1).values.cpu())


def routing_flips(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict[str, Any]:
    """Rows (token, layer) whose expert set differs, over the calls both runs made on the same token
    counts, in order; the comparison stops at the first call of another size (the batches diverged)."""
    rows = flipped = calls = 0
    for a, b in zip(ref, other, strict=False):
        if a.shape != b.shape:
            break
        calls += 1
        rows += a.shape[0]
        flipped += int((a != b).any(dim=-1).sum())
    return {"calls_compared": calls, "calls_total": len(ref), "rows_compared": rows, "rows_flipped": flipped,
            "flip_rate": flipped / rows if rows else None}


def _layout_run(path: str, prompts: list[list[int]], new: int, options: dict[str, Any], routing: bool = False
                ) -> dict[str, Any]:
    """Greedy tokens, and the logits rank 0 computed per (prompt index, output position): plain decode
    steps from the scheduler's hook, verified nodes on each accepted path from the speculative
    worker's acceptance. ``routing``: every sparse layer call's expert sets (rank 0 routes every token
    under TP and EP)."""
    engine = _engine(path, **options)
    # A first, unrecorded pass: NGRAM's global cache then holds its outputs, so the recorded pass
    # drafts (and verifies) from its first steps on, as in spec-ngram-repeat; every layout runs it alike.
    engine.generate(prompts, {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new})
    log = PositionLogits()
    worker = getattr(engine.scheduler, "local", engine.scheduler).spec_worker  # DP attention: rank 0's
    if worker is not None:
        accept = worker.accept

        def recording_accept(reqs, trees, logits, row_widths=None, greedy=None):
            results = accept(reqs, trees, logits, row_widths=row_widths, greedy=greedy)
            start = 0
            widths = row_widths or [t.width for t in trees]
            for req, (path_nodes, _), width in zip(reqs, results, widths, strict=True):
                # The previous verify's tokens are committed before this acceptance: node path[k]
                # predicts output position len(output_ids) + k.
                for k, node in enumerate(path_nodes):
                    log.keep(req.rid, len(req.output_ids) + k, logits[start + node])
                start += width
            return results

        worker.accept = recording_accept
    recorder = None
    if routing:
        blocks = sparse_blocks(engine.runner.model)
        recorder = RoutingRecorder(blocks[0].router_config.num_experts, engine.runner.device)
        for block in blocks:
            block.routing_counter = recorder
    before = worker.stats.verify_steps if worker is not None else 0
    tokens, logits = _greedy_with_logits(engine, prompts, new, log)
    verify_steps = worker.stats.verify_steps - before if worker is not None else 0
    release(engine)
    return {"tokens": tokens, "logits": logits, "verify_steps": verify_steps,
            "routing": recorder.sets if recorder is not None else None}


NEW_TOKENS = 32 if CUDA else 8


def _compare(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """Two ``_layout_run`` results, the first the one-GPU reference (``multi_gpu.compare_greedy``)."""
    return compare_greedy(ref["tokens"], ref["logits"], run["tokens"], run["logits"])


def correctness_spec(out_dir: str) -> None:
    """NGRAM and EAGLE3 at tp 2 and dp 2 against one GPU's plain run (llama-3.2-1b shape)."""
    report: dict[str, Any] = {"rel_tol": REL_TOL}
    new = NEW_TOKENS
    path, vocab = _model("llama-3.2-1b")
    prompts = correctness_prompts(vocab)
    head = str(make_eagle_head(tempfile.mkdtemp(), path, "EAGLE3"))
    eagle3 = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": head, "speculative_num_steps": 3,
              "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}
    ref = _isolated(_layout_run, path, prompts, new, {})
    for layout in ("tp2", "dp2"):
        for algo, spec in (("NGRAM", NGRAM), ("EAGLE3", eagle3)):
            options = {**LAYOUTS[layout], **spec}
            run = _isolated(_layout_run, path, prompts, new, options)
            name = f"{algo.lower()}-{layout}"
            report[name] = {**_compare(ref, run), "verify_steps": run["verify_steps"],
                            "config": layout_config(options)}
            report[name]["ok"] = report[name]["ok"] and run["verify_steps"] > 0
            print(name, report[name])
    _write_report(out_dir, "spec", report)


def correctness_moe(out_dir: str) -> None:
    """qwen3-30b-a3b at tp 2 and ep 2 against one GPU, eager (each layer call's routing is read)."""
    report: dict[str, Any] = {"rel_tol": REL_TOL}
    new = NEW_TOKENS
    path, vocab = _model("qwen3-30b-a3b", cpu_arch="qwen3-moe")
    prompts = correctness_prompts(vocab)
    eager = {"disable_cuda_graph": True}
    ref = _isolated(_layout_run, path, prompts, new, eager, routing=True)
    for name, layout in (("moe-tp2", LAYOUTS["tp2"]), ("moe-ep2", EP2)):
        options = {**eager, **layout}
        run = _isolated(_layout_run, path, prompts, new, options, routing=True)
        report[name] = {**_compare(ref, run), "routing": routing_flips(ref["routing"], run["routing"]),
                        "config": layout_config(options)}
        print(name, report[name])
    _write_report(out_dir, "moe", report)


def _write_report(out_dir: str, part: str, report: dict[str, Any]) -> None:
    if CUDA:
        with open(f"{out_dir}/multi-gpu-features-correctness-{part}.json", "w") as f:
            json.dump(report, f, indent=2)


def _offline_workload(shape: str, cpu_arch: str = "llama") -> tuple[str, list[list[int]], list[dict[str, Any]], int]:
    path, vocab = _model(shape, cpu_arch)
    n = 256 if CUDA else 8
    prompts = random_prompts(n, 512, vocab, seed=0) if CUDA else [[5 + i, 7, 9] for i in range(n)]
    out_len = 128 if CUDA else 4
    return path, prompts, [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": out_len}] * n, out_len


def _offline_runs(path: str, prompts: list[list[int]], params: list[dict[str, Any]],
                  layouts: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    results = {}
    for name, options in layouts.items():
        # No prefix cache: the warm-up pass repeats the prompts, and DP attention's other rank keeps a
        # cache of its own that the benchmark cannot reset.
        engine_opts = {"max_running_requests": len(prompts), "disable_radix_cache": True, **HOST, **options}
        results[name] = _isolated(plait_throughput, path, prompts, params, **engine_opts)
        print(name, results[name]["output_tok_s"])
    return results


def speed_spec(out_dir: str) -> None:
    shape = "llama-3.1-8b" if CUDA else "tiny"
    path, vocab = _model("llama-3.1-8b")
    # The spec stage's size (run_h200.sh ``spec``): 16 prompts x 64 tokens, so both layouts fit one call.
    size = {"num_prompts": 16, "output_len": 64} if CUDA else {"num_prompts": 2, "input_len": 8, "output_len": 8,
                                                                **HOST}
    runs = {name: _isolated(spec_ngram_repeat, path, vocab, batch_sizes=(1,), **size, **options)["bs1"]
            for name, options in (("1gpu", {}), ("tp2", LAYOUTS["tp2"]))}
    print({n: {k: r[k] for k in ("ngram_step_tok_s", "speedup_over_accept_length")} for n, r in runs.items()})
    if CUDA:
        write_result(out_dir, "spec-ngram-repeat-tp2", shape, "ngram_step_tok_s", runs["tp2"]["ngram_step_tok_s"],
                     "plait, one GPU, NGRAM", runs["1gpu"]["ngram_step_tok_s"], None,
                     {"dtype": "bfloat16", "load_format": "dummy", "bs": 1, **NGRAM,
                      **layout_config({**LAYOUTS["tp2"], **NGRAM})}, detail=runs)


def speed_tbo(out_dir: str) -> None:
    shape = "llama-3.1-8b" if CUDA else "tiny"
    path, prompts, params, out_len = _offline_workload("llama-3.1-8b")
    layouts = {f"{base}{suffix}": {**LAYOUTS[base], **extra} for base in ("tp2", "dp2")
               for suffix, extra in (("", {}), ("-tbo", TBO))}
    results = _offline_runs(path, prompts, params, layouts)
    if not CUDA:
        return
    floor = 2 * len(prompts) * out_len / throughput_floor_seconds(shape, [512] * len(prompts),
                                                                  [out_len] * len(prompts), measure_limits())
    for base in ("tp2", "dp2"):
        name = f"{base}-tbo"
        write_result(out_dir, f"offline-throughput-{name}", shape, "output_tok_s", results[name]["output_tok_s"],
                     f"plait, {base} without two-batch overlap", results[base]["output_tok_s"], floor,
                     {"dtype": "bfloat16", "load_format": "dummy", "requests": len(prompts),
                      **layout_config(layouts[name])}, detail=results[name],
                     others={k: v["output_tok_s"] for k, v in results.items()},
                     floor_definition="two GPUs: 2 x the one-GPU offline floor of the shape")


def speed_moe(out_dir: str) -> None:
    shape = "qwen3-30b-a3b" if CUDA else "tiny"
    path, prompts, params, out_len = _offline_workload("qwen3-30b-a3b", cpu_arch="qwen3-moe")
    layouts = {"1gpu": {}, "tp2": LAYOUTS["tp2"], "ep2": EP2}
    results = _offline_runs(path, prompts, params, layouts)
    if not CUDA:
        return
    floor1 = len(prompts) * out_len / throughput_floor_seconds(shape, [512] * len(prompts),
                                                               [out_len] * len(prompts), measure_limits())
    for name in ("tp2", "ep2"):
        write_result(out_dir, f"offline-throughput-{name}", shape, "output_tok_s", results[name]["output_tok_s"],
                     "plait, one GPU", results["1gpu"]["output_tok_s"], 2 * floor1,
                     {"dtype": "bfloat16", "load_format": "dummy", "requests": len(prompts),
                      **layout_config(layouts[name])}, detail=results[name],
                     others={k: v["output_tok_s"] for k, v in results.items()},
                     floor_definition="two GPUs: 2 x the one-GPU offline floor of the shape")


PARTS = {"correctness": {"spec": correctness_spec, "moe": correctness_moe},
         "speed": {"spec": speed_spec, "tbo": speed_tbo, "moe": speed_moe}}

if __name__ == "__main__":
    parts = PARTS[sys.argv[1]]
    for part in sys.argv[3:] or list(parts):
        parts[part](sys.argv[2])
