"""The speculative benchmark workloads run end to end on a tiny model on the CPU (numbers are
meaningless here: they matter on a GPU). `plait bench spec` exposes them."""

from __future__ import annotations

import pytest

from plait.bench.spec import spec_ngram_miss, spec_ngram_repeat, spec_overhead
from plait.cli import build_parser

CPU = {"dtype": "float32", "device": "cpu", "context_length": 256, "max_total_tokens": 4096}


def test_spec_workloads_run_and_report_their_keys(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    rep = spec_ngram_repeat(path, 400, num_prompts=2, input_len=8, output_len=8, batch_sizes=(1, 2), **CPU)
    assert set(rep) == {"bs1", "bs2"}
    assert rep["bs1"]["accept_length"] > 1.5  # the second pass guesses its first pass's outputs
    assert {"speedup", "speedup_over_accept_length", "speedup_over_accept_length_end_to_end", "plain_tok_s",
            "ngram_tok_s", "plain_step_tok_s", "ngram_step_tok_s", "step_accept_length"} <= set(rep["bs2"])
    assert rep["bs1"]["step_accept_length"] > 1.5 and rep["bs1"]["ngram_step_tok_s"] > 0
    assert rep["bs1"]["outputs_equal_plain"] == rep["bs2"]["outputs_equal_plain"] == 1.0  # fp32: exact
    miss = spec_ngram_miss(path, 400, num_prompts=2, input_len=8, output_len=6, **CPU)
    assert miss["cost_over_plain"] > 0
    over = spec_overhead(path, batch_sizes=(1, 2), context=16, iters=2, **CPU)
    assert over["bs2"]["verify_ms"] > 0 and over["bs1"]["accept_bookkeeping_ms"] > 0


@pytest.fixture(scope="module")
def bs1_row(tiny_model_dir) -> dict:
    """spec-ngram-repeat's bs-1 row on the tiny llama."""
    path = str(tiny_model_dir("llama"))
    return spec_ngram_repeat(path, 400, num_prompts=2, input_len=8, output_len=8, batch_sizes=(1,), **CPU)["bs1"]


def test_spec_ngram_repeat_counts_the_second_half_forwards_by_kind(bs1_row):
    row = bs1_row
    plain, ngram = row["plain_step_forwards"], row["ngram_step_forwards"]
    assert plain == {"verify": 0, "other": 2 * 4}  # bs 1: each prompt's tokens 5-8, one decode step each
    assert ngram["verify"] > 0
    assert ngram["verify"] + ngram["other"] < plain["other"]  # verifies gain more than a token a step


def test_spec_ngram_repeat_records_the_hosts_cpus_over_each_engines_timed_passes(bs1_row):
    for name in ("plain", "ngram"):
        cpu = bs1_row[f"{name}_host_cpu"]
        assert cpu["engine_cpus"] > 0 and cpu["steal_cpus"] >= 0 and 0 < cpu["busy_cpus"] <= cpu["cpus"] + 0.05


def test_plait_bench_spec_is_a_subcommand():
    args = build_parser().parse_args(["bench", "spec", "--workload", "spec-ngram-miss", "--shape", "llama-3.1-8b"])
    assert args.workload == "spec-ngram-miss"


def test_eagle3_draft_step_reports_first_and_later_steps_against_the_floor(tmp_path):
    import pytest

    pytest.importorskip("triton")
    from plait.bench.spec import eagle3_draft_step
    from plait.executor.graph_utils import EagerGraph
    from plait.testing import make_tiny_model

    target = make_tiny_model(tmp_path / "three", "llama", seed=0, num_hidden_layers=3)
    r = eagle3_draft_step(str(target), context=8, topks=(1, 2), iters=1, read_bytes_per_s=1e12,
                          graph_factory=EagerGraph, attention_backend="triton", **CPU)
    assert r["topk2"]["rows"] == 2
    for key in ("topk1", "topk2"):
        assert r[key]["first_step_ms"] > 0
        assert r[key]["first_step_floor_ms"] > r[key]["later_step_floor_ms"] > 0  # fc is read once


def test_spec_ngram_repeat_reports_how_far_each_timed_pass_repeats_the_first(bs1_row):
    # fp32 on the CPU: no near-tie rounds another way, so every pass repeats the first exactly.
    assert bs1_row["plain_repeat_agreement"] == bs1_row["ngram_repeat_agreement"] == 1.0


def test_spec_ngram_repeat_ratio_at_bs1_is_plain_step_time_over_the_speculative_runs_step_time(bs1_row):
    """bs 1: one request a forward, plain or verify; the second half's accept length is its tokens per
    forward of either kind, so the ratio is a plain step's time over the speculative run's mean step."""
    row = bs1_row
    assert row["plain_step_occupancy"] == row["ngram_step_occupancy"] == 1.0
    forwards = row["ngram_step_forwards"]["verify"] + row["ngram_step_forwards"]["other"]
    tokens = 2 * 4  # two prompts, tokens 5-8 each
    assert row["step_accept_length"] == pytest.approx(tokens / forwards)
    plain_step_s = 1 / row["plain_step_tok_s"]
    ngram_step_s = tokens / row["ngram_step_tok_s"] / forwards
    assert row["speedup_over_accept_length"] == pytest.approx(plain_step_s / ngram_step_s)


def test_spec_ngram_repeat_reports_the_ratio_over_the_verifies_accept_length_beside_it(bs1_row):
    row = bs1_row
    assert row["verify_accept_length"] > 1.5  # the repeat's drafts land
    assert row["speedup_over_verify_accept_length"] == pytest.approx(row["step_speedup"] / row["verify_accept_length"])


def test_spec_ngram_repeat_counts_the_second_halfs_steps_without_a_verify_by_cause(bs1_row):
    """Where the speculative run's plain forwards came from (a miss, the back-off's pause, ...): the
    tiny repeat drafts its first pass's text exactly, so every second-half step verifies."""
    assert bs1_row["plain_step_plain_steps"] == {}  # a plain engine has no speculative worker
    assert bs1_row["ngram_step_forwards"]["other"] == 0
    assert sum(bs1_row["ngram_step_plain_steps"].values()) == 0
