"""add + RMSNorm inside the GEMV after it (plait.layers.norm_linear) and a dense MLP's SiLU-and-mul
inside its down projection's GEMV, in whole models: greedy tokens of tiny models equal transformers'
with the fused kernels running in the Triton interpreter (fp32, CPU), for every layer's qkv, a dense
MLP's gate_up and down, and the MoE router (whose experts read its normed rows)."""

from __future__ import annotations

import pytest

import plait.layers.linear as linear_module
import plait.layers.norm_linear as norm_linear_module
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture
def fused_calls(monkeypatch):
    """The interpreter runs Triton layer ops on CPU tensors, the fused path on; counts its launches."""
    monkeypatch.setenv("PLAIT_TRITON_OPS", "1")
    monkeypatch.setenv("PLAIT_FUSED_NORM_GEMV", "1")
    calls: list[tuple[int, bool, bool]] = []
    real = norm_linear_module.gemv_rmsnorm

    def counting(x, *args, residual=None, want_normed=False, **kwargs):
        calls.append((x.shape[0], residual is not None, want_normed))
        return real(x, *args, residual=residual, want_normed=want_normed, **kwargs)

    monkeypatch.setattr(norm_linear_module, "gemv_rmsnorm", counting)
    return calls


@pytest.fixture
def act_calls(monkeypatch):
    """The SiLU-and-mul fused into the down projection on; counts its launches (rows of each)."""
    monkeypatch.setenv("PLAIT_FUSED_ACT_GEMV", "1")
    calls: list[int] = []
    real = linear_module.gemv_silu_mul

    def counting(gate_up, *args, **kwargs):
        calls.append(gate_up.shape[0])
        return real(gate_up, *args, **kwargs)

    monkeypatch.setattr(linear_module, "gemv_silu_mul", counting)
    return calls


# llama: the one-layer tiny model (the interpreter's GEMVs are slow at the dense presets' widths);
# qwen3-moe's tiny preset has Qwen3 attention and a dense layer beside a sparse one (Qwen3's dense
# decoder in one model); gpt-oss has router biases.
@pytest.mark.parametrize("arch", ["llama", "qwen3-moe", "gpt-oss"])
def test_greedy_tokens_with_the_norm_fused_into_the_gemv_equal_transformers(arch, tiny_model_dir, one_layer,
                                                                           hf_reference, fused_calls, act_calls):
    path = one_layer if arch == "llama" else tiny_model_dir(arch)
    prompts = prompt_ids(2)
    refs = [hf_reference(path, p, GREEDY["max_new_tokens"]) for p in prompts]
    with make_engine(path, max_total_tokens=256) as engine:
        layers = engine.runner.model.model.layers
        outs = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [r.tokens for r in refs]
        assert_no_leaks(engine)
    # Every layer fuses both norms at decode: the first layer's input norm has no residual yet, the MoE
    # router's call also writes the normed rows for the experts.
    assert {(False, False), (True, False)} <= {(res, normed) for _, res, normed in fused_calls}
    if arch != "llama":
        assert any(normed for _, _, normed in fused_calls)
    assert len(fused_calls) >= 2 * len(layers) * (GREEDY["max_new_tokens"] - 1)
    # Every dense MLP's down projection (gpt-oss has none) fuses the SiLU-and-mul at decode.
    dense = sum(type(layer.mlp).__name__ == "LlamaMLP" for layer in layers)
    assert len(act_calls) >= dense * (GREEDY["max_new_tokens"] - 1) and (dense > 0) == bool(act_calls)


def test_the_switches_off_keep_the_norm_and_activation_kernels_then_the_gemv(one_layer, fused_calls, act_calls,
                                                                            monkeypatch):
    monkeypatch.setenv("PLAIT_FUSED_NORM_GEMV", "0")
    monkeypatch.setenv("PLAIT_FUSED_ACT_GEMV", "0")
    with make_engine(one_layer, max_total_tokens=256) as engine:
        engine.generate(prompt_ids(1), GREEDY)
    assert fused_calls == [] and act_calls == []


def test_under_tensor_parallelism_each_rank_fuses_its_shard_and_the_tokens_equal_transformers(
        tiny_model_dir, hf_reference, fused_calls):
    # Two gloo ranks inherit the switches: each rank's column-parallel qkv / gate_up and its replicated
    # router run the fused kernel on the all-reduced rows.
    path = tiny_model_dir("qwen3-moe")
    prompts = prompt_ids(2)
    refs = [hf_reference(path, p, GREEDY["max_new_tokens"]) for p in prompts]
    with make_engine(path, tp_size=2, dist_timeout=60, max_total_tokens=256) as engine:
        outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.tokens for r in refs]
    assert fused_calls  # the rank in this process took the fused path
