"""Speculative decoding with DP attention on two GPUs (nvidia-h200-x2), fp32 tiny models: NGRAM and
STANDALONE verify rounds replay the DP verify graphs (captured at the one padded width, MAX_LEN steps
of their bucket on both ranks, an idle rank on padding requests); greedy output equals one GPU's
non-speculative output; every KV slot is free on both ranks afterwards."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

from plait.testing import make_tiny_model  # noqa: E402
from tests.distributed.test_spec_data_parallel import DRAFT_TREE, NGRAM_CHAIN, PROMPTS  # noqa: E402
from tests.helpers import assert_no_leaks, make_engine  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
DP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "device": "cuda", "dtype": "float32"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def reference(target):
    with make_engine(target, device="cuda", dtype="float32") as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _verify_replays(engine) -> int:
    return sum(g.replays for g in engine.runner.verify_graph_runner.graphs.values())


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_dp_attention_speculation_replays_verify_graphs(target, reference, tmp_path, algo):
    flags = dict(NGRAM_CHAIN)
    if algo == "STANDALONE":
        draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
        flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft), **DRAFT_TREE}
    with make_engine(target, **DP2, **flags) as engine:
        for _ in range(2):  # the second round: radix hits, n-gram drafts from the first answers
            assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        assert _verify_replays(engine) > 0
        assert_no_leaks(engine)
        for _ in range(2):
            engine.scheduler.step()
        assert engine.scheduler.remote_kv_tokens_in_use == {1: 0}
