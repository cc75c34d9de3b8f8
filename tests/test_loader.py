"""Checkpoint loading: sharded safetensors, tied heads, dtype, dummy weights, and start-up errors."""

from __future__ import annotations

import json

import pytest
import torch

from plait.models.loader import load_model, load_model_config
from tests.helpers import GREEDY, make_engine, prompt_ids


def test_sharded_checkpoint_loads_the_same_weights(tmp_path, tiny_model_dir):
    from plait.testing import make_tiny_model

    sharded = make_tiny_model(tmp_path / "sharded", "llama", max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a = make_engine(sharded).generate(prompt_ids(1)[0], GREEDY)
    b = make_engine(tiny_model_dir("llama")).generate(prompt_ids(1)[0], GREEDY)
    assert a.token_ids == b.token_ids


def test_tied_head_uses_the_embedding_matrix(tiny_model_dir):
    mc = load_model_config(str(tiny_model_dir("llama-tied")))
    model = load_model(mc, "cpu")
    assert model.lm_head is None
    assert model.lm_head_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_dtype_auto_is_float32_on_cpu_and_explicit_dtype_is_honoured(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    assert load_model_config(path, "auto", "cpu").dtype == torch.float32
    assert load_model_config(path, "bfloat16", "cpu").dtype == torch.bfloat16
    model = load_model(load_model_config(path, "bfloat16", "cpu"), "cpu")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    # rotary tables stay float32 whatever the model dtype
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_logits_are_float32_for_a_bfloat16_model(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"), dtype="bfloat16")
    seen = []
    engine.scheduler.on_logits = lambda reqs, logits: seen.append(logits.dtype)
    engine.generate(prompt_ids(1)[0], {"temperature": 0.0, "max_new_tokens": 2})
    assert seen == [torch.float32, torch.float32]


def test_dummy_load_format_needs_only_config_json(tmp_path, tiny_model_dir):
    src = tiny_model_dir("qwen3")
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / "config.json").write_text((src / "config.json").read_text())
    model = load_model(load_model_config(str(only_config)), "cpu", load_format="dummy", seed=3)
    weights = model.model.layers[0].mlp.gate_up_proj.weight
    assert torch.isfinite(weights).all() and weights.std() > 0


def test_unsupported_architecture_fails_with_the_supported_list(tmp_path, tiny_model_dir):
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    cfg["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"not supported; supported: .*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model_config(str(tmp_path))


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_quantized_checkpoint_of_an_unsupported_format_fails_at_start(tmp_path, tiny_model_dir, method):
    cfg = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"quantized checkpoint format '{method}' is not supported"):
        load_model_config(str(tmp_path))


def test_missing_directory_says_plait_never_downloads(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model_config(str(tmp_path / "meta-llama/Llama-3.1-8B"))


def damaged_copy(tmp_path, tiny_model_dir, damage) -> str:
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir("llama"), copy)
    damage(copy)
    return str(copy)


def test_a_config_that_is_not_json_fails_naming_the_file(tmp_path, tiny_model_dir):
    path = damaged_copy(tmp_path, tiny_model_dir, lambda d: (d / "config.json").write_text("{not json"))
    with pytest.raises(ValueError, match=r"damaged/config.json is not valid JSON"):
        load_model_config(path)


def test_a_truncated_weights_file_fails_naming_the_file(tmp_path, tiny_model_dir):
    def truncate(d):
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(1000)

    path = damaged_copy(tmp_path, tiny_model_dir, truncate)
    with pytest.raises(ValueError, match=r"damaged/model.safetensors is not a readable safetensors file"):
        make_engine(path)


def test_a_checkpoint_without_a_tokenizer_fails_saying_to_pass_one(tmp_path, tiny_model_dir):
    path = damaged_copy(tmp_path, tiny_model_dir, lambda d: [f.unlink() for f in d.glob("tokenizer*")])
    with pytest.raises(ValueError, match=r"no usable tokenizer in .*damaged.*pass --tokenizer DIR"):
        make_engine(path)


def test_context_length_above_model_maximum_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="max_position_embeddings 2048"):
        load_model_config(str(tiny_model_dir("llama")), context_length=4096)


def test_kv_capacity_is_logged_at_start(tiny_model_dir, caplog):
    with caplog.at_level("INFO"):
        make_engine(tiny_model_dir("llama"), max_total_tokens=1000)
    assert any("KV cache: 1000 tokens" in r.message for r in caplog.records)
