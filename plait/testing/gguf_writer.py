"""Write a Hugging Face checkpoint directory (``make_tiny_model``'s) as a GGUF file laid out as
llama.cpp's converter lays it out, for the tests of plait.models.gguf_loader.

What llama.cpp does and this writer repeats: the metadata under ``{arch}.*`` keys, the byte-level BPE
vocabulary under ``tokenizer.ggml.*`` (tokens by id, types, merges, special ids, chat template),
tensors under GGUF names with Llama's ``attn_q`` / ``attn_k`` rows permuted for GGML's interleaved
rope, each tensor in a chosen type, and Llama 3's rope scaling as a ``rope_freqs`` tensor. ``gguf``
quantizes F16, BF16, Q8_0, Q4_0, Q4_1 and Q5_0 itself; it has no K-quant quantizer, so Q4_K / Q5_K /
Q6_K tensors are written as random blocks with finite fp16 scales (their values then come from the
bytes, not from the checkpoint).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import numpy as np
from safetensors import safe_open

from plait.models.gguf_loader import GLOBAL_TENSORS, LAYER_TENSORS, ROPE_FREQS, llama3_rope_factors

K_QUANTS: tuple[str, ...] = ("Q4_K", "Q5_K", "Q6_K")
# Byte offsets of the fp16 scales inside one block of each K-quant (ggml's block_q4_K / q5_K / q6_K).
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_K_SCALE_STD = 1e-2
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_UNUSED = 1, 3, 5
# Hugging Face model_type -> GGUF general.architecture.
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's rotary row permutation of q_proj / k_proj (convert_hf_to_gguf's ``permute``): within
    each head, rows ``[first half, second half]`` become interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def random_k_quant(shape: tuple[int, int], qtype: str, seed: int) -> np.ndarray:
    """Random ``qtype`` blocks for a ``[rows, cols]`` tensor: random quants and sub-scales, finite fp16
    super-block scales. Returns the raw bytes as uint8 ``[rows, bytes per row]``."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows, cols = shape
    if cols % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} values, got {cols}")
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scales = (gen.standard_normal(blocks.shape[0]) * _K_SCALE_STD).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _gguf_names(num_layers: int) -> dict[str, str]:
    """Hugging Face parameter name -> GGUF tensor name."""
    names = {f"{hf}.{leaf}": f"{g}.{leaf}" for g, hf in GLOBAL_TENSORS.items() for leaf in ("weight", "bias")}
    for i in range(num_layers):
        for g, hf in LAYER_TENSORS.items():
            for leaf in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{leaf}"] = f"blk.{i}.{g}.{leaf}"
    return names


def _write_tokenizer(writer: object, src: pathlib.Path, config: dict, vocab_size: int) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    by_id.update({a["id"]: a["content"] for a in tok["added_tokens"]})
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [_TOKEN_CONTROL if i in special else _TOKEN_NORMAL if i in by_id else _TOKEN_UNUSED
             for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = writer
    w.add_tokenizer_model("gpt2")  # type: ignore[attr-defined]
    # make_tiny_model's tokenizer splits text with Qwen2's regex, which llama.cpp names "qwen2".
    w.add_tokenizer_pre("qwen2")  # type: ignore[attr-defined]
    w.add_token_list(tokens)  # type: ignore[attr-defined]
    w.add_token_types(types)  # type: ignore[attr-defined]
    w.add_token_merges(merges)  # type: ignore[attr-defined]
    if config.get("bos_token_id") is not None:
        w.add_bos_token_id(config["bos_token_id"])  # type: ignore[attr-defined]
    w.add_eos_token_id(config["eos_token_id"])  # type: ignore[attr-defined]
    gen = src / "generation_config.json"
    extra = [i for i in (json.loads(gen.read_text()).get("eos_token_id") or []) if i != config["eos_token_id"]] \
        if gen.exists() else []
    if extra:
        w.add_eot_token_id(extra[0])  # type: ignore[attr-defined]
    if config.get("pad_token_id") is not None:
        w.add_pad_token_id(config["pad_token_id"])  # type: ignore[attr-defined]
    w.add_add_bos_token(False)  # type: ignore[attr-defined]
    if tok_config.get("chat_template"):
        w.add_chat_template(tok_config["chat_template"])  # type: ignore[attr-defined]


def write_gguf(src: str | pathlib.Path, dest: str | pathlib.Path, tensor_types: Mapping[str, str] | None = None,
               *, default_type: str = "F32", architecture: str | None = None, seed: int = 0) -> pathlib.Path:
    """Write the checkpoint at ``src`` as the GGUF file ``dest``.

    ``tensor_types`` maps GGUF tensor names (``blk.0.ffn_up.weight``) to type names; the others are
    ``default_type`` (1-D tensors stay F32, as llama.cpp keeps them). ``architecture`` overrides
    general.architecture (to write a file of an architecture plait does not support)."""
    import gguf

    src, dest = pathlib.Path(src), pathlib.Path(dest)
    config = json.loads((src / "config.json").read_text())
    arch = architecture or _GGUF_ARCH[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    names = _gguf_names(config["num_hidden_layers"])
    types = dict(tensor_types or {})

    w = gguf.GGUFWriter(str(dest), arch)
    w.add_name(src.name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config["rope_parameters"]
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    _write_tokenizer(w, src, config, config["vocab_size"])

    if rope.get("rope_type") == "llama3":
        # llama.cpp writes the llama3 scaling as per-frequency divisors, not as metadata.
        w.add_tensor(ROPE_FREQS, llama3_rope_factors(float(rope["rope_theta"]), head_dim, rope).astype(np.float32))
    with safe_open(str(src / "model.safetensors"), framework="np") as f:
        for k, hf_name in enumerate(sorted(f.keys())):
            if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
                continue
            values = f.get_tensor(hf_name).astype(np.float32)
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                values = permute_qk(values, heads if ".q_proj." in hf_name else kv_heads)
            name = names[hf_name]
            qtype = types.pop(name, default_type if values.ndim > 1 else "F32")
            if qtype in K_QUANTS:
                data = random_k_quant(values.shape, qtype, seed * 1000 + k)
            else:
                data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    if types:
        raise ValueError(f"tensor_types names tensors the checkpoint does not have: {sorted(types)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest
