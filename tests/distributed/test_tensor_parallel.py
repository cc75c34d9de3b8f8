"""Tensor parallelism with real processes over gloo: rank 0 is the test's process, rank 1 a spawned one.

Each tp_size=2 engine is compared, token for token under greedy decoding, with a tp_size=1 engine on
the same fp32 checkpoint (reduction order differs, the argmax must not).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from plait.config import EngineConfig
from plait.parallel.ranks import TensorParallelError
from plait.testing import TINY_ARCHS
from tests.helpers import assert_no_leaks, make_engine, pid_alive, prompt_ids

GREEDY16 = {"temperature": 0.0, "max_new_tokens": 16}
PROMPTS = prompt_ids(8)


def _greedy(engine, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY16)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp2_greedy_output_equals_tp1(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    # Small prefill chunks: long prompts prefill over several steps, mixed with decodes, so the
    # other rank's attention reads prefixes written by earlier steps.
    with make_engine(path, chunked_prefill_size=16) as single:
        expected = _greedy(single)
    with make_engine(path, chunked_prefill_size=16, tp_size=2, dist_timeout=60) as engine:
        assert engine.runner.tp.size == 2
        assert _greedy(engine) == expected
        # The same prompts again: admission hands over radix-cached prefixes, whose request-pool rows
        # the other rank must mirror for its attention to read the right KV.
        again = engine.generate(PROMPTS, GREEDY16)
        assert [o.token_ids for o in again] == expected
        assert sum(o.meta_info["cached_tokens"] for o in again) > 0
        assert_no_leaks(engine)


def test_a_model_config_override_reaches_every_rank(tiny_model_dir):
    path = tiny_model_dir("llama")
    override = '{"rope_theta": 50.0}'
    with make_engine(path, json_model_override_args=override) as single:
        expected = _greedy(single, PROMPTS[:3])
    with make_engine(path, json_model_override_args=override, tp_size=2, dist_timeout=60) as engine:
        assert _greedy(engine, PROMPTS[:3]) == expected  # a rank without it would compute another model


def test_tp2_prompt_logprobs_and_logit_bias_equal_tp1(tiny_model_dir):
    """Scored prompt positions travel to the other rank with the batch's logits rows; rank 0 splits
    them from the sampled rows."""
    path = tiny_model_dir("llama")
    params = {**GREEDY16, "max_new_tokens": 4, "logprobs": True, "logprob_start_len": 0, "top_logprobs": 2,
              "logit_bias": {"11": 100}, "ignore_eos": True}
    prompts = PROMPTS[4:7]
    with make_engine(path, chunked_prefill_size=16) as single:
        expected = single.generate(prompts, params)
    with make_engine(path, chunked_prefill_size=16, tp_size=2, dist_timeout=60) as engine:
        out = engine.generate(prompts, params)
        assert_no_leaks(engine)
    for o, e in zip(out, expected, strict=True):
        assert o.token_ids == e.token_ids == [11] * 4
        got, want = o.meta_info["input_token_logprobs"], e.meta_info["input_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert got[0][0] is None and [lp for lp, _, _ in got[1:]] == pytest.approx(
            [lp for lp, _, _ in want[1:]], abs=1e-4)


def test_dummy_weights_are_the_same_model_at_tp2(tiny_model_dir):
    """Random (load_format="dummy") weights are drawn per checkpoint tensor, whole, and sharded by
    the loader: a tp_size=2 engine holds the one-GPU model (the multi-GPU correctness runs use them)."""
    path = tiny_model_dir("llama")
    with make_engine(path, load_format="dummy") as single:
        expected = _greedy(single)
    with make_engine(path, load_format="dummy", tp_size=2, dist_timeout=60) as engine:
        assert _greedy(engine) == expected
    with make_engine(path) as real:  # and they are not the checkpoint's weights
        assert _greedy(real) != expected


def test_llama3_preset_has_fewer_kv_heads_than_ranks(tiny_model_dir):
    """The llama3 case above covers KV-head replication: one KV head, two ranks."""
    with make_engine(tiny_model_dir("llama3"), max_total_tokens=64) as single:
        assert single.model_config.num_kv_heads < 2


def test_rank_0_holds_its_shards_only(tiny_model_dir):
    """llama3 preset: 2 query heads and 1 KV head of 128, MLP 512 wide, vocabulary 512."""
    with make_engine(tiny_model_dir("llama3"), tp_size=2, dist_timeout=60, max_total_tokens=64) as engine:
        layer = engine.runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.shape == ((1 + 2 * 1) * 128, 256)  # 1 q head + the replicated k, v
        assert layer.mlp.gate_up_proj.weight.shape == (2 * 256, 256)
        assert layer.mlp.down_proj.weight.shape == (256, 256)
        assert engine.runner.model.model.embed_tokens.weight.shape == (256, 256)
        assert engine.runner.kv_pool.num_kv_heads == 1


def test_tp_size_not_dividing_heads_fails_at_start_without_spawning(tiny_model_dir):
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide the model's attention heads \(4\)"):
        make_engine(tiny_model_dir("llama"), tp_size=3)
    assert multiprocessing.active_children() == before


@pytest.mark.parametrize("bad", [{"tp_size": 0}, {"tp_size": 3, "nnodes": 2}, {"tp_size": 2, "nnodes": 2},
                                 {"dist_timeout": 0}])
def test_config_rejects_bad_parallel_settings(bad):
    with pytest.raises(ValueError):
        EngineConfig(model="m", **bad)


def test_workers_exit_cleanly_on_shutdown(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), tp_size=2, dist_timeout=60)
    procs = list(engine.runner.procs.values())
    assert [p.is_alive() for p in procs] == [True]
    engine.shutdown()
    assert [p.exitcode for p in procs] == [0]


RANK0_SCRIPT = """
import sys
from plait import Engine
if __name__ == "__main__":
    engine = Engine(model=sys.argv[1], device="cpu", tp_size=2, max_total_tokens=1024)
    print(*[p.pid for p in engine.runner.procs.values()], flush=True)
    sys.stdin.read()  # until the test kills this process
"""


def test_ranks_exit_when_rank_0_is_killed(tiny_model_dir, tmp_path):
    """SIGKILL gives rank 0 no chance to shut its ranks down: they go with it (the parent-death signal,
    whether a rank was spawned or forked from the CPU's forkserver)."""
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_SCRIPT)
    rank0 = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir("llama"))], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
        assert len(pids) == 1 and pid_alive(pids[0])
        rank0.kill()
        rank0.wait(10)
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in pids)
    finally:
        rank0.kill()


def test_killed_rank_ends_the_engine_with_an_error(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), tp_size=2, dist_timeout=10)
    try:
        assert _greedy(engine, PROMPTS[:2])  # healthy first
        (proc,) = engine.runner.procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"tp rank 1 .* exited with code -9"):
            _greedy(engine, PROMPTS[:2])
        assert time.monotonic() - t0 < 10
        # Once failed, the engine stays failed with the same message.
        with pytest.raises(TensorParallelError, match="failed earlier"):
            _greedy(engine, PROMPTS[:1])
    finally:
        engine.shutdown()


def test_hung_rank_ends_the_engine_within_the_collective_timeout(tiny_model_dir):
    """A rank that is alive but stuck (SIGSTOP) is only noticed by the collective timeout."""
    engine = make_engine(tiny_model_dir("llama"), tp_size=2, dist_timeout=3)
    (proc,) = engine.runner.procs.values()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="dist_timeout=3"):
            _greedy(engine, PROMPTS[:2])
        assert time.monotonic() - t0 < 3 + 10
    finally:
        engine.shutdown()  # kills the stopped rank
    assert not proc.is_alive()
