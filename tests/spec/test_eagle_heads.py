"""EAGLE / EAGLE3 draft-head formats: the key-and-shape manifest of each (as SGLang's loaders and
the EAGLE repository read them), random heads written by plait.testing in safetensors and in
pytorch_model.bin, and plait's head modules loading them and running a forward."""

from __future__ import annotations

import pytest
import torch

from plait.attention.registry import build_backend
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from plait.models.eagle import Eagle3Head, EagleHead, eagle3_capture_layers, iter_checkpoint, load_head_config
from plait.models.eagle_heads import eagle_head_manifest, make_eagle_head

CFG = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
       "num_hidden_layers": 1, "vocab_size": 512, "draft_vocab_size": 128}


def test_eagle_manifest_pins_fc_over_embedding_and_hidden_and_a_first_layer_without_input_norm():
    m = eagle_head_manifest("EAGLE", CFG)
    assert m["fc.weight"][0] == (64, 128) and m["fc.bias"][0] == (64,)
    assert "layers.0.input_layernorm.weight" not in m
    assert m["layers.0.self_attn.q_proj.weight"][0] == (64, 64)
    assert m["layers.0.self_attn.k_proj.weight"][0] == (32, 64)
    assert not any(k.startswith(("lm_head", "norm", "embed_tokens")) for k in m)  # the target's are used


def test_eagle3_manifest_pins_three_captured_layers_a_2h_attention_input_and_a_reduced_vocab():
    m = eagle_head_manifest("EAGLE3", CFG)
    assert m["fc.weight"][0] == (64, 192)
    for proj, rows in (("q", 64), ("k", 32), ("v", 32)):
        assert m[f"midlayer.self_attn.{proj}_proj.weight"][0] == (rows, 128)
    assert m["midlayer.self_attn.o_proj.weight"][0] == (64, 64)
    assert {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= set(m)
    assert m["lm_head.weight"][0] == (128, 64)
    assert m["d2t"] == ((128,), torch.int64) and m["t2d"] == ((512,), torch.bool)
    assert eagle3_capture_layers(32) == [2, 16, 29]


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("use_bin", [False, True], ids=["safetensors", "bin"])
def test_written_heads_match_the_manifest_and_load(tiny_model_dir, tmp_path, fmt, use_bin):
    target = tiny_model_dir("llama")
    head_dir = make_eagle_head(tmp_path / fmt, target, fmt, use_bin=use_bin)
    cfg = load_head_config(head_dir)
    tensors = dict(iter_checkpoint(head_dir))
    manifest = eagle_head_manifest(fmt, vars(cfg))
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == manifest
    head = (EagleHead if fmt == "EAGLE" else Eagle3Head)(cfg)
    head.load_weights(iter(tensors.items()))
    torch.testing.assert_close(head.fc.weight, tensors["fc.weight"])
    if fmt == "EAGLE3":
        torch.testing.assert_close(head.lm_head.weight, tensors["lm_head.weight"])
        ids = torch.arange(4)
        assert head.draft_to_target(ids).tolist() == [0, 2, 4, 6]  # target id = draft id + d2t[draft id]
        assert torch.equal(tensors["t2d"].nonzero().flatten()[:4], head.draft_to_target(ids))


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_heads_run_a_forward_through_the_attention_backend(tiny_model_dir, tmp_path, fmt):
    target = tiny_model_dir("llama")
    head_dir = make_eagle_head(tmp_path / fmt, target, fmt)
    cfg = load_head_config(head_dir)
    head = (EagleHead if fmt == "EAGLE" else Eagle3Head)(cfg)
    head.load_weights(iter_checkpoint(head_dir))
    h, n = cfg.hidden_size, 5
    pool = ReqToTokenPool(2, 16, "cpu")
    kv = MHATokenToKVPool(16, torch.float32, 1, cfg.num_key_value_heads, h // cfg.num_attention_heads, "cpu")
    backend = build_backend("torch_native", pool, kv, cfg.num_attention_heads)
    slots = torch.arange(1, n + 1)
    pool.write(1, 0, slots)
    fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.zeros(n, dtype=torch.int64), torch.tensor([1]),
                      torch.tensor([n]), slots, torch.arange(n), seq_lens_cpu=[n], seq_lens_sum=n,
                      extend=ExtendInfo(num_tokens=n, seq_lens=torch.tensor([n]), prefix_lens=torch.tensor([0]),
                                        start_loc=torch.tensor([0]), seq_lens_cpu=[n], prefix_lens_cpu=[0]),
                      attn_backend=backend)
    embeds = torch.randn(n, h)
    with torch.inference_mode():
        if fmt == "EAGLE":
            out = head(embeds, torch.randn(n, h), fb.positions, fb)
            assert out.shape == (n, h)
        else:
            logits, hidden = head(embeds, torch.randn(n, 3 * h), fb.positions, fb)
            assert logits.shape == (n, cfg.draft_vocab_size) and hidden.shape == (n, h)
            assert torch.isfinite(logits).all()
