"""Sliding-window attention (Mistral's model-wide window; Qwen2's per-layer ``layer_types``) against
transformers, on torch_native and on triton under the interpreter, with prompts longer than the
window and a cached-prefix extend."""

from __future__ import annotations

import pytest

from plait.testing import make_tiny_model
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(4, seed=21)  # lengths 3..12, plus a long one below
WINDOW = 6


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    root = tmp_path_factory.mktemp("sw")
    return {
        "mistral": make_tiny_model(root / "mistral", "mistral", sliding_window=WINDOW),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", use_sliding_window=True, sliding_window=WINDOW,
                                 max_window_layers=1),
    }


@pytest.fixture(scope="module")
def references(windowed, hf_reference):
    prompts = PROMPTS + [prompt_ids(7, seed=3)[6]]  # 31 tokens: five windows
    return {arch: (prompts, [hf_reference(path, p, 24) for p in prompts]) for arch, path in windowed.items()}


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_windowed_model_greedy_equals_transformers_on_torch_native(arch, windowed, references):
    prompts, refs = references[arch]
    assert all(r.min_margin > 1e-4 for r in refs)
    engine = make_engine(windowed[arch])
    outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 24})
    assert [o.token_ids for o in outs] == [r.tokens for r in refs]
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_windowed_model_greedy_equals_transformers_on_triton(arch, windowed, references):
    pytest.importorskip("triton")
    prompts, refs = references[arch]
    # The interpreter is slow: a short and the long prompt, 12 tokens each.
    engine = make_engine(windowed[arch], attention_backend="triton")
    outs = engine.generate(prompts[-2:], {**GREEDY, "max_new_tokens": 12})
    assert [o.token_ids for o in outs] == [r.tokens[:12] for r in refs[-2:]]


def test_windowed_model_with_prefix_cache_and_chunking_equals_transformers(windowed, references):
    prompts, refs = references["mistral"]
    engine = make_engine(windowed["mistral"], chunked_prefill_size=5)
    engine.generate(prompts, {**GREEDY, "max_new_tokens": 24})
    again = engine.generate(prompts, {**GREEDY, "max_new_tokens": 24})
    assert all(o.meta_info["cached_tokens"] > 0 for o in again)
    assert [o.token_ids for o in again] == [r.tokens for r in refs]
