"""Setting only ``--prefill-attention-backend`` or only ``--decode-attention-backend`` (the base left at
``auto``: ``torch_native`` on the CPU) reaches every decision of ``plait.attention.decisions`` with the
half it needs (seed 004: SGLang read the base field in such places). One test per decision."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("triton")

from plait.attention.decisions import DECISION_MODULES  # noqa: E402
from plait.attention.hybrid import HybridAttnBackend  # noqa: E402
from plait.executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from plait.executor.graph_utils import EagerGraph, capture_batch_sizes  # noqa: E402
from plait.executor.verify_graph_runner import VerifyGraphRunner  # noqa: E402
from tests.helpers import make_engine, prompt_ids  # noqa: E402

ONLY_PREFILL = {"prefill_attention_backend": "triton"}  # decode half: auto -> torch_native
ONLY_DECODE = {"decode_attention_backend": "triton"}  # prefill half: auto -> torch_native


def test_every_decision_module_has_a_test_here():
    covered = {"plait.executor.model_runner", "plait.executor.cuda_graph_runner", "plait.executor.verify_graph_runner",
               "plait.attention.registry", "plait.attention.hybrid", "plait.layers.radix_attention",
               "plait.speculative.draft_backend"}
    assert set(DECISION_MODULES) == covered


@pytest.mark.parametrize(("flags", "pair"), [(ONLY_PREFILL, ("triton", "torch_native")),
                                             (ONLY_DECODE, ("torch_native", "triton"))])
def test_runner_builds_and_logs_the_pair(one_layer, caplog, flags, pair):
    """model_runner + registry + hybrid: the built halves and the name logged at start."""
    with caplog.at_level(logging.INFO, logger="plait.executor.model_runner"):
        engine = make_engine(one_layer, **flags)
    backend = engine.runner.attn_backend
    assert isinstance(backend, HybridAttnBackend)
    assert (backend.prefill_backend.name, backend.decode_backend.name) == pair
    assert f"hybrid(prefill={pair[0]},decode={pair[1]})" in caplog.text


def test_decode_graphs_follow_the_decode_half(one_layer):
    """cuda_graph_runner: graphs are built when the decode half can run them, whatever the prefill half."""
    with_triton_decode = make_engine(one_layer, **ONLY_DECODE)
    graphs = CudaGraphRunner(with_triton_decode.runner.capture_target(), capture_batch_sizes(2),
                             graph_factory=EagerGraph)
    decode_half = with_triton_decode.runner.attn_backend.decode_backend
    assert graphs.fill_value == decode_half.get_cuda_graph_seq_len_fill_value()
    with_native_decode = make_engine(one_layer, **ONLY_PREFILL)
    with pytest.raises(RuntimeError, match="cannot run under CUDA graphs"):
        CudaGraphRunner(with_native_decode.runner.capture_target(), capture_batch_sizes(2), graph_factory=EagerGraph)


@pytest.mark.parametrize(("spec_mode", "flags", "ok"), [
    ("decode", ONLY_DECODE, True),  # verify on the decode half: triton
    ("prefill", ONLY_DECODE, False),  # verify on the prefill half: torch_native, no graphs
    ("prefill", ONLY_PREFILL, False),  # the decode half (torch_native) holds graph state in any mode
    ("decode", ONLY_PREFILL, False),
])
def test_verify_graphs_follow_the_half_the_speculative_mode_selects(one_layer, spec_mode, flags, ok):
    """verify_graph_runner: graph state on the half that serves TARGET_VERIFY, and on the decode half."""
    engine = make_engine(one_layer, **flags, speculative_algorithm="NGRAM", speculative_attention_mode=spec_mode)
    if ok:
        runner = VerifyGraphRunner(engine.runner.capture_target(), capture_batch_sizes(2), [2, 3],
                                   graph_factory=EagerGraph)
        assert runner.widths == [2, 3]
    else:
        with pytest.raises(RuntimeError, match="cannot run under CUDA graphs"):
            VerifyGraphRunner(engine.runner.capture_target(), capture_batch_sizes(2), [2, 3], graph_factory=EagerGraph)


@pytest.mark.parametrize(("flags", "extend_stores", "decode_stores"), [
    (ONLY_PREFILL, False, True),  # triton prefill: the rotary kernel writes; native decode stores itself
    (ONLY_DECODE, True, False),
    ({"attention_backend": "triton"}, False, False),
    ({"attention_backend": "torch_native"}, True, True),
])
def test_kv_write_path_follows_the_serving_half(one_layer, flags, extend_stores, decode_stores):
    """radix_attention: the backend stores K/V itself unless its serving half stores them plainly."""
    engine = make_engine(one_layer, **flags)
    backend = engine.runner.attn_backend
    seen: dict[str, bool] = {}
    inner = backend.forward

    def spy(q, k, v, layer, fb, save_kv_cache=True):
        seen[fb.forward_mode.name] = save_kv_cache
        return inner(q, k, v, layer, fb, save_kv_cache)

    backend.forward = spy
    engine.generate(prompt_ids(1)[0], {"temperature": 0.0, "max_new_tokens": 3})
    assert seen == {"EXTEND": extend_stores, "DECODE": decode_stores}


@pytest.mark.parametrize(("flags", "spec_mode", "draft_half"), [
    (ONLY_PREFILL, "prefill", "triton"),
    (ONLY_DECODE, "prefill", "torch_native"),
    (ONLY_PREFILL, "decode", "torch_native"),
    (ONLY_DECODE, "decode", "triton"),
])
def test_standalone_draft_runs_on_the_half_the_speculative_mode_names(one_layer, flags, spec_mode, draft_half):
    """speculative.draft_backend (EAGLE and STANDALONE build through it): the draft's decode steps and
    extends run on the half ``speculative_attention_mode`` names."""
    engine = make_engine(one_layer, **flags, speculative_algorithm="STANDALONE", speculative_attention_mode=spec_mode,
                         speculative_draft_model_path=str(one_layer))
    worker = engine.scheduler.spec_worker
    assert worker.decode_backend.name == draft_half and worker.extend_backend.name == draft_half
