"""Tiny random-weight Hugging Face checkpoints for tests, demos and benchmarks.

`make_tiny_model(path, arch)` writes a complete model directory (config, safetensors weights,
generation config, tokenizer with a chat template) that `transformers` loads with the Auto*
classes, so plait can be checked against Hugging Face on the same weights without touching the hub.

Two choices matter for the tests built on top:

* Weights are re-initialised with larger scales than Hugging Face's std-0.02 init. That init gives
  nearly flat logits, so greedy decoding of a random model repeats one token and two engines can
  "agree" while computing different things. With the scales below, greedy output wanders over many
  tokens and the top-2 logit gap is usually well above float32 noise.
* The tokenizer is smaller than the model's vocabulary (rounded up to a multiple of 64, as real
  checkpoints pad theirs), and the lm_head rows of padding ids and special tokens are shrunk towards
  zero. Their logits then sit near 0 while the maximum over hundreds of ordinary logits lies several
  standard deviations above it, so greedy decoding never emits an id that the tokenizer cannot
  decode nor an end-of-sequence token that cuts a comparison short. Sampling can still pick them.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from plait import envs

TINY_ARCHS: tuple[str, ...] = ("llama", "llama3", "llama-tied", "mistral", "qwen2", "qwen3")
# Mixtures of experts (make_tiny_model builds them too; kept apart so tests over the dense presets stay as they are).
TINY_MOE_ARCHS: tuple[str, ...] = ("qwen2-moe", "qwen3-moe", "mixtral", "gpt-oss")

# Special tokens, in the order they get the lowest ids of the vocabulary.
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BOS_TOKEN = "<s>"
SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, IM_START, IM_END, BOS_TOKEN)

# Target size of the trained tokenizer (specials + 256 byte symbols + merges). Deliberately not a
# multiple of 64, so the model vocabulary carries padding rows as real checkpoints do.
TOKENIZER_VOCAB_SIZE = 500
VOCAB_MULTIPLE = 64

# Weight scales (see the module docstring). Measured on every preset with HF greedy decoding of 32
# tokens from short prompts: embeddings at std 1.0 and projections at std 0.1 give >= 8 distinct
# tokens everywhere and top-2 margins far above 1e-3 (tests/test_tiny_model.py checks the former).
EMBED_STD = 1.0
# A tied matrix is also the output head: at std 1.0 its logits (std ~16) are dominated by the
# current token's own embedding in the residual stream and greedy decoding repeats one token.
TIED_EMBED_STD = 0.3
PROJ_STD = 0.1
BIAS_STD = 0.1
NORM_NOISE_STD = 0.1
# Factor applied to the lm_head rows of special tokens and padding ids (see the module docstring).
QUIET_ROW_SCALE = 1e-2

# Qwen2's pre-tokenization regex (see _tokenizer_json for why it must match exactly).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Training text for the tokenizer. Mixed scripts and emoji make sure the byte-level BPE learns
# merges inside multi-byte characters and that tests see tokens which decode to partial UTF-8.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine receives requests from many users at
once, groups them into batches, and runs the model on the whole batch in a single forward pass. The
keys and values of every token are written into a paged cache, so that memory can be shared between
requests that start with the same prompt and returned to the pool as soon as a request finishes.

Once upon a time there was a small model that could only count: one, two, three, four, five, six,
seven, eight, nine, ten. It liked numbers such as 42, 1024 and 3.14159, and it answered every
question with a story about the weather. "What is the capital of France?" asked the user. "Paris,"
said the model, "where it is sunny today, with a light wind from the west."

Scheduling is the art of deciding what to run next. Prefill processes the prompt; decode produces
one token per step. Chunked prefill splits long prompts so that decoding requests are never starved,
and speculative decoding lets a draft model propose several tokens that the target model verifies.

Café au lait, crème brûlée, naïve façade, résumé, jalapeño, São Paulo, Zürich, Ærø, smørrebrød.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Señor Muñoz está en la habitación número
ocho. Ça va très bien, merci beaucoup ! Łódź, Kraków, Dvořák, Ελληνικά, русский язык.

你好，世界。今天天气很好，我们一起去公园散步吧。机器学习模型需要大量的数据和计算。
こんにちは、元気ですか。日本語のテキストも少し入れておきます。안녕하세요, 반갑습니다.

Emoji travel too: 🙂 😀 🚀 🎉 👍🏽 ❤️ 🌍 🍕 🐍 ✨ — and symbols like €, £, ¥, ©, ®, ™, °, ±, ×, ÷, ∑, √, ∞.
"""


@dataclass(frozen=True)
class _Preset:
    model_class: str  # name of the transformers class that builds the model
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    uses_bos: bool = True  # Llama-family checkpoints carry a BOS id; Qwen ones do not


_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}

_MOE_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,  # dense layers (Qwen); each expert's for Mixtral and gpt-oss is below
    "num_hidden_layers": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}

_PRESETS: dict[str, _Preset] = {
    "llama": _Preset(
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            **_COMMON,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "llama3": _Preset(
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            **_COMMON,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "tie_word_embeddings": False,
            # transformers 5 folds the old top-level `rope_theta` and `rope_scaling` into one
            # `rope_parameters` dict, and that is also what it writes to config.json. The small
            # original_max_position_embeddings (256) puts the low/high frequency cut-offs (256 and 64
            # positions) inside the 128-wide head, so all three regimes of the llama3 formula occur.
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        },
    ),
    "llama-tied": _Preset(
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            **_COMMON,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "mistral": _Preset(
        "MistralForCausalLM",
        "MistralConfig",
        {
            **_COMMON,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "tie_word_embeddings": False,
            "sliding_window": None,
            # One layer more than llama, so the two presets do not build identical weights.
            "num_hidden_layers": 3,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "qwen2": _Preset(
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {
            **_COMMON,
            # Qwen2Config has no head_dim field: it is hidden_size / num_attention_heads = 64.
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        uses_bos=False,
    ),
    "qwen3": _Preset(
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {
            **_COMMON,
            # head_dim * num_attention_heads (512) != hidden_size (256), as in real Qwen3 models,
            # so code that derives head_dim from hidden_size breaks visibly.
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        uses_bos=False,
    ),
    # Mixtures of experts: hidden 64, 8 experts of intermediate 32, top 2, with every routing
    # feature of the architecture on.
    "qwen2-moe": _Preset(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            **_MOE_COMMON,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        uses_bos=False,
    ),
    "qwen3-moe": _Preset(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **_MOE_COMMON,
            "num_experts": 8,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            # Layer 1 is dense among the sparse ones.
            "mlp_only_layers": [1],
            "decoder_sparse_step": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        uses_bos=False,
    ),
    "mixtral": _Preset(
        "MixtralForCausalLM",
        "MixtralConfig",
        {
            **_MOE_COMMON,
            "num_local_experts": 8,
            # Short enough that test prompts plus their generations cross it.
            "sliding_window": 12,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "gpt-oss": _Preset(
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            **_MOE_COMMON,
            "num_local_experts": 8,
            "attention_bias": True,
            # Alternating sliding (layer 0) and full layers, with a window test prompts cross.
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
        },
        uses_bos=False,
    ),
}


@functools.cache
def _tokenizer_json() -> str:
    """Train the byte-level BPE once per process and return its serialised form.

    The `tokenizers` trainer is deterministic for a fixed corpus and settings, so every process
    (and every call) gets the same vocabulary; caching only saves the few milliseconds of training.
    """
    tok = Tokenizer(models.BPE())
    # Exactly the normalizer and pre-tokenizer of Qwen2's tokenizer (the GPT-4-style split regex,
    # then byte-level mapping). transformers 5's AutoTokenizer ignores tokenizer.json's pipeline
    # for model_type "qwen2" and rebuilds a Qwen2Tokenizer from its vocab and merges; with the same
    # pipeline here, every loader (tokenizers, AutoTokenizer for any preset) encodes identically.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, not only those in the corpus, so any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok.to_str()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@functools.cache
def _covering_tokenizer_json(vocab_size: int) -> str:
    """The trained tokenizer with its vocabulary extended to ``vocab_size`` ids: each id past the
    trained ones decodes to a space and two or more lowercase letters (a word of its own), so
    every id a model of that vocabulary samples decodes to text, as with a real checkpoint's tokenizer.
    Encoding is unchanged (no merge reaches the added entries)."""
    spec = json.loads(_tokenizer_json())
    vocab: dict[str, int] = spec["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in spec["added_tokens"]}
    next_id = max([*vocab.values(), *(t["id"] for t in spec["added_tokens"])]) + 1
    n = 27  # bijective base 26 from here: "aa", "ab", ..., "zz", "aaa", ...: distinct words
    while next_id < vocab_size:
        word, k = "", n
        while k:
            k, r = divmod(k - 1, 26)
            word = chr(ord("a") + r) + word
        n += 1
        token = "\u0120" + word  # the byte-level alphabet's space
        if token not in taken:
            vocab[token] = next_id
            taken.add(token)
            next_id += 1
    return json.dumps(spec)


def save_tokenizer(path: pathlib.Path, uses_bos: bool, cover_vocab: int | None = None) -> dict[str, int]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return special ids.
    ``cover_vocab``: extend the vocabulary to that many ids (``_covering_tokenizer_json``)."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json() if cover_vocab is None else _covering_tokenizer_json(cover_vocab))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    special: dict[str, str] = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    if uses_bos:
        special["bos_token"] = BOS_TOKEN
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        additional_special_tokens=[IM_START, IM_END],
        **special,
    )
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json (transformers 5
    # otherwise writes it to chat_template.jinja), where older readers and plait's loader look.
    hf_tok.save_pretrained(path, save_jinja_files=False)
    # transformers 5 no longer writes special_tokens_map.json; many tools still read it.
    smap: dict[str, Any] = dict(special)
    smap["additional_special_tokens"] = [IM_START, IM_END]
    (path / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")
    return ids


def _reinit_weights(model: torch.nn.Module, quiet_rows: list[int], seed: int) -> None:
    """Replace HF's std-0.02 init with scales that make random greedy decoding non-degenerate."""
    gen = torch.Generator().manual_seed(seed)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    embed_std = TIED_EMBED_STD if tied else EMBED_STD
    with torch.no_grad():
        # Sorted names make the draw order independent of module registration details.
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("embed_tokens.weight"):
                param.normal_(0.0, embed_std, generator=gen)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, PROJ_STD, generator=gen)
            elif name.endswith("norm.weight"):
                # 1 + noise, so a loader that silently skips a norm weight gives different logits.
                param.normal_(1.0, NORM_NOISE_STD, generator=gen)
            elif name.endswith(".bias"):
                # Qwen2 q/k/v biases: HF zeros them, which would hide a loader that drops them.
                param.normal_(0.0, BIAS_STD, generator=gen)
            elif name.endswith("sinks"):
                # gpt-oss's per-head attention sinks, on the scale of the attention logits.
                param.normal_(0.0, 1.0, generator=gen)
            elif param.dim() in (2, 3):  # 3-D: fused expert projections (and their biases are 2-D)
                param.normal_(0.0, PROJ_STD, generator=gen)
            else:
                raise AssertionError(f"unexpected parameter {name} with shape {tuple(param.shape)}")
        # With tied weights the quiet rows shrink in the input embedding too; that is harmless:
        # padding ids are never fed, and special tokens pass through the first RMSNorm anyway.
        model.get_output_embeddings().weight[quiet_rows] *= QUIET_ROW_SCALE


def _apply_overrides(config_cls: type, base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return `base` updated with `overrides`, after checking the names and folding legacy rope keys.

    Unknown names raise, because the config classes accept any keyword and a typo would otherwise
    silently build the unmodified preset. The pre-5 names `rope_theta` and `rope_scaling` are
    folded into `rope_parameters` here: given next to `rope_parameters`, transformers 5.24 drops
    `rope_theta` without a word.
    """
    overrides = dict(overrides)
    known = set(vars(config_cls())) | set(config_cls.__annotations__) | {"rope_theta", "rope_scaling"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown config fields for {config_cls.__name__}: {unknown}")
    rope = dict(overrides.pop("rope_parameters", base["rope_parameters"]))
    if "rope_scaling" in overrides:
        scaling = overrides.pop("rope_scaling") or {"rope_type": "default"}
        rope = {"rope_theta": rope["rope_theta"], **scaling}
    if "rope_theta" in overrides:
        rope["rope_theta"] = float(overrides.pop("rope_theta"))
    return {**base, **overrides, "rope_parameters": rope}


def make_tiny_model(
    path: str | os.PathLike[str],
    arch: str,
    seed: int = 0,
    *,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> pathlib.Path:
    """Write a tiny random `arch` checkpoint in Hugging Face format to `path` and return the path.

    `config_overrides` replace preset config fields (e.g. `num_hidden_layers=3`); unknown names
    raise, so a typo cannot silently build the preset. `max_shard_size` (e.g. "200KB") writes
    several safetensors shards plus `model.safetensors.index.json`.
    """
    import transformers

    if arch not in _PRESETS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS + TINY_MOE_ARCHS}")
    preset = _PRESETS[arch]
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)

    special_ids = save_tokenizer(out, preset.uses_bos)
    tokenizer_len = len(Tokenizer.from_str(_tokenizer_json()).get_vocab(with_added_tokens=True))

    config_cls = getattr(transformers, preset.config_class)
    base: dict[str, Any] = {
        **preset.config,
        "vocab_size": _round_up(tokenizer_len, VOCAB_MULTIPLE),
        "bos_token_id": special_ids[BOS_TOKEN] if preset.uses_bos else None,
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[EOS_TOKEN],
        "dtype": "float32",
    }
    config = config_cls(**_apply_overrides(config_cls, base, config_overrides))
    if config.vocab_size < tokenizer_len:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer ({tokenizer_len})")
    config.architectures = [preset.model_class]

    # HF's constructor runs its own init from the global generator. Seed it (so nothing depends on
    # the caller's RNG state) inside fork_rng (so the caller's RNG state is left as it was).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, preset.model_class)(config).to(torch.float32).eval()
    quiet = sorted(set(special_ids.values()) | set(range(tokenizer_len, config.vocab_size)))
    _reinit_weights(model, quiet, seed)

    # Chat models stop at the end-of-turn marker as well as at end-of-text, as Qwen's do.
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[special_ids[EOS_TOKEN], special_ids[IM_END]],
        pad_token_id=special_ids[EOS_TOKEN],
    )
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **save_kwargs)
    return out


def cache_root() -> pathlib.Path:
    """plait's cache directory (``PLAIT_CACHE``, else ~/.cache/plait): the demo models live here."""
    env = envs.CACHE.get()
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "plait"


def build_in_place(target: pathlib.Path, build: Callable[[pathlib.Path], object], marker: str) -> pathlib.Path:
    """``target`` (a directory), built by ``build(directory)`` unless ``target / marker`` exists.

    Built into a temporary sibling directory and renamed into place, so a crash or a concurrent
    builder never leaves a half-written directory where readers look; a builder that loses the rename
    race simply uses the winner's copy."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (target exists and is non-empty); keep its copy.
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def demo_model_path() -> pathlib.Path:
    """Return the tiny random-weight llama demo checkpoint (the demo's offline fallback, see
    plait.models.demo), building it on first use (``build_in_place``)."""
    return build_in_place(cache_root() / "demo-model", lambda d: make_tiny_model(d, "llama", seed=0), "config.json")
