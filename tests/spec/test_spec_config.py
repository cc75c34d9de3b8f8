"""Speculative flags: SGLang's names on EngineConfig and the CLI, defaults per algorithm, and bad
combinations rejected at construction with a message naming the flag to change."""

from __future__ import annotations

import pytest

from plait.cli import build_parser
from plait.config import EngineConfig


def test_chain_defaults_are_three_steps_topk_one_and_four_draft_tokens():
    cfg = EngineConfig.from_kwargs(model="m", speculative_algorithm="NGRAM")
    assert (cfg.speculative_num_steps, cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens) == (3, 1, 4)
    assert cfg.speculative_attention_mode == "prefill"


def test_a_tree_may_use_fewer_nodes_than_steps_times_topk():
    cfg = EngineConfig(model="m", speculative_algorithm="NGRAM", speculative_num_steps=3,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    assert cfg.speculative_num_draft_tokens == 6


def test_speculation_off_leaves_the_fields_unset():
    cfg = EngineConfig(model="m")
    assert cfg.speculative_algorithm is None and cfg.speculative_num_steps is None


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"speculative_algorithm": "MEDUSA"}, "--speculative-algorithm"),
    ({"speculative_num_steps": 2}, "--speculative-algorithm"),
    ({"speculative_algorithm": "STANDALONE"}, "--speculative-draft-model-path"),
    ({"speculative_algorithm": "EAGLE3"}, "--speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/d"}, "--speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6}, "--speculative-num-draft-tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1, "speculative_eagle_topk": 2},
     "--speculative-num-draft-tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 9},
     "--speculative-num-draft-tokens"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 0}, "--speculative-num-steps"),
    ({"speculative_algorithm": "NGRAM", "tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
     "--enable-dp-attention"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 0}, "--speculative-eagle-topk"),
    ({"speculative_algorithm": "NGRAM", "speculative_attention_mode": "both"}, "--speculative-attention-mode"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_attention_backend": "flashinfer"},
     "--speculative-draft-attention-backend"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 5},
     "--speculative-ngram-min-match-window-size"),
])
@pytest.mark.parametrize("build", [EngineConfig, EngineConfig.from_kwargs], ids=["init", "from_kwargs"])
def test_bad_combinations_fail_naming_the_flag(kwargs, flag, build):
    with pytest.raises(ValueError, match=flag):
        build(model="m", **kwargs)


def test_the_cli_takes_the_flags_from_the_config_fields():
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path",
        "/d", "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens",
        "3", "--speculative-attention-mode", "decode", "--speculative-draft-attention-backend", "torch_native"])
    assert args.speculative_algorithm == "STANDALONE" and args.speculative_num_steps == 2
    assert args.speculative_attention_mode == "decode" and args.speculative_draft_attention_backend == "torch_native"


def test_a_missing_draft_checkpoint_fails_at_engine_start_naming_the_flag(tiny_model_dir, tmp_path):
    from tests.helpers import make_engine

    with pytest.raises(ValueError, match="--speculative-draft-model-path"):
        make_engine(tiny_model_dir("llama"), speculative_algorithm="EAGLE",
                    speculative_draft_model_path=str(tmp_path / "nothing-here"))
