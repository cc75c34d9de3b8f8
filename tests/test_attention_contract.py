"""The three-method attention contract and who plans when (docs/architecture.md 3.2 and 3.1)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import plait.forward_batch as forward_batch_module
from plait.attention.base import AttentionBackend
from plait.attention.hybrid import HybridAttnBackend, select_half
from plait.attention.registry import build_backend, registered_backends
from plait.attention.torch_native import TorchNativeAttnBackend
from plait.config import EngineConfig
from plait.forward_batch import ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from tests.helpers import GREEDY, make_engine, prompt_ids


class CountingBackend(TorchNativeAttnBackend):
    """The real torch_native backend, counting its planning calls in order."""

    def __init__(self, inner: TorchNativeAttnBackend) -> None:
        super().__init__(inner.req_to_token_pool, inner.kv_pool)
        self.calls: list[str] = []

    def init_forward_metadata_out_graph(self, fb, in_capture=False):
        self.calls.append("out_graph")
        return super().init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb):
        self.calls.append("in_graph")
        return super().init_forward_metadata_in_graph(fb)


@pytest.fixture
def engine_with_counter(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    counter = CountingBackend(engine.runner.attn_backend)
    engine.runner.attn_backend = counter
    return engine, counter


def _one_batch(engine):
    req = engine.make_request(prompt_ids(1)[0], GREEDY)
    engine.scheduler.add_request(req)
    batch = engine.scheduler._schedule()
    for e in batch.entries:
        engine.runner.req_to_token_pool.write(e.req.req_pool_idx, e.prefix_len, batch.out_cache_loc)
    return batch.to_forward_batch("cpu")


def test_default_eager_entry_calls_out_graph_then_in_graph(engine_with_counter):
    engine, counter = engine_with_counter
    counter.init_forward_metadata(_one_batch(engine))
    assert counter.calls == ["out_graph", "in_graph"]


def test_forward_plans_an_unmarked_batch_once(engine_with_counter):
    engine, counter = engine_with_counter
    engine.runner.forward(_one_batch(engine))
    assert counter.calls == ["out_graph", "in_graph"]


def test_forward_does_not_plan_a_marked_batch(engine_with_counter):
    engine, counter = engine_with_counter
    fb = _one_batch(engine)
    counter.init_forward_metadata(fb)
    fb.mark_forward_metadata_ready()
    engine.runner.forward(fb)
    assert counter.calls == ["out_graph", "in_graph"]  # the pre-plan only


def test_deprecated_skip_keyword_on_forward_skips_planning(engine_with_counter, monkeypatch):
    monkeypatch.setattr(forward_batch_module, "_warned_skip_attn_backend_init", False)
    engine, counter = engine_with_counter
    fb = _one_batch(engine)
    counter.init_forward_metadata(fb)
    with pytest.warns(DeprecationWarning):
        engine.runner.forward(fb, skip_attn_backend_init=True)
    assert counter.calls == ["out_graph", "in_graph"]


def test_every_generation_step_plans_exactly_once(engine_with_counter):
    engine, counter = engine_with_counter
    steps_before = engine.scheduler.stats.forward_steps
    engine.generate(prompt_ids(3), {"temperature": 0.0, "max_new_tokens": 5})
    steps = engine.scheduler.stats.forward_steps - steps_before
    assert counter.calls == ["out_graph", "in_graph"] * steps


def _model_runner_classes(tree: ast.AST) -> set[ast.ClassDef]:
    """ModelRunner and its subclasses (by base-class name) in one module."""
    return {node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and (
        node.name == "ModelRunner" or any(getattr(b, "id", getattr(b, "attr", "")).endswith("ModelRunner")
                                          for b in node.bases))}


def test_no_internal_signature_takes_skip_attn_backend_init():
    """Only the public ModelRunner.forward (and its overrides) keeps the deprecated keyword."""
    root = pathlib.Path(__file__).resolve().parents[1] / "plait"
    offenders = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        public = {id(f) for cls in _model_runner_classes(tree) for f in cls.body
                  if isinstance(f, ast.FunctionDef) and f.name == "forward"}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                allowed = id(node) in public or node.name == "apply_deprecated_skip_attn_backend_init"
                if "skip_attn_backend_init" in names and not allowed:
                    offenders.append(f"{path.name}:{node.name}")
    assert offenders == []


def test_registry_leaf_stamps_its_effective_name():
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, torch.float32, 1, 1, 8, "cpu")
    backend = build_backend("torch_native", pool, kv)
    assert backend.name == "torch_native"
    assert "torch_native" in registered_backends() and "triton" in registered_backends()


def test_triton_backend_on_cpu_fails_fast_with_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, torch.float32, 1, 1, 8, "cpu")
    with pytest.raises(RuntimeError, match="torch_native"):
        build_backend("triton", pool, kv)


def test_unknown_backend_name_is_rejected_by_config():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model="x", attention_backend="flashinfer")


def test_attention_backends_pair_prefers_phase_flags():
    cfg = EngineConfig(model="x", device="cpu", attention_backend="torch_native", decode_attention_backend="triton")
    assert cfg.attention_backends() == ("torch_native", "triton")
    assert EngineConfig(model="x", device="cpu").attention_backends() == ("torch_native", "torch_native")


@pytest.mark.parametrize(
    ("mode", "spec_mode", "half"),
    [(ForwardMode.DECODE, "prefill", "decode"), (ForwardMode.IDLE, "prefill", "decode"),
     (ForwardMode.EXTEND, "decode", "prefill"), (ForwardMode.MIXED, "prefill", "prefill"),
     (ForwardMode.DRAFT_EXTEND, "decode", "prefill"), (ForwardMode.TARGET_VERIFY, "decode", "decode"),
     (ForwardMode.TARGET_VERIFY, "prefill", "prefill")],
)
def test_hybrid_selects_the_half_by_forward_mode(mode, spec_mode, half):
    assert select_half(mode, spec_mode) == half


def test_hybrid_backend_routes_decode_and_extend(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    prefill = CountingBackend(engine.runner.attn_backend)
    decode = CountingBackend(engine.runner.attn_backend)
    engine.runner.attn_backend = HybridAttnBackend(prefill, decode)
    engine.generate(prompt_ids(1)[0], {"temperature": 0.0, "max_new_tokens": 3})
    assert prefill.calls == ["out_graph", "in_graph"]  # the prefill step
    assert decode.calls == ["out_graph", "in_graph"] * 2  # two decode steps


def test_base_backend_refuses_cuda_graphs_with_a_fix():
    pool = ReqToTokenPool(2, 8, "cpu")
    kv = MHATokenToKVPool(8, torch.float32, 1, 1, 8, "cpu")
    backend: AttentionBackend = TorchNativeAttnBackend(pool, kv)
    with pytest.raises(RuntimeError, match="disable-cuda-graph"):
        backend.init_cuda_graph_state(8, 8)



def test_a_decoder_layer_hands_its_backend_views_of_the_fused_projection_not_copies(tiny_model_dir, monkeypatch):
    """q, k and v reach the backend as strided views into one qkv output (no copy kernel per layer);
    greedy output stays what the copying form gave (the correctness suite holds it to transformers)."""
    from plait.layers.radix_attention import RadixAttention

    seen: list[tuple[int, int, int, tuple[int, ...]]] = []
    forward = RadixAttention.forward

    def recording(self, q, k, v, fb, **kw):
        seen.append((q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(),
                     v.untyped_storage().data_ptr(), tuple(v.stride())))
        return forward(self, q, k, v, fb, **kw)

    monkeypatch.setattr(RadixAttention, "forward", recording)
    engine = make_engine(tiny_model_dir("llama"))
    out = engine.generate(prompt_ids(2), {**GREEDY, "max_new_tokens": 4})
    assert all(len(o.token_ids) == 4 for o in out)
    cfg = engine.runner.model_config.hf_config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    row = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * head_dim
    assert seen and all(q_ptr == k_ptr == v_ptr and stride == (row, 1) for q_ptr, k_ptr, v_ptr, stride in seen)
