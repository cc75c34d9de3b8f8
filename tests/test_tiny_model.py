"""Tests for plait.models.tiny: tiny random Hugging Face checkpoints."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import plait.models.tiny as tiny_model
from plait.testing import TINY_ARCHS, demo_model_path, make_tiny_model

# (arch) -> (model class, hidden, q heads, kv heads, head_dim, tied)
EXPECTED = {
    "llama": ("LlamaForCausalLM", 256, 4, 2, 64, False),
    "llama3": ("LlamaForCausalLM", 256, 2, 1, 128, False),
    "llama-tied": ("LlamaForCausalLM", 256, 4, 1, 64, True),
    "mistral": ("MistralForCausalLM", 256, 4, 2, 64, False),
    "qwen2": ("Qwen2ForCausalLM", 256, 4, 2, 64, False),
    "qwen3": ("Qwen3ForCausalLM", 256, 4, 2, 128, False),
}

PROMPTS = ["Once upon a time", "你好", "The capital of France is"]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """One checkpoint per preset, shared by the read-only tests of this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="module")
def greedy(built: dict[str, pathlib.Path]) -> dict[str, list[list[int]]]:
    """HF greedy continuations (new tokens only) of PROMPTS for every preset."""
    out: dict[str, list[list[int]]] = {}
    # Decode steps of a model this small are pure overhead; intra-op threads only add contention
    # (several times slower on a busy 2-core CI box), so run single-threaded and restore after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for arch, path in built.items():
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            runs = []
            for prompt in PROMPTS:
                ids = tok(prompt, return_tensors="pt").input_ids
                seq = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False)
                runs.append(seq[0, ids.shape[1] :].tolist())
            out[arch] = runs
    finally:
        torch.set_num_threads(threads)
    return out


def _weights(path: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def test_tiny_archs_cover_every_preset() -> None:
    assert set(TINY_ARCHS) == set(EXPECTED)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_preset_loads_with_auto_classes(built: dict[str, pathlib.Path], arch: str) -> None:
    path = built[arch]
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "model.safetensors",
    ):
        assert (path / name).is_file(), name
    config = AutoConfig.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == EXPECTED[arch][0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok("hello world", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_preset_shapes(built: dict[str, pathlib.Path], arch: str) -> None:
    _, hidden, heads, kv_heads, head_dim, tied = EXPECTED[arch]
    config = AutoConfig.from_pretrained(built[arch])
    assert config.hidden_size == hidden
    assert config.num_attention_heads == heads
    assert config.num_key_value_heads == kv_heads
    assert getattr(config, "head_dim", hidden // heads) == head_dim
    assert config.tie_word_embeddings is tied
    assert config.num_hidden_layers >= 2
    assert config.max_position_embeddings == 2048
    assert config.rms_norm_eps == 1e-6
    assert config.dtype == torch.float32


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_vocab_is_tokenizer_rounded_up_to_64(built: dict[str, pathlib.Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(built[arch])
    n_tok = len(AutoTokenizer.from_pretrained(built[arch]))
    assert config.vocab_size % 64 == 0
    assert n_tok < config.vocab_size < n_tok + 64  # padding rows exist, as in real checkpoints


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_special_token_ids_match_tokenizer(built: dict[str, pathlib.Path], arch: str) -> None:
    config = AutoConfig.from_pretrained(built[arch])
    tok = AutoTokenizer.from_pretrained(built[arch])
    gen = json.loads((built[arch] / "generation_config.json").read_text())
    assert config.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>") == tok.eos_token_id
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    if arch.startswith("qwen"):
        assert config.bos_token_id is None
    else:
        assert config.bos_token_id == tok.convert_tokens_to_ids("<s>") == tok.bos_token_id


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_auto_tokenizer_matches_tokenizer_json(built: dict[str, pathlib.Path], arch: str) -> None:
    # transformers rebuilds a Qwen2Tokenizer for model_type qwen2 instead of reading tokenizer.json's
    # pipeline; the factory's pre-tokenizer must make that invisible.
    tok = AutoTokenizer.from_pretrained(built[arch])
    raw = Tokenizer.from_file(str(built[arch] / "tokenizer.json"))
    for text in tiny_model.CORPUS.splitlines() + ["  x 123456789\t\n\nI'm", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text) == raw.encode(text).ids, text


def test_qwen2_qkv_biases_are_nonzero(built: dict[str, pathlib.Path]) -> None:
    biases = {k: v for k, v in _weights(built["qwen2"]).items() if k.endswith(".bias")}
    assert {k.split(".")[-2] for k in biases} == {"q_proj", "k_proj", "v_proj"}
    assert all(v.abs().min() > 0 for v in biases.values())


def test_llama3_rope_scaling_round_trips_and_is_applied(built: dict[str, pathlib.Path]) -> None:
    raw = json.loads((built["llama3"] / "config.json").read_text())
    rope = raw["rope_parameters"]  # transformers 5 writes rope_parameters, not rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    config = AutoConfig.from_pretrained(built["llama3"])
    assert config.rope_parameters == rope
    model = AutoModelForCausalLM.from_pretrained(built["llama3"])
    inv_freq = model.model.rotary_emb.inv_freq
    # The llama3 formula written out: keep short wavelengths, divide long ones by `factor`,
    # interpolate in between.
    dim, theta, orig = config.head_dim, rope["rope_theta"], rope["original_max_position_embeddings"]
    base = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    wavelen = 2 * math.pi / base
    low_wl, high_wl = orig / rope["low_freq_factor"], orig / rope["high_freq_factor"]
    smooth = (orig / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
    expected = torch.where(wavelen > low_wl, base / rope["factor"], base)
    mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    expected = torch.where(mid, (1 - smooth) * base / rope["factor"] + smooth * base, expected)
    torch.testing.assert_close(inv_freq, expected)
    assert (wavelen > low_wl).any() and mid.any() and (wavelen < high_wl).any()  # all three regimes


def test_config_overrides_apply(tmp_path: pathlib.Path) -> None:
    path = make_tiny_model(tmp_path, "llama", num_hidden_layers=3, intermediate_size=384, rope_theta=5000.0)
    config = AutoConfig.from_pretrained(path)
    assert config.num_hidden_layers == 3
    assert config.intermediate_size == 384
    assert config.rope_parameters["rope_theta"] == 5000.0
    weights = _weights(path)
    assert "model.layers.2.mlp.up_proj.weight" in weights
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (384, 256)


def test_unknown_config_override_is_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="num_hiden_layers"):
        make_tiny_model(tmp_path, "llama", num_hiden_layers=3)


def test_unknown_arch_is_rejected(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="gpt2"):
        make_tiny_model(tmp_path, "gpt2")


def test_same_seed_gives_identical_weights(tmp_path: pathlib.Path) -> None:
    a = _weights(make_tiny_model(tmp_path / "a", "qwen2", seed=7))
    b = _weights(make_tiny_model(tmp_path / "b", "qwen2", seed=7))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seed_gives_different_weights(tmp_path: pathlib.Path) -> None:
    a = _weights(make_tiny_model(tmp_path / "a", "qwen2", seed=7))
    b = _weights(make_tiny_model(tmp_path / "b", "qwen2", seed=8))
    assert a.keys() == b.keys()
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_build_leaves_caller_rng_untouched(tmp_path: pathlib.Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    make_tiny_model(tmp_path, "llama", seed=5)
    assert torch.equal(torch.rand(4), expected)


def test_sharded_write_has_index_and_loads(tmp_path: pathlib.Path) -> None:
    path = make_tiny_model(tmp_path / "sharded", "llama", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 2
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    model = AutoModelForCausalLM.from_pretrained(path)
    single = _weights(make_tiny_model(tmp_path / "single", "llama"))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in single.items())


def test_tokenizer_round_trips_multibyte_text(built: dict[str, pathlib.Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built["llama"])
    text = "héllo 你好 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # Some token covers only part of a character's UTF-8 bytes: the case detokenizers must handle.
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_tokenizer_is_deterministic_across_processes() -> None:
    # BPE training must not depend on per-process hash seeds, or two processes would disagree.
    code = (
        "import hashlib, plait.models.tiny as t;print(hashlib.sha256(t._tokenizer_json().encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert other.stdout.strip() == hashlib.sha256(tiny_model._tokenizer_json().encode()).hexdigest()


def test_chat_template_renders_with_generation_prompt(built: dict[str, pathlib.Path]) -> None:
    tok = AutoTokenizer.from_pretrained(built["qwen3"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == without + "<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3  # markers are single tokens


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_output_varies(greedy: dict[str, list[list[int]]], arch: str) -> None:
    for run in greedy[arch]:
        assert len(set(run)) >= 8, run


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_never_emits_special_or_padding_ids(
    built: dict[str, pathlib.Path], greedy: dict[str, list[list[int]]], arch: str
) -> None:
    # Full-length runs: no end-of-sequence cuts a comparison short, no undecodable padding id.
    tok = AutoTokenizer.from_pretrained(built[arch])
    special = set(tok.all_special_ids)
    for run in greedy[arch]:
        assert len(run) == GREEDY_TOKENS
        assert all(t < len(tok) and t not in special for t in run), run


def test_demo_model_path_builds_once_and_is_reused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path))
    first = demo_model_path()
    assert first == tmp_path / "demo-model"
    assert AutoConfig.from_pretrained(first).model_type == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["demo-model"]  # no temp dir left behind

    def fail(*args: object, **kwargs: object) -> pathlib.Path:
        raise AssertionError("demo model rebuilt")

    monkeypatch.setattr(tiny_model, "make_tiny_model", fail)
    assert demo_model_path() == first
