"""``plait bench agreement``: plait in a low precision against a float32 transformers reference, beside
transformers' own run in that precision, teacher-forced and free-running."""

from __future__ import annotations

import json

import pytest

from plait.bench.agreement import (
    Agreement,
    compare,
    measure,
    meets_bar,
    prompt_vocab,
    random_prompts,
    standard_error,
)
from plait.cli import build_parser


def test_compare_counts_top1_hits_and_the_prefix_before_the_first_difference():
    reference = [[1, 2, 3, 4], [1, 2, 3, 4]]
    forced = [[1, 2, 9, 4], [1, 2, 3, 4]]  # 7 of 8 positions
    greedy = [[1, 9, 3, 4], [1, 2, 3, 4]]  # a difference at index 1 (a later match does not count), then exact
    got = compare(reference, forced, greedy)
    assert got == Agreement(teacher_forced=7 / 8, greedy_prefix=(1 / 4 + 1) / 2, positions=8, prompts=2,
                            greedy_exact=0.5)


def test_compare_refuses_rows_of_another_length_than_the_reference():
    with pytest.raises(ValueError, match="rows of 3 and 4 tokens for a reference of 4"):
        compare([[1, 2, 3, 4]], [[1, 2, 3]], [[1, 2, 3, 4]])


def test_meets_bar_allows_two_standard_errors_below_the_peer_and_no_more():
    peer = Agreement(teacher_forced=0.99, greedy_prefix=0.8, positions=2048, prompts=32, greedy_exact=0.5)
    tf_slack = 2 * standard_error(0.99, 2048)
    within = Agreement(0.99 - 0.9 * tf_slack, 0.8, 2048, 32, 0.5)
    below = Agreement(0.99 - 1.1 * tf_slack, 0.8, 2048, 32, 0.5)
    greedy_below = Agreement(1.0, 0.8 - 2.2 * standard_error(0.8, 32), 2048, 32, 0.5)
    assert meets_bar(within, peer) and not meets_bar(below, peer) and not meets_bar(greedy_below, peer)


def test_plait_in_float32_agrees_with_the_float32_reference_at_every_position(tiny_model_dir):
    # Same precision as the reference: the teacher-forced scoring (prompt-token top logprobs, also over a
    # prefix the greedy run left in the radix cache) and the decode steps must both reproduce it.
    model_dir = str(tiny_model_dir("llama"))
    prompts = random_prompts(4, 8, prompt_vocab(model_dir), seed=1)
    result = measure(model_dir, "cpu", prompts, 12, dtype="float32", max_total_tokens=4096)
    full = Agreement(1.0, 1.0, 48, 4, 1.0)
    assert result["plait"] == full and result["transformers"] == full and result["meets_bar"]


def test_bench_agreement_writes_both_runs_and_the_verdict(tiny_model_dir, tmp_path):
    args = build_parser().parse_args(["bench", "agreement", "--model", str(tiny_model_dir("llama")),
                                      "--num-prompts", "2", "--prompt-len", "6", "--new-tokens", "5",
                                      "--out", str(tmp_path)])
    rc = args.func(args)
    (file,) = tmp_path.glob("*-bf16-agreement-*.json")
    record = json.loads(file.read_text())
    assert record["metric"] == "teacher_forced_top1_agreement" and record["peer_name"] == "transformers bfloat16"
    assert record["plait"] == record["plait_detail"]["teacher_forced"]
    assert record["peer"] == record["peer_detail"]["teacher_forced"]
    assert record["plait_detail"]["positions"] == 10 and record["peer_detail"]["prompts"] == 2
    assert rc == (0 if record["meets_bar"] else 1)
