"""Two-batch overlap under DP attention on two GPUs (nvidia-h200-x2), fp32 tiny models, CUDA graphs
on: decode graphs captured as two micro-batches (each one's MLP exchange recorded on its own rows),
eager prefill rounds split on both ranks (verify graphs run whole); greedy output equals one GPU's, through the
symmetric-memory row exchange and through NCCL's asynchronous gather / reduce-scatter; every KV slot
is free on both ranks afterwards."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

from plait.testing import make_tiny_model  # noqa: E402
from tests.distributed.test_spec_data_parallel import NGRAM_CHAIN  # noqa: E402
from tests.helpers import assert_no_leaks_on_every_dp_rank, make_engine, prompt_ids  # noqa: E402

GREEDY = {"temperature": 0.0, "max_new_tokens": 24}
PROMPTS = prompt_ids(12)
DP2_TBO = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "device": "cuda", "dtype": "float32",
           "enable_two_batch_overlap": True, "tbo_min_split_tokens": 1, "chunked_prefill_size": 32}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("target"), "llama", seed=0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def reference(target):
    with make_engine(target, device="cuda", dtype="float32") as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _split_counts(engine):
    backend = engine.runner.attn_backend
    return getattr(backend, "inner", backend).split_counts


@pytest.mark.parametrize("rows", ["copy_engine", "nccl"])
def test_dp_attention_two_batch_overlap_keeps_one_gpus_tokens(target, reference, rows):
    flags = {"disable_copy_engine_rows": rows == "nccl"}
    with make_engine(target, **DP2_TBO, **flags) as engine:
        graphs = engine.runner.graph_runner
        assert graphs is not None and graphs.capture_batches[2].tbo_children is not None
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        assert sum(g.replays for g in graphs.graphs.values()) > 0
        assert _split_counts(engine)["EXTEND"] > 0
        assert len(engine.runner.count_sync.split_rounds) > 0
        assert_no_leaks_on_every_dp_rank(engine)


def test_dp_attention_two_batch_overlap_with_ngram_verify_keeps_one_gpus_tokens(target, reference):
    with make_engine(target, **DP2_TBO, **NGRAM_CHAIN) as engine:
        for _ in range(2):  # the second round drafts from the first one's answers
            assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        assert_no_leaks_on_every_dp_rank(engine)
