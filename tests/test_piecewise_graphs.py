"""Piecewise (breakable) graphs for EXTEND and MIXED steps, on the CPU.

Under ``PLAIT_CPU_GRAPHS=1`` the runner captures over ``EagerBreakableGraph``: capture records every
attention call as a step over static buffers, replay re-runs the forward over the static (padded)
buffers and runs the recorded steps eagerly on the live batch's plan. So the bucket choice, padding,
staging, step bookkeeping, eager LM head and fallbacks run here; only the CUDA graph objects do not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.config import EngineConfig
from plait.executor.graph_utils import bucket_for
from plait.executor.piecewise_graph_runner import (
    EagerBreakableGraph,
    PiecewiseCudaGraphRunner,
    piecewise_token_buckets,
)
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT
from tests.conftest import hf_model
from tests.helpers import assert_no_leaks, make_engine, record_cuda_graph_calls

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}
MAX_TOKENS = 64


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, 400, (n,), generator=gen).tolist()


# One prompt per bucket of MAX_TOKENS = 64 (16, 32, 64) and one above it (eager).
PER_BUCKET = [_prompt(5, 1), _prompt(21, 2), _prompt(40, 3)]
ABOVE_MAX = _prompt(85, 4)


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", "1")


def piecewise_engine(path, **options):
    """An engine with piecewise graphs over the eager stand-in; decode graphs off unless asked (the
    CPU's torch_native backend has none), so the tests stay fast."""
    options.setdefault("disable_cuda_graph", True)
    options.setdefault("max_total_tokens", 2048)
    options.setdefault("piecewise_cuda_graph_max_tokens", MAX_TOKENS)
    return make_engine(path, enable_piecewise_cuda_graph=True, **options)


# --- buckets, padding, config ---------------------------------------------------------------------
def test_token_buckets_are_powers_of_two_from_16_then_the_max():
    assert piecewise_token_buckets(64) == [16, 32, 64]
    assert piecewise_token_buckets(100) == [16, 32, 64, 100]
    assert piecewise_token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert piecewise_token_buckets(10) == [10]
    buckets = piecewise_token_buckets(100)
    assert [bucket_for(buckets, n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]


def test_config_rejects_a_max_token_count_below_one(tiny_model_dir):
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens must be >= 1"):
        EngineConfig(model=str(tiny_model_dir("llama")), piecewise_cuda_graph_max_tokens=0)


def test_config_rejects_a_max_above_the_largest_mixed_step_when_enabled(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=r"piecewise_cuda_graph_max_tokens \(64\) must be <= chunked_prefill_size "
                                         r"\+ max_running_requests \(40\).*lower --piecewise-cuda-graph-max-tokens"):
        EngineConfig(model=path, enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=64,
                     chunked_prefill_size=32, max_running_requests=8)
    # Off (the default), the maximum is not checked against the chunk size.
    EngineConfig(model=path, piecewise_cuda_graph_max_tokens=64, chunked_prefill_size=32, max_running_requests=8)


def test_config_accepts_a_max_that_covers_a_chunk_and_every_running_request(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir("llama")), enable_piecewise_cuda_graph=True,
                          piecewise_cuda_graph_max_tokens=40, chunked_prefill_size=32, max_running_requests=8)
    assert config.piecewise_cuda_graph_max_tokens == 40


def test_config_rejects_piecewise_graphs_with_the_all_to_all_moe_dispatch(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-piecewise-cuda-graph does not run with --moe-a2a-backend"):
        EngineConfig(model=str(tiny_model_dir("llama")), enable_piecewise_cuda_graph=True, tp_size=2, ep_size=2,
                     moe_a2a_backend="all_to_all")


def test_config_rejects_piecewise_graphs_with_dp_attention(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-piecewise-cuda-graph does not run with --enable-dp-attention"):
        EngineConfig(model=str(tiny_model_dir("llama")), enable_piecewise_cuda_graph=True, tp_size=2, dp_size=2,
                     enable_dp_attention=True)


def test_config_rejects_piecewise_graphs_with_two_batch_overlap(tiny_model_dir):
    with pytest.raises(ValueError, match="--enable-piecewise-cuda-graph does not run with --enable-two-batch-overlap"):
        EngineConfig(model=str(tiny_model_dir("llama")), enable_piecewise_cuda_graph=True,
                     enable_two_batch_overlap=True)


def test_the_piecewise_switch_turns_graphs_on_where_the_other_options_allow_and_never_overrides_a_choice(
        monkeypatch):
    monkeypatch.setenv("PLAIT_PIECEWISE_CUDA_GRAPH", "1")
    assert EngineConfig.from_kwargs(model="x").enable_piecewise_cuda_graph is True
    assert EngineConfig.from_kwargs(model="x", enable_piecewise_cuda_graph=False).enable_piecewise_cuda_graph is False
    # Where EngineConfig would refuse piecewise graphs, the switch leaves them off instead of failing.
    assert not EngineConfig.from_kwargs(model="x", tp_size=2, dp_size=2, enable_dp_attention=True
                                        ).enable_piecewise_cuda_graph
    assert not EngineConfig.from_kwargs(model="x", enable_two_batch_overlap=True).enable_piecewise_cuda_graph
    assert not EngineConfig.from_kwargs(model="x", chunked_prefill_size=512).enable_piecewise_cuda_graph
    monkeypatch.setenv("PLAIT_PIECEWISE_CUDA_GRAPH", "")
    assert EngineConfig.from_kwargs(model="x").enable_piecewise_cuda_graph is False


def test_piecewise_graphs_are_off_by_default(tiny_model_dir, cpu_graphs):
    assert EngineConfig(model="x").enable_piecewise_cuda_graph is False
    with make_engine(tiny_model_dir("llama"), disable_cuda_graph=True, max_total_tokens=256) as engine:
        assert engine.runner.piecewise_runner is None


def test_capture_records_one_step_per_layer_over_shared_static_buffers(tiny_model_dir, cpu_graphs):
    with piecewise_engine(tiny_model_dir("llama")) as engine:
        runner = engine.runner.piecewise_runner
        layers = engine.runner.model_config.num_layers
        assert sorted(runner.graphs) == [16, 32, 64]
        for tokens, graph in runner.graphs.items():
            assert isinstance(graph, EagerBreakableGraph)
            assert len(graph.steps) == layers and graph.num_segments == layers + 1
            assert [s.layer.layer_id for s in graph.steps] == list(range(layers))
            assert runner.outputs[tokens].shape[0] == tokens
            for step in graph.steps:
                assert step.q.shape[0] == step.out.shape[0] == tokens
        # Every bucket's and layer's q (and out) are views of one buffer: steps run one at a time.
        qs = {s.q.data_ptr() for g in runner.graphs.values() for s in g.steps}
        outs = {s.out.data_ptr() for g in runner.graphs.values() for s in g.steps}
        assert len(qs) == 1 and len(outs) == 1


def test_replay_pads_inputs_to_the_bucket_with_the_dummy_slot(tiny_model_dir, cpu_graphs):
    with piecewise_engine(tiny_model_dir("llama")) as engine:
        runner = engine.runner.piecewise_runner
        engine.generate([PER_BUCKET[1]], {"temperature": 0.0, "max_new_tokens": 1})
        assert runner.replays == {32: 1}
        n = len(PER_BUCKET[1])
        assert runner.input_ids[:n].tolist() == PER_BUCKET[1]
        assert runner.positions[:n].tolist() == list(range(n))
        assert (runner.input_ids[n:32] == 0).all() and (runner.positions[n:32] == 0).all()
        assert (runner.out_cache_loc[n:32] == DUMMY_KV_SLOT).all()
        assert not (runner.out_cache_loc[:n] == DUMMY_KV_SLOT).any()
        assert_no_leaks(engine)


# --- fallbacks ------------------------------------------------------------------------------------
def _batch(mode: ForwardMode, tokens: int) -> ForwardBatch:
    z = torch.zeros(tokens, dtype=torch.long)
    return ForwardBatch(forward_mode=mode, batch_size=1, input_ids=z, req_pool_indices=z[:1], seq_lens=z[:1],
                        out_cache_loc=z, positions=z)


def test_fallback_reasons_name_what_the_graphs_do_not_cover(tiny_model_dir, cpu_graphs):
    with piecewise_engine(tiny_model_dir("llama")) as engine:
        runner = engine.runner.piecewise_runner
        assert runner.fallback_reason(_batch(ForwardMode.EXTEND, 64)) is None
        assert runner.fallback_reason(_batch(ForwardMode.MIXED, 3)) is None
        assert runner.fallback_reason(_batch(ForwardMode.EXTEND, 65)) == \
            "65 tokens > --piecewise-cuda-graph-max-tokens 64"
        assert "DECODE" in runner.fallback_reason(_batch(ForwardMode.DECODE, 1))
        assert "TARGET_VERIFY" in runner.fallback_reason(_batch(ForwardMode.TARGET_VERIFY, 8))
        spec = _batch(ForwardMode.EXTEND, 8)
        spec.spec_info = object()
        assert "speculative" in runner.fallback_reason(spec)
        tbo = _batch(ForwardMode.EXTEND, 8)
        tbo.tbo_children = (tbo, tbo)
        assert "two-batch overlap" in runner.fallback_reason(tbo)
        dp = _batch(ForwardMode.EXTEND, 8)
        dp.mlp_sync.global_num_tokens_cpu = [8, 8]
        assert "DP attention" in runner.fallback_reason(dp)
        assert runner.fallback_reason(_batch(ForwardMode.EXTEND, 0)) == "no tokens"
        # An EAGLE target writes hidden states for its draft: the static batches have no capture.
        eagle = PiecewiseCudaGraphRunner(dataclasses.replace(engine.runner.capture_target(), hidden_capture=object()),
                                         16, EagerBreakableGraph)
        assert "hidden-state capture" in eagle.fallback_reason(_batch(ForwardMode.EXTEND, 8))


# --- correctness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_equal_transformers_in_every_bucket_and_above_the_max(arch, tiny_model_dir, cpu_graphs,
                                                                             hf_reference):
    path = tiny_model_dir(arch)
    with piecewise_engine(path) as engine:
        runner = engine.runner.piecewise_runner
        outs = [engine.generate([p], GREEDY)[0].token_ids for p in [*PER_BUCKET, ABOVE_MAX]]
        assert runner.replays == {16: 1, 32: 1, 64: 1}
        assert runner.fallbacks == {"85 tokens > --piecewise-cuda-graph-max-tokens 64": 1}
        assert_no_leaks(engine)
    for p, out in zip([*PER_BUCKET, ABOVE_MAX], outs, strict=True):
        assert out == hf_reference(path, p, GREEDY["max_new_tokens"]).tokens


def test_prefill_logits_equal_the_eager_path_and_transformers(tiny_model_dir, cpu_graphs, hf_reference):
    path = tiny_model_dir("llama")

    def prefill_logits(**options):
        seen: dict[str, torch.Tensor] = {}

        def record(reqs, logits):
            for req, row in zip(reqs, logits, strict=True):
                seen.setdefault(req.rid, row.clone())

        with make_engine(path, disable_cuda_graph=True, max_total_tokens=2048, **options) as engine:
            engine.scheduler.on_logits = record
            outs = engine.generate(PER_BUCKET, {"temperature": 0.0, "max_new_tokens": 1})
            replays = engine.runner.piecewise_runner.replays if engine.runner.piecewise_runner else None
        return torch.stack([seen[o.rid] for o in outs]), replays

    on, replays = prefill_logits(enable_piecewise_cuda_graph=True, piecewise_cuda_graph_max_tokens=MAX_TOKENS * 2)
    off, _ = prefill_logits()
    assert replays == {128: 1}  # the three prompts (66 tokens) as one batched prefill
    torch.testing.assert_close(on, off, atol=1e-5, rtol=1e-5)
    ref = torch.stack([hf_reference(path, p, 1).logits[0] for p in PER_BUCKET])
    torch.testing.assert_close(on, ref, atol=1e-4, rtol=1e-4)


def test_batched_prefill_equals_the_eager_path(tiny_model_dir, cpu_graphs):
    path = tiny_model_dir("llama")
    prompts = [_prompt(n, 10 + n) for n in (3, 9, 14, 30)]  # 56 tokens: one step, bucket 64
    with make_engine(path, disable_cuda_graph=True, max_total_tokens=2048) as eager:
        want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    with piecewise_engine(path) as engine:
        got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        assert engine.runner.piecewise_runner.replays[64] >= 1
        assert_no_leaks(engine)
    assert got == want


def test_chunked_prefill_and_mixed_steps_equal_transformers(tiny_model_dir, cpu_graphs, hf_reference):
    """A 70-token prompt in chunks of 32 (each later chunk extends over the cached earlier ones) while
    a short request decodes beside it: a chunk that fits runs as a MIXED step under the graphs."""
    path = tiny_model_dir("llama")
    prompts = [_prompt(4, 20), _prompt(70, 21)]
    with piecewise_engine(path, chunked_prefill_size=32, piecewise_cuda_graph_max_tokens=32) as engine:
        outs = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        modes = engine.runner.piecewise_runner.replayed_modes
        assert modes[ForwardMode.MIXED] >= 1, modes
        # A full 32-token chunk beside a decode row is 33 tokens: over the largest bucket, eager.
        assert set(engine.runner.piecewise_runner.fallbacks) <= {"33 tokens > --piecewise-cuda-graph-max-tokens 32"}
        assert_no_leaks(engine)
    for p, out in zip(prompts, outs, strict=True):
        assert out == hf_reference(path, p, GREEDY["max_new_tokens"]).tokens


def test_a_full_chunk_beside_decode_rows_replays_when_the_max_covers_them(tiny_model_dir, cpu_graphs, hf_reference):
    """With the maximum at chunk + running requests, the MIXED step of a full 32-token chunk and a decode
    row (33 tokens) replays the largest bucket instead of falling back to eager."""
    path = tiny_model_dir("llama")
    prompts = [_prompt(4, 20), _prompt(70, 21)]
    with piecewise_engine(path, chunked_prefill_size=32, max_running_requests=8,
                          piecewise_cuda_graph_max_tokens=40) as engine:
        outs = [o.token_ids for o in engine.generate(prompts, GREEDY)]
        runner = engine.runner.piecewise_runner
        assert runner.replays[40] >= 1 and runner.replayed_modes[ForwardMode.MIXED] >= 1
        assert not runner.fallbacks
        assert_no_leaks(engine)
    for p, out in zip(prompts, outs, strict=True):
        assert out == hf_reference(path, p, GREEDY["max_new_tokens"]).tokens


def test_extend_over_a_radix_cache_hit_equals_transformers(tiny_model_dir, cpu_graphs, hf_reference):
    path = tiny_model_dir("llama")
    first = PER_BUCKET[2]
    second = first[:32] + _prompt(9, 30)  # a 32-token cached prefix, 9 new tokens: bucket 16
    with piecewise_engine(path) as engine:
        runner = engine.runner.piecewise_runner
        engine.generate([first], GREEDY)
        out = engine.generate([second], GREEDY)[0]
        assert out.meta_info["cached_tokens"] >= 16
        assert runner.replays == {64: 1, 16: 1}
        assert_no_leaks(engine)
    assert out.token_ids == hf_reference(path, second, GREEDY["max_new_tokens"]).tokens


def test_moe_greedy_tokens_equal_the_eager_path(tiny_model_dir, cpu_graphs):
    path = tiny_model_dir("qwen3-moe")
    prompts = [PER_BUCKET[0], PER_BUCKET[1]]
    with make_engine(path, disable_cuda_graph=True, max_total_tokens=2048) as eager:
        want = [eager.generate([p], GREEDY)[0].token_ids for p in prompts]
    with piecewise_engine(path) as engine:
        got = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
        assert engine.runner.piecewise_runner.replays == {16: 1, 32: 1}
        assert_no_leaks(engine)
    assert got == want


def test_triton_backend_with_decode_graphs_equals_transformers(one_layer, cpu_graphs, hf_reference):
    """The Triton backend (under the interpreter) stores K/V in the rotary kernel, inside the captured
    segment, at the padded static out_cache_loc; decode graphs run beside the piecewise ones."""
    prompt = PER_BUCKET[0]
    with piecewise_engine(one_layer, attention_backend="triton", disable_cuda_graph=False, cuda_graph_max_bs=1,
                          piecewise_cuda_graph_max_tokens=16) as engine:
        out = engine.generate([prompt], GREEDY)[0].token_ids
        assert engine.runner.piecewise_runner.replays == {16: 1}
        assert engine.runner.graph_runner is not None
        assert_no_leaks(engine)
    assert out == hf_reference(one_layer, prompt, GREEDY["max_new_tokens"]).tokens


def test_prompt_logprobs_run_under_the_graphs_and_match_transformers(tiny_model_dir, cpu_graphs):
    """The LM head runs eagerly over the live batch's rows, the scored prompt rows included."""
    path = tiny_model_dir("llama")
    ids = PER_BUCKET[1]
    with piecewise_engine(path) as engine:
        out = engine.generate(ids, {**GREEDY, "max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
        assert engine.runner.piecewise_runner.replays == {32: 1}
        assert_no_leaks(engine)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
    want = torch.log_softmax(logits, dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_cuda_breakable_graph_cuts_a_segment_at_each_step_and_replays_them_interleaved(monkeypatch):
    from plait.executor import piecewise_graph_runner as pw

    log = record_cuda_graph_calls(monkeypatch)
    graph = pw.CudaBreakableGraph()
    steps = [object(), object()]

    def forward():
        log.append("segment 0 work")
        graph.split(steps[0])
        log.append("segment 1 work")
        graph.split(steps[1])
        log.append("segment 2 work")
        return torch.zeros(1)

    graph.capture(forward, pool="P")
    assert graph.steps == steps and len(graph.segments) == 3
    assert log == ["begin 0 pool=P", "segment 0 work", "end 0", "begin 1 pool=P", "segment 1 work", "end 1",
                   "begin 2 pool=P", "segment 2 work", "end 2"]
    assert graph.pool() == "P"
    log.clear()
    graph.replay(lambda i: log.append(f"step {i}"))
    assert log == ["replay 0", "step 0", "replay 1", "step 1", "replay 2"]


def test_bench_offline_and_latency_pass_the_piecewise_flags_through():
    from plait.bench.cli import backend_options, backend_tag
    from plait.cli import build_parser

    for cmd in ("offline", "latency"):
        args = build_parser().parse_args(["bench", cmd, "--enable-piecewise-cuda-graph",
                                          "--piecewise-cuda-graph-max-tokens", "1024"])
        options = backend_options(args)
        assert options == {"enable_piecewise_cuda_graph": True, "piecewise_cuda_graph_max_tokens": 1024}
        assert backend_tag(options) == "piecewise"
    assert backend_options(build_parser().parse_args(["bench", "offline"])) == {}
