"""The plan marker on ForwardBatch and the deprecated skip_attn_backend_init keyword."""

from __future__ import annotations

import warnings

import pytest
import torch

import plait.forward_batch as forward_batch_module
from plait.forward_batch import ForwardBatch, ForwardMode, apply_deprecated_skip_attn_backend_init


def make_batch(bs: int = 2, num_tokens: int | None = None) -> ForwardBatch:
    n = bs if num_tokens is None else num_tokens
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(n, dtype=torch.long),
        req_pool_indices=torch.arange(1, bs + 1), seq_lens=torch.ones(bs, dtype=torch.long),
        out_cache_loc=torch.arange(1, n + 1), positions=torch.zeros(n, dtype=torch.long),
    )


@pytest.fixture
def fresh_warning_state(monkeypatch):
    monkeypatch.setattr(forward_batch_module, "_warned_skip_attn_backend_init", False)


def test_fresh_batch_needs_planning():
    assert make_batch().needs_forward_metadata_init()


def test_mark_records_shapes_and_skips_planning():
    fb = make_batch(bs=3, num_tokens=5)
    fb.mark_forward_metadata_ready()
    assert not fb.needs_forward_metadata_init()
    assert (fb.forward_metadata_planned_bs, fb.forward_metadata_planned_num_tokens) == (3, 5)
    assert fb.forward_metadata_replan_equivalent is False


def test_reshape_without_opt_in_keeps_skipping():
    fb = make_batch(bs=2)
    fb.mark_forward_metadata_ready()
    fb.batch_size = 4
    fb.input_ids = torch.zeros(9, dtype=torch.long)
    assert not fb.needs_forward_metadata_init()


def test_batch_size_drift_with_opt_in_replans():
    fb = make_batch(bs=2)
    fb.mark_forward_metadata_ready(replan_equivalent=True)
    assert not fb.needs_forward_metadata_init()
    fb.batch_size = 4
    assert fb.needs_forward_metadata_init()


def test_token_count_drift_with_opt_in_replans():
    fb = make_batch(bs=2)
    fb.mark_forward_metadata_ready(replan_equivalent=True)
    fb.input_ids = torch.zeros(6, dtype=torch.long)
    assert fb.needs_forward_metadata_init()


def test_remark_re_records_padded_shapes():
    fb = make_batch(bs=2)
    fb.mark_forward_metadata_ready(replan_equivalent=True)
    fb.batch_size = 4
    assert fb.needs_forward_metadata_init()
    fb.mark_forward_metadata_ready(replan_equivalent=True)
    assert not fb.needs_forward_metadata_init()
    assert fb.forward_metadata_planned_bs == 4


def test_reset_marker_forgets_the_plan():
    fb = make_batch()
    fb.mark_forward_metadata_ready(replan_equivalent=True)
    fb.reset_forward_metadata_marker()
    assert fb.needs_forward_metadata_init()
    assert fb.forward_metadata_planned_bs is None


def test_deprecated_keyword_none_is_silent_and_does_not_mark(fresh_warning_state):
    fb = make_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_deprecated_skip_attn_backend_init(fb, None)
    assert fb.needs_forward_metadata_init()


def test_deprecated_keyword_true_marks_and_warns(fresh_warning_state):
    fb = make_batch()
    with pytest.warns(DeprecationWarning, match="skip_attn_backend_init"):
        apply_deprecated_skip_attn_backend_init(fb, True)
    assert not fb.needs_forward_metadata_init()


def test_deprecated_keyword_false_warns_and_does_not_mark(fresh_warning_state):
    fb = make_batch()
    with pytest.warns(DeprecationWarning):
        apply_deprecated_skip_attn_backend_init(fb, False)
    assert fb.needs_forward_metadata_init()


def test_deprecated_keyword_warns_once_per_process(fresh_warning_state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for value in (True, False, True):
            apply_deprecated_skip_attn_backend_init(make_batch(), value)
    assert len([w for w in caught if issubclass(w.category, DeprecationWarning)]) == 1
