"""Model shapes of the named benchmarks, written as checkpoint directories holding only config.json
and a tokenizer: plait loads them with ``load_format="dummy"`` (random weights on the device)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_parameters": _LLAMA3_ROPE, "bos_token_id": 128000,
        "eos_token_id": 128001, "dtype": "bfloat16", "hidden_act": "silu",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0},
        "bos_token_id": 128000, "eos_token_id": 128001, "dtype": "bfloat16", "hidden_act": "silu",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "bos_token_id": None, "eos_token_id": 151645, "dtype": "bfloat16", "hidden_act": "silu",
        "attention_bias": False,
    },
    # Mixtures of experts (docs/moe.md): random weights of the real shapes.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "bos_token_id": None,
        "eos_token_id": 151645, "dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False,
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "attention_bias": True, "swiglu_limit": 7.0,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
        "bos_token_id": None, "eos_token_id": 200002, "dtype": "bfloat16", "hidden_act": "silu",
    },
}

# CPU smoke runs of the MoE benchmark path (tests/test_bench_moe.py): the two real MoE shapes' layouts
# (routing, sinks, alternating windows, biases) at a tiny size: 2 layers, hidden 64, 8 experts of 32, top 2.
_TINY_MOE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 4096, "max_position_embeddings": 4096, "num_experts_per_tok": 2,
             "eos_token_id": 0}
SHAPES["tiny-qwen3-moe"] = {**SHAPES["qwen3-30b-a3b"], **_TINY_MOE, "intermediate_size": 128,
                            "moe_intermediate_size": 32, "num_experts": 8}
SHAPES["tiny-gpt-oss"] = {**SHAPES["gpt-oss-20b"], **_TINY_MOE, "intermediate_size": 32, "num_local_experts": 8,
                          "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}


def is_moe(shape: str) -> bool:
    c = SHAPES[shape]
    return bool(c.get("num_experts") or c.get("num_local_experts"))


def moe_counts(shape: str) -> dict[str, int]:
    """A MoE shape's MLP: ``experts`` and ``top_k`` per token, ``sparse_layers``, ``per_expert``
    (one expert's weights in one layer, biases included) and ``router`` (per layer)."""
    c = SHAPES[shape]
    h = c["hidden_size"]
    e = c.get("num_experts") or c["num_local_experts"]
    inter = c.get("moe_intermediate_size") or c["intermediate_size"]
    biased = c["model_type"] == "gpt_oss"
    dense_layers = set(c.get("mlp_only_layers") or [])
    step = c.get("decoder_sparse_step") or 1
    sparse = sum(1 for i in range(c["num_hidden_layers"]) if i not in dense_layers and (i + 1) % step == 0)
    return {"experts": e, "top_k": c["num_experts_per_tok"], "sparse_layers": sparse,
            "per_expert": 3 * h * inter + (3 * inter + h if biased else 0), "router": e * h + (e if biased else 0),
            "dense_mlp": 3 * h * c["intermediate_size"]}


def expected_distinct_experts(shape: str, tokens: int) -> float:
    """Experts one layer routes a step's ``tokens`` to, in expectation under uniform routing (the
    dummy weights route close to uniformly): E * (1 - (1 - k/E)^tokens)."""
    m = moe_counts(shape)
    return m["experts"] * (1 - (1 - m["top_k"] / m["experts"]) ** tokens)


def write_shape_dir(root: str | pathlib.Path, shape: str) -> pathlib.Path:
    """config.json of the shape plus the tiny test tokenizer with its vocabulary extended to the
    shape's (prompts are given as token ids; every id the random weights sample decodes to a short
    word, so detokenizing a stream costs what it does with a real checkpoint's tokenizer, where a
    500-token vocabulary would decode almost every id to nothing)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    from plait.models.tiny import save_tokenizer

    path = pathlib.Path(root) / shape
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    save_tokenizer(path, uses_bos=False, cover_vocab=SHAPES[shape]["vocab_size"])
    return path


def param_counts(shape: str) -> dict[str, int]:
    """Parameter counts: ``matmul`` is every weight a forward multiplies by (the LM head included,
    tied or not; the input embedding is a gather and excluded)."""
    c = SHAPES[shape]
    h, i, n_layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = h * (q + 2 * kv) + q * h
    mlp = 3 * h * i
    norms = 2 * h + (2 * hd if c["model_type"] in ("qwen3", "qwen3_moe") else 0)
    per_layer = attn + mlp + norms
    if is_moe(shape):
        # ``layers`` / ``matmul`` count the ACTIVE parameters (what one token multiplies by: top-k
        # experts and the router), the FLOP floor's; ``all_layers`` holds every expert (memory).
        m = moe_counts(shape)
        dense = n_layers - m["sparse_layers"]
        active = attn + norms
        per_layer_active = (n_layers * active + dense * m["dense_mlp"]
                            + m["sparse_layers"] * (m["top_k"] * m["per_expert"] + m["router"])) // n_layers
        every = (n_layers * active + dense * m["dense_mlp"]
                 + m["sparse_layers"] * (m["experts"] * m["per_expert"] + m["router"]))
        embed = head = c["vocab_size"] * h
        return {"embedding": embed, "lm_head": head, "layers": per_layer_active * n_layers, "all_layers": every,
                "dense_matmul": (n_layers * active + dense * m["dense_mlp"] + m["sparse_layers"] * m["router"]
                                 + head + h),
                "matmul": per_layer_active * n_layers + head + h,
                "total": every + embed + (0 if c["tie_word_embeddings"] else head) + h}
    embed = c["vocab_size"] * h
    head = c["vocab_size"] * h
    return {"embedding": embed, "lm_head": head, "layers": per_layer * n_layers,
            "matmul": per_layer * n_layers + head + h,
            "total": per_layer * n_layers + embed + (0 if c["tie_word_embeddings"] else head) + h}


def linear_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each fused linear layer of one decoder layer that runs as a dense GEMM: a MoE shape's
    router in place of the MLP's projections (its experts run in the fused MoE kernels), and those
    only where some layers are dense."""
    c = SHAPES[shape]
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q)}
    mlp = {"gate_up_proj": (2 * c["intermediate_size"], h), "down_proj": (h, c["intermediate_size"])}
    if not is_moe(shape):
        return {**shapes, **mlp}
    counts = moe_counts(shape)
    shapes["router"] = (counts["experts"], h)
    if counts["sparse_layers"] < c["num_hidden_layers"]:
        shapes.update(mlp)
    return shapes


def kv_bytes_per_token(shape: str, dtype_bytes: int = 2) -> int:
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def attention_flops(shape: str, query_len: int, context_len: int) -> float:
    """QK^T and PV for ``query_len`` queries, the j-th seeing ``context_len - query_len + j + 1`` keys."""
    c = SHAPES[shape]
    keys = query_len * (context_len - query_len) + query_len * (query_len + 1) / 2
    return 4.0 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * keys
