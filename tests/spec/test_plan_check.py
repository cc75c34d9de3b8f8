"""PLAIT_CHECK_PLANS=1 (on for every test in tests/spec, see conftest.py): forwards on the right
plan pass silently; a pre-planned batch left unmarked and a plan made before padding both raise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plait.attention.hybrid import serving_attention_backend
from plait.attention.plan_check import PlanCheckingBackend, PlanMismatchError
from plait.forward_batch import ForwardMode
from plait.speculative.tree import DraftTree
from tests.helpers import make_engine
from tests.test_forward_batch_plan import make_batch


@pytest.fixture
def verify_setup(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), speculative_algorithm="NGRAM")
    runner = engine.runner
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(7)
    runner.req_to_token_pool.write(row, 0, slots[:4])  # a 4-token prefix; its KV values do not matter
    req = SimpleNamespace(kv_len=4, req_pool_idx=row)
    tree = DraftTree([5, 6, 7], [-1, 0, 0])

    def batch():
        return engine.scheduler.spec_worker.build_verify_batch([req], [tree], slots[4:7])

    return runner, batch


def test_the_checker_wraps_the_backend_and_keeps_its_name(verify_setup):
    runner, _ = verify_setup
    assert isinstance(runner.attn_backend, PlanCheckingBackend)
    assert runner.attn_backend.name == runner.attn_backend.inner.name == "torch_native"


def test_a_checked_hybrid_runner_reports_the_halves_serving_backend_answers(one_layer):
    """The checker wraps the hybrid: serving_attention_backend still answers each half, and the name
    the runner reports (what /v1/models and /server_info show) is built from those answers."""
    pytest.importorskip("triton")
    with make_engine(one_layer, decode_attention_backend="triton") as engine:
        backend = engine.runner.attn_backend
        assert isinstance(backend, PlanCheckingBackend)
        fb = make_batch()
        decode = serving_attention_backend(backend, fb)
        fb.forward_mode = ForwardMode.EXTEND
        prefill = serving_attention_backend(backend, fb)
        assert (prefill.name, decode.name) == ("torch_native", "triton")
        assert engine.runner.info()["attention_backend"] == f"hybrid(prefill={prefill.name},decode={decode.name})"


def test_eager_verify_plans_inside_forward_extend_silently(verify_setup):
    runner, batch = verify_setup
    logits = runner.forward(batch()).next_token_logits
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()


def test_marked_pre_planned_verify_batch_is_not_planned_again(verify_setup):
    runner, batch = verify_setup
    fb = batch()
    runner.attn_backend.init_forward_metadata(fb)
    fb.mark_forward_metadata_ready()
    runner.forward(fb)


def test_an_unmarked_pre_planned_batch_is_caught(verify_setup):
    runner, batch = verify_setup
    fb = batch()
    runner.attn_backend.init_forward_metadata(fb)  # planned, but the site forgot to mark it
    with pytest.raises(PlanMismatchError, match="mark_forward_metadata_ready"):
        runner.forward(fb)


def test_a_plan_made_before_padding_is_caught(verify_setup):
    runner, batch = verify_setup
    fb = batch()
    runner.attn_backend.init_forward_metadata(fb)
    fb.mark_forward_metadata_ready()
    # Padding after the plan (as a DP or graph-bucket pad would) changes the token count.
    fb.input_ids = torch.cat([fb.input_ids, fb.input_ids[:1]])
    fb.positions = torch.cat([fb.positions, fb.positions[:1]])
    fb.out_cache_loc = torch.cat([fb.out_cache_loc, torch.zeros_like(fb.out_cache_loc[:1])])
    with pytest.raises(PlanMismatchError):
        runner.forward(fb)
