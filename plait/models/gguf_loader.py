"""Read a GGUF checkpoint (llama.cpp's single-file format): the model config from its metadata, dense
weights dequantized at load, and the tokenizer with its chat template.

The ``gguf`` package parses the file. Three things differ from a Hugging Face directory:

* Shapes are in GGML order (the fastest-varying dimension first): a ``[out, in]`` linear weight is
  listed as ``(in, out)``. The reader's arrays are already in row-major (NumPy) order; the listed
  shape is reversed to get the Hugging Face one.
* llama.cpp's converter row-permutes Llama's ``attn_q`` and ``attn_k`` so that the two halves of each
  rotary pair sit next to each other (GGML's interleaved rope). Hugging Face's rope rotates the first
  half of a head against the second, so the permutation is undone here, as transformers' GGUF loader
  does. Qwen2 and Qwen3 files are written unpermuted (llama.cpp runs them with the NeoX rope).
* Quantized tensors are blocks of packed integers with fp16 scales; they are dequantized to float32
  (``gguf.quants.dequantize``) and then cast to the engine dtype by the layers' weight loaders, so the
  model runs dense.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.layers.rotary import llama3_inv_freq
from plait.models.tiny import build_in_place

GGUF_SUFFIX = ".gguf"

# GGUF's general.architecture -> the Hugging Face architecture plait builds for it.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
# Architectures whose attn_q / attn_k rows llama.cpp permuted for GGML's interleaved rope.
_PERMUTED_QK = frozenset({"llama"})

# Tensor types dequantized at load (names of gguf.GGMLQuantizationType members).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor names -> Hugging Face parameter names (the leaf ".weight" / ".bias" is kept).
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^(\w+)\.(weight|bias)$")
# Llama 3 rope: llama.cpp stores the llama3 scaling as a tensor of per-frequency divisors, not as
# metadata; the settings are recovered from it (see _llama3_rope).
ROPE_FREQS = "rope_freqs.weight"


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the path itself when it ends in ``.gguf``, the one ``.gguf`` file of
    a directory, or None (not a GGUF checkpoint). A directory with several raises, listing them."""
    p = Path(path)
    if p.suffix == GGUF_SUFFIX:
        if not p.is_file():
            raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist")
        return p
    if not p.is_dir():
        return None
    files = sorted(q for q in p.glob(f"*{GGUF_SUFFIX}") if q.is_file())
    if len(files) > 1:
        raise ValueError(f"{str(p)!r} holds several GGUF files {[q.name for q in files]}: pass --model PATH/FILE.gguf")
    return files[0] if files else None


def _reader(path: str) -> Any:
    """A memory-mapped reader (tensor data is read when a tensor is dequantized). Parsing the metadata
    is slow (the reader unpacks every vocabulary string), so one reader serves the config and the
    weights of a start; a rewritten file (new size or mtime) gets a new one."""
    st = os.stat(path)
    return _cached_reader(os.path.realpath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata (arrays other than short numeric lists are skipped: the tokenizer's
    vocabulary is read by transformers, not here)."""
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.split(".")[-1] in ("tokens", "merges", "token_type", "scores"):
            continue
        out[key] = field.contents()
    return out


def check_tensor_types(reader: Any) -> None:
    """Raise on the first tensor whose type plait does not dequantize, naming the type and the tensor."""
    for t in reader.tensors:
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which plait does not dequantize; "
                f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 ``scaling``: per rotary frequency, the divisor that
    turns the base inverse frequency into the scaled one (1 for high frequencies, ``factor`` for low)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (inv_freq / llama3_inv_freq(inv_freq, scaling)).numpy()


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """The llama3 rope settings whose divisors are ``factors`` (a rope_freqs tensor).

    Between the two flat regions a divisor is ``1 / ((1 - s) / factor + s)`` with
    ``s = (orig / wavelen - low) / (high - low)``, linear in ``1 / wavelen``: a line fit through the
    smooth region gives its slope and intercept, and every (orig, low, high) with those two gives the
    same frequencies, so ``low = 1`` is taken. With fewer than two smooth points, Llama 3.1's
    settings (low 1, high 4, original context 8192) are tried. The result is checked against
    ``factors``."""
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return {"rope_type": "default"}
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if smooth.sum() >= 2:
        s = (1.0 / factors[smooth] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv_freq[smooth] / (2 * math.pi), s, 1)
        orig = -slope / intercept
        scaling["high_freq_factor"] = round(float(1.0 - 1.0 / intercept), 4)
        scaling["original_max_position_embeddings"] = int(round(orig)) if abs(orig - round(orig)) < 1e-2 * orig \
            else float(orig)
    if factors.shape != (head_dim // 2,) or not np.allclose(
            llama3_rope_factors(theta, head_dim, scaling), factors, rtol=1e-3):
        raise ValueError(f"GGUF tensor {ROPE_FREQS!r} holds rope frequency divisors that match no llama3 rope "
                         f"scaling (closest: {scaling})")
    return scaling


def _rope_parameters(meta: dict[str, Any], arch: str, reader: Any, head_dim: int) -> dict[str, Any]:
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if scaling not in ("none", "llama3"):
            raise ValueError(f"GGUF rope scaling {scaling!r} together with a {ROPE_FREQS!r} tensor is not supported")
        return {"rope_theta": theta, **_llama3_rope(np.asarray(freqs.data, dtype=np.float64), theta, head_dim)}
    if scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported; supported: none, linear, llama3")


def _file_dtype(meta: dict[str, Any]) -> str:
    """The dtype an ``auto`` engine on a GPU runs in: the file's float type, bfloat16 for quantized
    files (their dequantized values are float32 and are served in half precision)."""
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(int(meta.get("general.file_type", -1)), "bfloat16")


def gguf_hf_config(path: Path) -> Any:
    """A transformers config (LlamaConfig / Qwen2Config / Qwen3Config) built from the file's metadata:
    sizes, heads, rope, norm epsilon, tied embeddings, vocabulary and special token ids. Raises naming
    an unsupported architecture or tensor type."""
    import transformers

    reader = _reader(str(path))
    meta = _metadata(reader)
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} ({path.name}) is not supported; supported: {sorted(GGUF_ARCHITECTURES)}")
    check_tensor_types(reader)

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{name} is missing from {path.name}")
        if isinstance(value, list):
            raise ValueError(f"GGUF metadata {arch}.{name} varies per layer ({value[:4]}...); plait needs one value")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count {rope_dim} != head dim {head_dim}: partial rotary "
                         "embeddings are not supported")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{path.name} has no token_embd.weight tensor")
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if k in meta]
    values: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "vocab_size": _hf_shape(names["token_embd.weight"])[0],
        "tie_word_embeddings": "output.weight" not in names,
        "rope_parameters": _rope_parameters(meta, arch, reader, head_dim),
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
        "eos_token_id": list(dict.fromkeys(eos)) or None,
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]) if "tokenizer.ggml.padding_token_id" in meta
        else None,
        "dtype": _file_dtype(meta),
    }
    if arch == "qwen2":
        values["use_sliding_window"] = False
    if arch == "qwen3":
        values["use_sliding_window"] = False
        values["attention_bias"] = "blk.0.attn_q.bias" in names
    config = getattr(transformers, _CONFIG_CLASSES[arch])(**values)
    config.architectures = [GGUF_ARCHITECTURES[arch]]
    return config


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor; raises for a tensor plait has no place for."""
    if m := _LAYER_NAME.match(gguf_name):
        layer, part, leaf = m.groups()
        if part in LAYER_TENSORS:
            return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{leaf}"
    elif (m := _GLOBAL_NAME.match(gguf_name)) and m.group(1) in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in plait's Llama/Qwen2/Qwen3 models")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k (``num_heads``: the query heads for
    attn_q, the KV heads for attn_k). llama.cpp reorders each head's rows from
    ``[pair half 0 (d/2 rows), pair half 1 (d/2 rows)]`` to interleaved pairs; weights and biases alike."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor: Any) -> np.ndarray:
    """One GGUF tensor as float32 in its Hugging Face shape (dequantized if quantized)."""
    import gguf

    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not values.flags.writeable:
        values = values.copy()  # F32 tensors are views of the read-only memory map
    return values.reshape(_hf_shape(tensor))


def iter_gguf_weights(path: str | Path, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight of the file, one tensor at a time, with
    Llama's q/k permutation undone."""
    reader = _reader(str(path))
    check_tensor_types(reader)
    arch = str(reader.fields["general.architecture"].contents())
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue  # folded into hf_config's rope_parameters
        name = hf_tensor_name(t.name)
        values = dequantized(t)
        if arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            heads = hf_config.num_attention_heads if ".q_proj." in name else hf_config.num_key_value_heads
            values = unpermute_qk(values, heads)
        yield name, torch.from_numpy(np.ascontiguousarray(values))


def load_gguf_tokenizer(path: Path, cache_dir: Path | None = None) -> Any:
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the file's metadata.

    transformers builds it from the file (seconds: it parses the whole vocabulary). With ``cache_dir``
    the result is saved there once (``build_in_place``), under a key of the file's path, size and
    mtime, and later starts load the saved copy."""
    from transformers import AutoTokenizer

    if cache_dir is None:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / f"{path.stem}-{key}"
    if not (target / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        build_in_place(target, lambda d: tokenizer.save_pretrained(str(d)), "tokenizer_config.json")
        return tokenizer
    return AutoTokenizer.from_pretrained(str(target))
