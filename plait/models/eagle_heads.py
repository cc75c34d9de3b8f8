"""Random-weight EAGLE / EAGLE3 draft heads in the public checkpoint formats, for tests.

``eagle_head_manifest`` is the format: tensor name -> shape (and dtype for the EAGLE3 maps), as
SGLang's loaders and the EAGLE repository read them; ``make_eagle_head`` writes a directory with
``config.json`` and either ``model.safetensors`` or ``pytorch_model.bin`` (public heads ship both).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch


def _target_config(target_dir: str | pathlib.Path) -> dict[str, Any]:
    return json.loads((pathlib.Path(target_dir) / "config.json").read_text())


def eagle_head_manifest(fmt: str, cfg: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    f32 = torch.float32
    if fmt == "EAGLE":
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"fc.weight": ((h, 2 * h), f32), "fc.bias": ((h,), f32)}
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            out.update({
                p + "self_attn.q_proj.weight": ((nh * hd, h), f32), p + "self_attn.k_proj.weight": ((nkv * hd, h), f32),
                p + "self_attn.v_proj.weight": ((nkv * hd, h), f32), p + "self_attn.o_proj.weight": ((h, nh * hd), f32),
                p + "mlp.gate_proj.weight": ((inter, h), f32), p + "mlp.up_proj.weight": ((inter, h), f32),
                p + "mlp.down_proj.weight": ((h, inter), f32), p + "post_attention_layernorm.weight": ((h,), f32),
            })
            if i > 0:
                out[p + "input_layernorm.weight"] = ((h,), f32)
        return out
    if fmt == "EAGLE3":
        dv, v = cfg["draft_vocab_size"], cfg["vocab_size"]
        th = cfg.get("target_hidden_size") or h
        p = "midlayer."
        return {
            "fc.weight": ((h, 3 * th), f32),
            p + "self_attn.q_proj.weight": ((nh * hd, 2 * h), f32),
            p + "self_attn.k_proj.weight": ((nkv * hd, 2 * h), f32),
            p + "self_attn.v_proj.weight": ((nkv * hd, 2 * h), f32),
            p + "self_attn.o_proj.weight": ((h, nh * hd), f32),
            p + "mlp.gate_proj.weight": ((inter, h), f32), p + "mlp.up_proj.weight": ((inter, h), f32),
            p + "mlp.down_proj.weight": ((h, inter), f32),
            p + "input_layernorm.weight": ((h,), f32), p + "hidden_norm.weight": ((h,), f32),
            p + "post_attention_layernorm.weight": ((h,), f32),
            "norm.weight": ((h,), f32), "lm_head.weight": ((dv, h), f32),
            "d2t": ((dv,), torch.int64), "t2d": ((v,), torch.bool),
        }
    raise ValueError(f"unknown draft-head format {fmt!r}; EAGLE or EAGLE3")


def make_eagle_head(path: str | pathlib.Path, target_dir: str | pathlib.Path, fmt: str, seed: int = 0,
                    draft_vocab_size: int | None = None, use_bin: bool = False) -> pathlib.Path:
    """Write a random ``fmt`` head for the target checkpoint at ``target_dir``."""
    t = _target_config(target_dir)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "rms_norm_eps", "max_position_embeddings")
    cfg = {k: t[k] for k in keys if k in t}
    cfg["rope_theta"] = t.get("rope_theta", 10000.0)
    cfg["num_hidden_layers"] = 1
    if fmt == "EAGLE":
        cfg.update(architectures=["LlamaForCausalLMEagle"], bias=True)
    else:
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size or t["vocab_size"] // 2,
                   target_hidden_size=t["hidden_size"])
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, _dtype) in eagle_head_manifest(fmt, cfg).items():
        if name == "d2t":
            # Draft id i maps to target id 2 * i: a sparse "hot" subset of the target vocabulary.
            tensors[name] = torch.arange(shape[0], dtype=torch.int64)
        elif name == "t2d":
            m = torch.zeros(shape, dtype=torch.bool)
            m[torch.arange(cfg["draft_vocab_size"]) * 2] = True
            tensors[name] = m
        elif name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = 0.1 * torch.randn(shape, generator=gen)
    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if use_bin:
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out
