"""Plain data parallelism (dp_size > 1 without DP attention): independent replicas, each with its own
model, KV cache and scheduler, behind a shortest-queue balancer. Greedy outputs must equal a single
replica's whatever replica serves a request; every call about a request goes to its replica."""

from __future__ import annotations

import pytest

from plait.config import EngineConfig
from plait.parallel.data_parallel import DataParallelRunner, DataParallelScheduler
from plait.scheduler.req import FinishReason
from tests.helpers import make_engine, prompt_ids

GREEDY12 = {"temperature": 0.0, "max_new_tokens": 12}
PROMPTS = prompt_ids(16)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    with make_engine(model, dtype="float32") as single:
        return {tuple(p): o.token_ids for p, o in zip(PROMPTS, single.generate(PROMPTS, GREEDY12), strict=True)}


@pytest.fixture(scope="module")
def dp_engine(model):
    engine = make_engine(model, dtype="float32", dp_size=2)
    yield engine
    engine.shutdown()


def assert_no_leaks_dp(engine) -> None:
    """assert_no_leaks, per replica: no KV slot, locked prefix or request-pool row held by any."""
    sched, runner = engine.scheduler, engine.runner
    assert not sched.has_work()
    assert sched.kv_tokens_in_use() == 0 and sched.tree_cache.protected_size() == 0
    for i, (rs, rr) in enumerate(zip(sched.replicas, runner.replicas, strict=True)):
        assert rs.kv_tokens_in_use() == 0, f"replica {i}: KV slots leaked"
        assert rs.tree_cache.protected_size() == 0, f"replica {i}: prefix-cache nodes still locked"
        assert rr.req_to_token_pool.available_size() == rr.req_to_token_pool.size, f"replica {i}: pool rows leaked"
    assert not sched.owner  # finished requests are forgotten by the balancer


def test_16_requests_over_both_replicas_match_a_single_replica(dp_engine, reference):
    sched = dp_engine.scheduler
    assert isinstance(sched, DataParallelScheduler) and isinstance(dp_engine.runner, DataParallelRunner)
    assert len(sched.replicas) == 2 and sched.replicas[0].runner is not sched.replicas[1].runner
    assigned = dict(sched.assigned)
    out = [o.token_ids for o in dp_engine.generate(PROMPTS, GREEDY12)]
    assert out == [reference[tuple(p)] for p in PROMPTS]
    spread = {i: sched.assigned[i] - assigned.get(i, 0) for i in (0, 1)}
    assert spread == {0: 8, 1: 8}  # shortest queue alternates between equally loaded replicas
    assert all(s.stats.generation_tokens > 0 for s in sched.replicas)  # both replicas decoded
    assert sched.stats.generation_tokens == sum(s.stats.generation_tokens for s in sched.replicas)
    assert_no_leaks_dp(dp_engine)


def test_new_request_goes_to_the_shortest_queue(dp_engine, reference):
    sched = dp_engine.scheduler
    a = dp_engine.make_request(PROMPTS[0], GREEDY12)
    b = dp_engine.make_request(PROMPTS[1], {"temperature": 0.0, "max_new_tokens": 1})
    c = dp_engine.make_request(PROMPTS[2], GREEDY12)
    for req in (a, b, c):
        sched.add_request(req)
    assert [sched.replica_of(r.rid) for r in (a, b, c)] == [0, 1, 0]
    while not b.finished:
        sched.step()
    assert sched.loads() == [2, 0]
    d = dp_engine.make_request(PROMPTS[3], GREEDY12)
    sched.add_request(d)
    assert sched.replica_of(d.rid) == 1  # replica 0 still has two live requests
    while sched.has_work():
        sched.step()
    sched.flush()
    for req, i in ((a, 0), (c, 2), (d, 3)):
        assert req.output_ids == reference[tuple(PROMPTS[i])]
    assert b.output_ids == reference[tuple(PROMPTS[1])][:1]
    assert_no_leaks_dp(dp_engine)


def test_abort_goes_to_the_request_s_replica(dp_engine, reference):
    sched = dp_engine.scheduler
    keep = dp_engine.make_request(PROMPTS[4], GREEDY12)
    running = dp_engine.make_request(PROMPTS[5], {"temperature": 0.0, "max_new_tokens": 64})
    waiting = dp_engine.make_request(PROMPTS[6], GREEDY12)
    for req in (keep, running):
        sched.add_request(req)
    assert (sched.replica_of(keep.rid), sched.replica_of(running.rid)) == (0, 1)
    for _ in range(3):
        sched.step()
    assert running in sched.replicas[1].running and not running.finished
    assert sched.abort(running.rid)
    assert running.to_abort and not keep.to_abort
    sched.add_request(waiting)  # loads [1, 1]: replica 0, still waiting when aborted
    assert sched.replica_of(waiting.rid) == 0
    assert sched.abort(waiting.rid) and waiting.finish_reason == FinishReason.ABORT
    assert waiting not in sched.replicas[0].waiting
    assert not sched.abort("no-such-request")
    while sched.has_work():
        sched.step()
    sched.flush()
    assert running.finish_reason == FinishReason.ABORT and len(running.output_ids) < 64
    assert sched.replicas[1].stats.num_aborts >= 1
    assert keep.output_ids == reference[tuple(PROMPTS[4])]
    assert not sched.abort(running.rid)  # finished and forgotten
    assert_no_leaks_dp(dp_engine)


def test_streaming_and_per_replica_state(dp_engine, reference):
    chunks = list(dp_engine.generate_stream(PROMPTS[7], GREEDY12))
    assert [t for c in chunks for t in c.delta_token_ids] == reference[tuple(PROMPTS[7])]
    assert chunks[-1].finish_reason is not None
    with pytest.raises(AttributeError, match="per replica"):
        _ = dp_engine.runner.req_to_token_pool  # no replica's pool may pass for all of them
    assert dp_engine.runner.info()["dp_size"] == 2
    assert dp_engine.runner.total_kv_tokens == 2 * dp_engine.runner.max_total_tokens
    assert_no_leaks_dp(dp_engine)


def test_dp2_with_tp2_replicas_each_have_their_own_group(model, reference):
    """dp_size 2 x tp_size 2 on the CPU: two TP groups (own store, own spawned rank) in one engine."""
    prompts = PROMPTS[:6]
    with make_engine(model, dtype="float32", dp_size=2, tp_size=2, dist_timeout=60) as engine:
        replicas = engine.runner.replicas
        assert [r.tp.size for r in replicas] == [2, 2]
        assert replicas[0].store.port != replicas[1].store.port
        out = [o.token_ids for o in engine.generate(prompts, GREEDY12)]
        assert out == [reference[tuple(p)] for p in prompts]
        assert engine.scheduler.assigned == {0: 3, 1: 3}
        assert_no_leaks_dp(engine)


def test_config_accepts_plain_dp_and_rejects_bad_values():
    cfg = EngineConfig(model="m", dp_size=2)
    assert cfg.dp_size == 2 and not cfg.enable_dp_attention
    assert EngineConfig(model="m", dp_size=2, tp_size=2).tp_size == 2
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        EngineConfig(model="m", dp_size=0)
    with pytest.raises(ValueError, match="one machine"):
        EngineConfig(model="m", dp_size=2, tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="one machine"):
        EngineConfig(model="m", dp_size=2, dist_init_addr="10.0.0.1:29500")
    with pytest.raises(ValueError, match="dp_size == tp_size"):
        EngineConfig(model="m", dp_size=2, tp_size=4, enable_dp_attention=True)


def test_unsupported_layouts_are_rejected_before_anything_starts(monkeypatch):
    import torch

    cfg = EngineConfig(model="m", dp_size=2, tp_size=2, base_gpu_id=1)
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="from base_gpu_id 1 needs 5 GPUs, 4 visible"):
        DataParallelRunner(cfg, None)  # type: ignore[arg-type]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ValueError, match="torchrun"):
        DataParallelRunner(cfg, None)  # type: ignore[arg-type]


def test_logits_observer_sees_every_replica(dp_engine):
    seen: set[str] = set()
    dp_engine.scheduler.on_logits = lambda reqs, logits: seen.update(r.rid for r in reqs)
    try:
        outs = dp_engine.generate(PROMPTS[:2], {"temperature": 0.0, "max_new_tokens": 2})
    finally:
        dp_engine.scheduler.on_logits = None
    assert seen == {o.rid for o in outs}
    assert all(s.on_logits is None for s in dp_engine.scheduler.replicas)
