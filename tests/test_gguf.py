"""GGUF checkpoints (plait.models.gguf_loader): values, permutation, config, tokenizer, greedy
equality with the checkpoint a file came from, and the errors for what plait does not read."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from plait.models.gguf_loader import SUPPORTED_TENSOR_TYPES, dequantized, gguf_hf_config, iter_gguf_weights
from plait.models.loader import load_model, load_model_config, load_tokenizer
from plait.testing.gguf_writer import K_QUANTS, write_gguf
from tests.helpers import make_engine

PROMPT = [5, 17, 42, 99, 7, 123, 64, 250]


@pytest.fixture(autouse=True)
def own_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers converted from the tests' files are cached in a temporary plait cache, not the user's
    (the SmolLM2 test reads the real cache, where the demo model lives)."""
    if "smollm2" not in request.node.name:
        monkeypatch.setenv("PLAIT_CACHE", str(tmp_path_factory.mktemp("plait-cache")))


@pytest.fixture(scope="module")
def two_layer_llama(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from plait.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("llama2"), "llama", seed=0)


def _gguf(src: pathlib.Path, tmp: pathlib.Path, name: str = "model.gguf", **kwargs) -> pathlib.Path:
    out = tmp / name.removesuffix(".gguf")
    out.mkdir(parents=True, exist_ok=True)
    return write_gguf(src, out / name, **kwargs)


# One tensor of each type; q/k included (their rows are permuted on disk and unpermuted at load).
TYPE_OF = {
    "blk.0.attn_q.weight": "Q8_0",
    "blk.0.attn_k.weight": "Q4_0",
    "blk.1.attn_q.weight": "Q4_1",
    "blk.1.attn_k.weight": "BF16",
    "blk.0.attn_v.weight": "F16",
    "blk.1.attn_v.weight": "F32",
    "blk.0.attn_output.weight": "Q4_K",
    "blk.0.ffn_down.weight": "Q5_K",
    "blk.0.ffn_up.weight": "Q6_K",
    "token_embd.weight": "Q8_0",
    "output.weight": "F16",
}


def test_each_supported_tensor_type_loads_to_ggufs_own_dequantization(two_layer_llama, tmp_path):
    import gguf

    assert set(TYPE_OF.values()) == set(SUPPORTED_TENSOR_TYPES)
    path = _gguf(two_layer_llama, tmp_path, tensor_types=TYPE_OF)
    source = load_file(two_layer_llama / "model.safetensors")
    loaded = dict(iter_gguf_weights(path, gguf_hf_config(path)))
    assert set(loaded) == set(source)
    on_disk = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    hf_of = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
             "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
             "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.1.attn_k.weight": "model.layers.1.self_attn.k_proj.weight",
             "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
             "blk.1.attn_v.weight": "model.layers.1.self_attn.v_proj.weight",
             "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
             "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
             "token_embd.weight": "model.embed_tokens.weight",
             "output.weight": "lm_head.weight"}
    for gguf_name, qtype in TYPE_OF.items():
        hf_name = hf_of[gguf_name]
        got = loaded[hf_name]
        assert on_disk[gguf_name].tensor_type.name == qtype
        assert got.dtype == torch.float32 and tuple(got.shape) == tuple(source[hf_name].shape), hf_name
        if qtype in K_QUANTS:
            # Random blocks: the values are whatever gguf decodes from the file's bytes.
            expected = torch.from_numpy(gguf.quants.dequantize(on_disk[gguf_name].data, on_disk[gguf_name].tensor_type))
            assert torch.isfinite(got).all()
        else:
            # gguf's round trip of the source weights (quantization is per row, so the q/k row
            # permutation on disk commutes with it).
            qt = gguf.GGMLQuantizationType[qtype]
            expected = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(source[hf_name].numpy(), qt), qt).astype(np.float32))
            step = source[hf_name].abs().max() / (7 if qtype.startswith("Q4") else 100)
            assert (got - source[hf_name]).abs().max() <= step, f"{qtype} is not close to the source"
        assert torch.equal(got, expected.reshape(got.shape)), f"{gguf_name} ({qtype})"


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_an_f32_gguf_loads_exactly_the_weights_and_config_it_was_written_from(arch, tiny_model_dir, tmp_path):
    src = tiny_model_dir(arch)
    path = _gguf(src, tmp_path)
    cfg = gguf_hf_config(path)
    mc = load_model_config(str(path))
    hf = load_model_config(str(src))
    assert mc.checkpoint_format == "gguf" and mc.architecture == hf.architecture
    for field in ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "context_length"):
        assert getattr(mc, field) == getattr(hf, field), field
    assert cfg.rms_norm_eps == pytest.approx(hf.hf_config.rms_norm_eps)
    # llama3 rope scaling is recovered from the rope_freqs tensor (metadata does not carry it).
    assert cfg.rope_parameters == pytest.approx(hf.hf_config.rope_parameters)
    assert cfg.tie_word_embeddings == hf.hf_config.tie_word_embeddings
    assert set(mc.eos_token_ids) == set(hf.eos_token_ids)
    source = load_file(src / "model.safetensors")
    loaded = dict(iter_gguf_weights(path, cfg))
    assert set(loaded) == set(source)
    for name, w in source.items():
        assert torch.equal(loaded[name], w), name  # q/k included: the rotary permutation is undone


def test_transformers_reads_the_tests_gguf_back_to_its_source(two_layer_llama, tmp_path):
    """The writer's q/k permutation is llama.cpp's: transformers' GGUF loader undoes it exactly."""
    from transformers import AutoModelForCausalLM

    path = _gguf(two_layer_llama, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    state = model.state_dict()
    for name, w in load_file(two_layer_llama / "model.safetensors").items():
        assert torch.equal(state[name], w), name


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_a_gguf_gives_the_greedy_tokens_of_its_hf_checkpoint(arch, tiny_model_dir, hf_reference, tmp_path):
    src = tiny_model_dir(arch)
    path = _gguf(src, tmp_path)
    ref = hf_reference(src, PROMPT, 12)
    # The directory holding the file is a GGUF checkpoint too (load_format auto -> gguf).
    with make_engine(path.parent, dtype="float32") as engine:
        assert engine.model_config.checkpoint_format == "gguf"
        out = engine.generate(PROMPT, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert out.token_ids == ref.tokens


def test_the_tokenizer_and_chat_template_come_from_the_file(two_layer_llama, tmp_path):
    from transformers import AutoTokenizer

    path = _gguf(two_layer_llama, tmp_path)
    hf, tok = AutoTokenizer.from_pretrained(two_layer_llama), load_tokenizer(str(path))
    text = "The quick brown fox, café au lait, 你好 🙂"
    assert tok.encode(text) == hf.encode(text)
    assert tok.decode(hf.encode(text)) == text
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\n")


def test_the_cached_tokenizer_is_the_one_built_from_the_file(two_layer_llama, tmp_path):
    from plait.models.gguf_loader import load_gguf_tokenizer

    path = _gguf(two_layer_llama, tmp_path)
    built = load_gguf_tokenizer(path)
    first = load_gguf_tokenizer(path, tmp_path / "tok-cache")  # builds and saves
    (saved,) = (tmp_path / "tok-cache").iterdir()
    again = load_gguf_tokenizer(path, tmp_path / "tok-cache")  # reads the saved copy
    text = "<|im_start|>user\nThe quick brown fox, café 你好 🙂<|im_end|>"
    chat = [{"role": "user", "content": "hi"}]
    for tok in (first, again):
        assert tok.encode(text) == built.encode(text)
        assert tok.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(chat, tokenize=False)
        assert (tok.eos_token, tok.bos_token, len(tok)) == (built.eos_token, built.bos_token, len(built))
    assert sorted(p.name for p in (tmp_path / "tok-cache").iterdir()) == [saved.name]  # no temporary left


def test_an_unsupported_tensor_type_fails_naming_the_type_and_the_tensor(two_layer_llama, tmp_path):
    path = _gguf(two_layer_llama, tmp_path, tensor_types={"blk.1.ffn_gate.weight": "Q5_0"})
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_gate\.weight' has type Q5_0.*supported types: F32"):
        load_model_config(str(path))


def test_an_unsupported_architecture_fails_naming_it(two_layer_llama, tmp_path):
    path = _gguf(two_layer_llama, tmp_path, architecture="gemma2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gemma2'.*supported: \['llama', 'qwen2', 'qwen3'\]"):
        load_model_config(str(path))


def test_load_format_must_match_the_checkpoint(two_layer_llama, tmp_path):
    path = _gguf(two_layer_llama, tmp_path)
    mc = load_model_config(str(path))
    with pytest.raises(ValueError, match="load_format 'safetensors' does not match .* a gguf checkpoint"):
        load_model(mc, "cpu", "safetensors")
    with pytest.raises(ValueError, match="load_format 'gguf' does not match .* a safetensors checkpoint"):
        load_model(load_model_config(str(two_layer_llama)), "cpu", "gguf")


def test_a_directory_with_several_gguf_files_asks_for_one(two_layer_llama, tmp_path):
    path = _gguf(two_layer_llama, tmp_path)
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match=r"several GGUF files \['model.gguf', 'other.gguf'\]"):
        load_model_config(str(path.parent))


def test_dequantized_shapes_follow_hf_order(two_layer_llama, tmp_path):
    """GGML lists shapes fastest dimension first; a [out, in] weight comes back [out, in]."""
    import gguf

    path = _gguf(two_layer_llama, tmp_path, default_type="Q8_0")
    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_down.weight")
    assert list(t.shape) == [512, 256]  # GGML order: in (intermediate) first
    assert dequantized(t).shape == (256, 512)


def test_plait_on_smollm2s_gguf_gives_transformers_greedy_tokens(monkeypatch):
    """The demo model's own file (a llama.cpp Q4_1 conversion), fp32: plait reads and runs it as
    transformers does, q/k permutation and chat template included, and answers in English."""
    from transformers import AutoModelForCausalLM

    import plait
    from plait.models.demo import demo_gguf_path

    monkeypatch.delenv("PLAIT_DEMO_MODEL", raising=False)
    path = demo_gguf_path()
    with plait.Engine(dtype="float32", max_total_tokens=512) as engine:  # no model: the demo model
        assert pathlib.Path(engine.model_config.path) == path
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        prompt_ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)
        out = engine.generate(prompt_ids, {"max_new_tokens": 10, "temperature": 0})
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=len(out.token_ids), do_sample=False)
    assert out.token_ids == ref[0, len(prompt_ids):].tolist()
    assert "Paris" in out.text
