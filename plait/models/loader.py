"""Read a checkpoint: a Hugging Face directory (config, dtype, safetensors weights, sharded or not, or
random ``dummy`` weights built from config.json alone) or a GGUF file (plait.models.gguf_loader)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from plait.config import EngineConfig
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.distributed.sharded_load import LazySlice
from plait.layers.moe.fp8 import quantize_moe_layers
from plait.layers.quantization.fp8 import Fp8Config, finish_quantization, quantize_linear_layers, resolve_fp8_config
from plait.models.gguf_loader import find_gguf, gguf_hf_config, iter_gguf_weights, load_gguf_tokenizer
from plait.models.llama import head_dim_of
from plait.models.moe import moe_mlp_params
from plait.models.registry import DEQUANTIZED_AT_LOAD, MODEL_REGISTRY, MOE_CONFIG_FIELDS, supported_architectures
from plait.models.tiny import cache_root

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    context_length: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    eos_token_ids: tuple[int, ...]
    # "safetensors" (a Hugging Face directory; ``path`` is the directory) or "gguf" (``path`` is the file).
    checkpoint_format: str = "safetensors"
    # FP8 linear layers (from the checkpoint's quantization_config, or --quantization fp8); None: dense
    quantization: Fp8Config | None = None

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        return max(1, self.num_kv_heads // tp_size)


def weight_bytes(mc: ModelConfig) -> int:
    """Bytes of a decoder-only model's weights in ``mc.dtype`` (embedding, attention and MLP
    projections, norms, an untied LM head), from its config: for memory budgets, before loading."""
    hf = mc.hf_config
    h, inter = mc.hidden_size, hf.intermediate_size
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 2 * h
    mlp = moe_mlp_params(hf) if getattr(MODEL_REGISTRY.get(mc.architecture), "is_moe", False) else (
        mc.num_layers * 3 * h * inter)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    params = mc.num_layers * per_layer + mlp + mc.vocab_size * h * (1 if tied else 2) + h
    return params * torch.tensor([], dtype=mc.dtype).element_size()


def _checkpoint_dtype(hf_config: Any) -> torch.dtype:
    raw = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    if isinstance(raw, torch.dtype):
        return raw
    return _DTYPES.get(str(raw).replace("torch.", ""), torch.float32)


def resolve_dtype(dtype: str, hf_config: Any, device: str) -> torch.dtype:
    """``auto``: the checkpoint's dtype on a GPU, float32 on the CPU (half precision is slow and
    inexact there)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    return _checkpoint_dtype(hf_config) if device == "cuda" else torch.float32


def _eos_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        for i in [src] if isinstance(src, int) else (src or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _refuse_remote_code(root: Path) -> None:
    """A checkpoint whose architecture plait does not implement and that ships its own modelling code
    (``auto_map``) fails here, naming the architecture: plait never runs a checkpoint's code, with
    ``--trust-remote-code`` or without (read before transformers, which would ask for that flag)."""
    config_file = root / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON ({e}): the checkpoint's config is damaged") from None
    archs = list(raw.get("architectures") or [])
    if raw.get("auto_map") and not any(a in MODEL_REGISTRY for a in archs):
        raise ValueError(
            f"architecture {archs} needs remote code (config.json has auto_map), and plait runs no code from "
            f"checkpoints, even with --trust-remote-code; supported architectures: {supported_architectures()}"
        )


def load_target_config(config: EngineConfig, device: str) -> ModelConfig:
    """The served model's config as ``config`` asks for it (dtype, context, quantization, overrides)."""
    overrides = json.loads(config.json_model_override_args) if config.json_model_override_args else None
    return load_model_config(config.model, config.dtype, device, config.context_length, config.quantization,
                             overrides)


def load_config_tokenizer(config: EngineConfig) -> Any:
    """The served model's tokenizer (``config.tokenizer``, else the model's), or None with
    ``skip_tokenizer_init``: every process of an engine loads it here."""
    return None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)


def with_overrides(hf_config: Any, overrides: Mapping[str, Any]) -> Any:
    """``hf_config`` rebuilt through its class with ``overrides`` replacing its fields, so derived
    fields follow. The rope's legacy keys (``rope_theta``, ``rope_scaling``: what SGLang commands and
    most config.json files use) are folded into transformers' ``rope_parameters``, which would
    otherwise win over them."""
    merged = {**hf_config.to_dict(), **overrides}
    legacy = {"rope_theta", "rope_scaling"} & set(overrides)
    if legacy and merged.get("rope_parameters") is not None and "rope_parameters" not in overrides:
        rope = dict(merged["rope_parameters"])
        if "rope_scaling" in overrides:
            rope = {"rope_theta": rope.get("rope_theta"), **(overrides["rope_scaling"] or {"rope_type": "default"})}
        if "rope_theta" in overrides:
            rope["rope_theta"] = overrides["rope_theta"]
        merged["rope_parameters"] = rope
    return type(hf_config).from_dict(merged)


def load_model_config(path: str, dtype: str = "auto", device: str = "cpu",
                      context_length: int | None = None, quantization: str | None = None,
                      overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """``overrides``: config.json fields replaced before anything reads them (SGLang's
    --json-model-override-args), e.g. ``rope_scaling`` with a larger ``max_position_embeddings``."""
    from transformers import AutoConfig

    gguf_file = find_gguf(path)
    root = gguf_file or Path(path)
    if gguf_file is not None:
        hf_config = gguf_hf_config(gguf_file)
    elif not (root / "config.json").exists():
        raise FileNotFoundError(
            f"{path!r} is not a Hugging Face checkpoint directory (no config.json) nor a GGUF file; pass "
            "--model PATH to a local directory or .gguf file (plait never downloads weights)"
        )
    else:
        _refuse_remote_code(root)
        hf_config = AutoConfig.from_pretrained(root)
    if overrides:
        hf_config = with_overrides(hf_config, overrides)
    archs = list(getattr(hf_config, "architectures", None) or [])
    arch = next((a for a in archs if a in MODEL_REGISTRY), None)
    if arch is None:
        kind = "mixture-of-experts architecture" if any(
            getattr(hf_config, f, None) for f in MOE_CONFIG_FIELDS) else "architecture"
        raise ValueError(f"{kind} {archs} is not supported; supported: {supported_architectures()}")
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else {"quant_method": type(quant).__name__}
    if quant and quant.get("quant_method") in DEQUANTIZED_AT_LOAD.get(arch, ()):
        quant = None  # the architecture's loader dequantizes it (plait.models.registry)
    # FP8 checkpoints, or --quantization fp8; any other format raises, naming it.
    fp8 = resolve_fp8_config(quant, quantization)
    max_ctx = int(hf_config.max_position_embeddings)
    if context_length is not None and context_length > max_ctx:
        raise ValueError(
            f"context_length {context_length} exceeds the model's max_position_embeddings {max_ctx}"
        )
    return ModelConfig(
        path=str(root), hf_config=hf_config, architecture=arch,
        dtype=resolve_dtype(dtype, hf_config, device),
        context_length=context_length or max_ctx,
        vocab_size=int(hf_config.vocab_size),
        num_layers=int(hf_config.num_hidden_layers),
        num_heads=int(hf_config.num_attention_heads),
        num_kv_heads=int(hf_config.num_key_value_heads),
        head_dim=head_dim_of(hf_config),
        hidden_size=int(hf_config.hidden_size),
        eos_token_ids=_eos_ids(root.parent if gguf_file else root, hf_config),
        checkpoint_format="gguf" if gguf_file else "safetensors",
        quantization=fp8,
    )


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a checkpoint directory, or the one stored in a GGUF file's metadata (``path``
    the file or a directory holding it)."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf_tokenizer(gguf_file, cache_root() / "gguf-tokenizers")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"no usable tokenizer in {path!r} (tokenizer.json, or tokenizer_config.json with its "
                         f"vocabulary files): pass --tokenizer DIR; transformers said: {str(e).splitlines()[0]}"
                         ) from None


def iter_safetensors(path: str, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of every safetensors file. ``lazy`` (tensor parallelism) yields
    ``LazySlice`` stand-ins that read only the slice a weight loader asks for, while the file is open
    (consume each before advancing)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}; use load_format='dummy' for random weights")
    for name in files:
        try:
            handle = safe_open(str(root / name), framework="pt")
        except Exception as e:  # SafetensorError is not importable from the package's public names
            raise ValueError(f"{root / name} is not a readable safetensors file ({e}): the checkpoint is damaged "
                             "or incomplete") from None
        with handle as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, (LazySlice(f.get_slice(key)) if lazy else f.get_tensor(key))  # type: ignore[misc]


def dummy_checkpoint(mc: ModelConfig, device: torch.device | str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random checkpoint tensors of a realistic scale (activations neither vanish nor explode), under
    the Hugging Face names and full shapes of ``mc``'s architecture, drawn one at a time on ``device``.

    Each tensor depends only on its name, its full shape and ``seed``: sharded engines load them
    through the model's own loader like a real checkpoint, so a tp_size=2 engine holds the same model
    as one GPU (drawing each rank's shard directly gave every rank other numbers)."""
    import zlib

    import transformers

    with torch.device("meta"):  # names and full shapes only: no memory, no init
        reference = transformers.AutoModelForCausalLM.from_config(mc.hf_config)
    for name, p in reference.named_parameters():
        if name.endswith("norm.weight"):
            yield name, torch.ones(p.shape, dtype=mc.dtype, device=device)
            continue
        gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        fan_in = p.shape[-1] if p.dim() > 1 else 1
        scale = 1.0 if "embed_tokens" in name else fan_in**-0.5
        yield name, torch.empty(p.shape, dtype=mc.dtype, device=device).uniform_(-scale, scale, generator=gen)


def _checkpoint_weights(mc: ModelConfig, load_format: str, lazy: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors for ``load_format``: ``auto`` reads what the path holds, ``gguf`` and
    ``safetensors`` insist on it."""
    if load_format not in ("auto", mc.checkpoint_format):
        raise ValueError(f"load_format {load_format!r} does not match {mc.path!r}, a {mc.checkpoint_format} "
                         f"checkpoint: use load_format 'auto' or {mc.checkpoint_format!r}")
    if mc.checkpoint_format == "gguf":
        return iter_gguf_weights(mc.path, mc.hf_config)
    return iter_safetensors(mc.path, lazy=lazy)


def load_full_tensors(mc: ModelConfig, names: set[str], load_format: str, seed: int,
                      device: torch.device | str) -> dict[str, torch.Tensor]:
    """The named checkpoint tensors whole (not sharded), in the model dtype: for a part of the model
    that one rank runs by itself while the rest is sharded (a speculative head's embedding and LM
    head under tensor parallelism). Dummy weights are the same draws ``load_model`` shards."""
    source = (dummy_checkpoint(mc, device, seed) if load_format == "dummy"
              else _checkpoint_weights(mc, load_format, lazy=True))
    found: dict[str, torch.Tensor] = {}
    for name, tensor in source:
        if name in names:
            full = tensor.materialize() if isinstance(tensor, LazySlice) else tensor
            found[name] = full.to(device=device, dtype=mc.dtype)
    return found


def load_model(mc: ModelConfig, device: str, load_format: str = "auto", tp: TPGroup = SINGLE,
               seed: int = 0, attn_tp: TPGroup | None = None, ep_size: int = 1,
               moe_a2a_backend: str = "none") -> nn.Module:
    """``ep_size``: expert parallelism over ``tp``'s ranks and ``moe_a2a_backend`` its dispatch
    (mixture-of-experts models only)."""
    cls = MODEL_REGISTRY[mc.architecture]
    weights = None if load_format == "dummy" else _checkpoint_weights(mc, load_format, lazy=tp.size > 1)
    moe_kwargs: dict[str, int | str] = {}
    if ep_size > 1:
        if not getattr(cls, "is_moe", False):
            raise ValueError(f"ep_size {ep_size} needs a mixture-of-experts model; {mc.architecture} is dense "
                             "(use ep_size 1)")
        moe_kwargs["ep_size"] = ep_size
    if moe_a2a_backend != "none":
        moe_kwargs["moe_a2a_backend"] = moe_a2a_backend
    # Build in place on the device with the model dtype as default: weights are torch.empty (no init
    # cost); the rotary cache asks for float32 explicitly and stays float32.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(mc.dtype)
    try:
        with torch.device(device):
            model = cls(mc.hf_config, tp, attn_tp=attn_tp, **moe_kwargs)
        quantized = (quantize_linear_layers(model, mc.quantization, getattr(cls, "packed_modules_mapping", {}))
                     if mc.quantization is not None else [])
        # Mixture-of-experts layers: their experts in the 128 x 128 block-FP8 layout (serialized or online).
        quantized_experts = quantize_moe_layers(model, mc.quantization) if mc.quantization is not None else []
    finally:
        torch.set_default_dtype(previous)
    if weights is None:
        loaded = model.load_weights(dummy_checkpoint(mc, next(model.parameters()).device, seed))
    else:
        loaded = model.load_weights(weights)
    missing = set(dict(model.named_parameters())) - loaded
    if missing:
        raise ValueError(f"checkpoint {mc.path!r} ({load_format}) lacks weights for {sorted(missing)[:8]}")
    finish_quantization([*quantized, *quantized_experts])
    model.eval()
    return model

