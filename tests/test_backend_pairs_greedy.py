"""Greedy output is the same for every attention backend and hybrid pair (fp32, CPU; Triton under the
interpreter), for plain decoding and for speculative decoding with TARGET_VERIFY served by either
half (``speculative_attention_mode`` prefill / decode). A 1-layer tiny model keeps the interpreter
runs short."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

PROMPTS = prompt_ids(3)
SHORT = {"temperature": 0.0, "max_new_tokens": 8}
PAIRS = {
    "triton": {"attention_backend": "triton"},
    "prefill-native-decode-triton": {"prefill_attention_backend": "torch_native", "decode_attention_backend": "triton"},
    "prefill-triton-decode-native": {"prefill_attention_backend": "triton", "decode_attention_backend": "torch_native"},
}


@pytest.fixture(scope="module")
def reference(one_layer):
    return [o.token_ids for o in make_engine(one_layer, attention_backend="torch_native").generate(PROMPTS, SHORT)]


@pytest.mark.parametrize("pair", PAIRS, ids=list(PAIRS))
def test_plain_decoding_matches_torch_native(one_layer, reference, pair):
    engine = make_engine(one_layer, **PAIRS[pair])
    assert [o.token_ids for o in engine.generate(PROMPTS, SHORT)] == reference
    assert_no_leaks(engine)


@pytest.mark.parametrize("spec_mode", ["prefill", "decode"])
@pytest.mark.parametrize("pair", ["prefill-native-decode-triton", "prefill-triton-decode-native"])
def test_ngram_speculation_matches_torch_native_with_verify_on_either_half(one_layer, reference, pair, spec_mode):
    engine = make_engine(one_layer, **PAIRS[pair], speculative_algorithm="NGRAM", speculative_num_steps=3,
                         speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                         speculative_attention_mode=spec_mode)
    for p, ref in zip(PROMPTS, reference, strict=True):
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)  # the drafts will be right
    assert [o.token_ids for o in engine.generate(PROMPTS, SHORT)] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


def test_mixed_steps_with_decode_rows_through_the_decode_kernel_match_torch_native(one_layer):
    """Fourteen requests admitted a few at a time (a 16-token prefill budget): later prompts' chunks run
    as MIXED steps beside up to a dozen decode rows, which the Triton backend sends through its decode
    kernel; the tokens equal torch_native's."""
    prompts = prompt_ids(14)
    params = {"temperature": 0.0, "max_new_tokens": 12}
    want = [o.token_ids for o in make_engine(one_layer, attention_backend="torch_native",
                                             chunked_prefill_size=16).generate(prompts, params)]
    engine = make_engine(one_layer, attention_backend="triton", chunked_prefill_size=16)
    backend = engine.runner.attn_backend
    rows: list[int] = []
    plan = backend.init_forward_metadata_out_graph

    def recording(fb, in_capture=False):
        plan(fb, in_capture)
        if fb.forward_mode.is_mixed() and backend.mixed_rows_md is not None:
            rows.append(backend.mixed_rows_md.num_rows)

    backend.init_forward_metadata_out_graph = recording
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert rows and max(rows) >= 8
    assert_no_leaks(engine)
