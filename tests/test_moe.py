"""Mixture-of-experts models against transformers (fp32, CPU): the expert loop, the routers, the
gpt-oss experts, greedy tokens of each architecture, the MXFP4 checkpoint layout, and the errors."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from plait.layers.moe.layer import FusedMoE
from plait.layers.moe.reference import fused_experts_reference
from plait.layers.moe.router import RouterConfig, select_experts
from plait.models.mxfp4 import FP4_VALUES, quantize_mxfp4
from plait.testing import TINY_MOE_ARCHS, make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

# 8 new tokens after prompts of 3, 7 and 12: the longer two cross the tiny windows (12).
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = prompt_ids(3)


def _per_token_loop(x, w13, w2, weights, ids, act):
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, k] * (w2[e] @ act(gate, up))
    return out


def test_reference_is_the_weighted_sum_over_each_tokens_experts_and_skips_foreign_ids():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=gen)
    w13, w2 = torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 12, generator=gen)
    ids = torch.tensor([[0, 1], [3, 3], [2, -1], [4, 0], [1, 2], [0, 0]], dtype=torch.int32)  # -1 and 4: other ranks'
    weights = torch.rand(6, 2, generator=gen)
    expected = _per_token_loop(x, w13, w2, weights, ids, lambda g, u: torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(fused_experts_reference(x, w13, w2, weights, ids), expected)


def test_routers_match_transformers():
    from transformers import GptOssConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(10, 32)
    for norm in (False, True):
        hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                               norm_topk_prob=norm))
        torch.nn.init.normal_(hf.weight)
        _, w_hf, ids_hf = hf(x)
        w, ids = select_experts(x @ hf.weight.T, RouterConfig(8, 3, "softmax_topk", renormalize=norm))
        assert torch.equal(ids.long(), ids_hf)
        torch.testing.assert_close(w, w_hf)
    hf = GptOssTopKRouter(GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3))
    torch.nn.init.normal_(hf.weight)
    torch.nn.init.normal_(hf.bias)
    _, w_hf, ids_hf = hf(x)
    w, ids = select_experts(torch.nn.functional.linear(x, hf.weight, hf.bias), RouterConfig(8, 3, "topk_softmax"))
    assert torch.equal(ids.long(), ids_hf)
    torch.testing.assert_close(w, w_hf)


def test_gpt_oss_experts_loaded_from_interleaved_tensors_match_transformers_with_clamps_hit():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from plait.models.gpt_oss import GptOssForCausalLM

    torch.manual_seed(0)
    hf = GptOssExperts(GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4))
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=1.0)  # large enough that gate > 7 and |up| > 7 occur
    x = torch.randn(9, 32)
    ids = torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2)
    gate_up = x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()

    ours = FusedMoE(4, 32, 16, activation="swiglu_oai", bias=True)
    loader = GptOssForCausalLM.load_fused_experts
    for proj, suffix, t in (("gate_up_proj", "", hf.gate_up_proj), ("gate_up_proj", "_bias", hf.gate_up_proj_bias),
                            ("down_proj", "", hf.down_proj), ("down_proj", "_bias", hf.down_proj_bias)):
        loader(None, ours, proj, suffix, t.detach())  # type: ignore[arg-type]  (only MXFP4 needs the model)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, weights, ids.int()), hf(x, ids, weights), rtol=1e-4, atol=1e-4)


def _check_routing_features(arch: str, layers) -> None:
    """The tiny preset of ``arch`` has every routing feature of its architecture on."""
    if arch == "qwen3-moe":  # a dense layer among the sparse ones, renormalised top-k
        assert type(layers[0].mlp).__name__ == "SparseMoeBlock" and type(layers[1].mlp).__name__ == "LlamaMLP"
        assert layers[0].mlp.router_config.renormalize
    elif arch == "qwen2-moe":
        assert layers[0].mlp.shared_expert is not None
    elif arch == "mixtral":
        assert {layer.self_attn.attn.sliding_window for layer in layers} == {12}
    else:  # gpt-oss: alternating windows (layer 0 sliding), sinks, router and expert biases
        assert [layer.self_attn.attn.sliding_window for layer in layers] == [12, None]
        assert all(layer.self_attn.attn.sinks is not None for layer in layers)
        assert layers[0].mlp.gate.bias is not None and layers[0].mlp.experts.w2_bias is not None


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_greedy_tokens_with_every_routing_feature_on_equal_transformers(arch, tiny_model_dir, hf_reference):
    path = tiny_model_dir(arch)
    refs = [hf_reference(path, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert sum(len(set(r.tokens)) >= 5 for r in refs) >= 2, "reference output too repetitive to prove anything"
    with make_engine(path, max_total_tokens=256) as engine:
        _check_routing_features(arch, engine.runner.model.model.layers)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == [r.tokens for r in refs]
        assert_no_leaks(engine)


def _mxfp4_checkpoint(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``src``'s gpt-oss with expert weights rounded to MXFP4-representable values, written twice: as
    a plain checkpoint into ``src`` (transformers' reference) and in the published MXFP4 layout
    (``*_blocks`` / ``*_scales``, a quantization_config) into ``dst``."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    lut = torch.tensor(FP4_VALUES)
    gen = torch.Generator().manual_seed(0)
    quantized = {}
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            w = tensors[name]  # transformers layout: gate_up [E, H, 2I], down [E, I, H]
            rows = w.transpose(1, 2)  # the MXFP4 rows: gate_up [E, 2I, H], down [E, H, I]
            codes = lut[torch.randint(0, 16, rows.shape, generator=gen)]
            exps = torch.randint(-5, -2, (*rows.shape[:-1], rows.shape[-1] // 32), generator=gen)
            exact = codes * torch.exp2(exps.float()).repeat_interleave(32, dim=-1)
            tensors[name] = exact.transpose(1, 2).contiguous()
            quantized[name + "_blocks"], quantized[name + "_scales"] = quantize_mxfp4(exact)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del tensors[name]
    save_file({**tensors, **quantized}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mxfp4_experts_are_dequantized_at_load_and_match_transformers(tmp_path, hf_reference):
    plain = make_tiny_model(tmp_path / "plain", "gpt-oss", seed=1)
    mxfp4 = _mxfp4_checkpoint(plain, tmp_path / "mxfp4")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in load_file(mxfp4 / "model.safetensors")
    refs = [hf_reference(plain, p, GREEDY["max_new_tokens"]) for p in PROMPTS[1:]]
    with make_engine(mxfp4, max_total_tokens=256) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS[1:], GREEDY)] == [r.tokens for r in refs]


def test_other_mixture_of_experts_architectures_fail_naming_themselves(tmp_path, tiny_model_dir):
    path = tmp_path / "deepseek"
    shutil.copytree(tiny_model_dir("qwen3-moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mixture-of-experts architecture \['DeepseekV3ForCausalLM'\] is not"):
        make_engine(path)


def test_expert_parallelism_needs_a_moe_model(tiny_model_dir):
    from plait.models.loader import load_model, load_model_config

    with pytest.raises(ValueError, match="ep_size 2 needs a mixture-of-experts model; LlamaForCausalLM is dense"):
        load_model(load_model_config(str(tiny_model_dir("llama"))), "cpu", ep_size=2)


def test_experts_not_divisible_by_ep_size_fail_naming_the_fix():
    from plait.distributed.parallel_state import TPGroup

    four_ranks = TPGroup(rank=1, size=4, group=object())  # shapes only: no collective runs
    with pytest.raises(ValueError, match=r"number of experts \(6\) is not divisible by 4; choose an ep_size"):
        FusedMoE(6, 16, 8, four_ranks, ep_size=4)


def test_rank_holds_its_experts_and_its_intermediate_shard():
    from plait.distributed.parallel_state import TPGroup

    # 4 ranks, ep_size 2: rank 3 is expert group 1 (experts 4..7), intermediate shard 1 of 2.
    moe = FusedMoE(8, 16, 12, TPGroup(rank=3, size=4, group=object()), ep_size=2)
    assert moe.w13_weight.shape == (4, 2 * 6, 16) and moe.w2_weight.shape == (4, 16, 6)
    assert [moe.local_expert(e) for e in range(8)] == [None] * 4 + [0, 1, 2, 3]
    gate = torch.arange(12 * 16, dtype=torch.float32).view(12, 16)
    moe.load_expert_weight(5, "gate", gate)
    assert torch.equal(moe.w13_weight[1, :6], gate[6:])
