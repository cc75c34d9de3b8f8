"""One short run per algorithm with attention_backend="triton" under the Triton interpreter: the
TARGET_VERIFY forward goes through the Triton decode kernel as one row per verify token (its KV list
built from the prefix and the custom tree mask), the draft steps through the Triton decode kernel,
pre-planned per step (PLAIT_CHECK_PLANS on)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from plait.testing import make_tiny_model  # noqa: E402
from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

PROMPTS = prompt_ids(3)[:2]
SHORT = {"temperature": 0.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def reference(one_layer):
    return [o.token_ids for o in make_engine(one_layer).generate(PROMPTS, SHORT)]


def test_ngram_tree_on_triton(one_layer, reference):
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="NGRAM",
                         speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
        engine.scheduler.spec_worker.drafter.cache.insert(p + [t + 1 for t in ref])  # a wrong sibling
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


def test_standalone_chain_on_triton(one_layer, reference):
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="STANDALONE",
                         speculative_draft_model_path=str(one_layer))
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.accept_histogram[3] > 0
    assert engine.scheduler.spec_worker.decode_backend.name == "triton"
    assert_no_leaks(engine)


def test_standalone_tree_on_triton(one_layer, reference):
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="STANDALONE",
                         speculative_draft_model_path=str(one_layer), speculative_num_steps=2,
                         speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.accept_histogram[2] > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_eagle_heads_on_triton(tmp_path_factory, one_layer, reference, fmt):
    from plait.testing import make_eagle_head

    # EAGLE3 captures target layers [2, L//2, L-3]: the shortest target it accepts has 3 layers. EAGLE
    # reads the final hidden state only: the 1-layer model.
    if fmt == "EAGLE3":
        target = make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)
        reference = [o.token_ids for o in make_engine(target).generate(PROMPTS, SHORT)]
    else:
        target = one_layer
    head = make_eagle_head(tmp_path_factory.mktemp(fmt), target, fmt)
    engine = make_engine(target, attention_backend="triton", speculative_algorithm=fmt,
                         speculative_draft_model_path=str(head))
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)
