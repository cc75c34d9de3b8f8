"""FP8 test helpers: an independent fp32 simulation of each FP8 scheme on a transformers model,
FP8 checkpoints written in the published layouts, and teacher-forced scoring of a fixed text.

The simulation is written here, apart from plait's quantizers: it quantizes with torch's own
float32 -> float8_e4m3fn conversion and dequantizes in float32.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode

E4M3 = torch.float8_e4m3fn
# Mixtral's expert projections (``...experts.{e}.w1.weight``), quantized like the ``*_proj`` ones.
MIXTRAL_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
E4M3_MAX = 448.0

# A fixed English text (public-domain style prose written for these tests): a few hundred tokens.
ENGLISH_TEXT = (
    "The river that runs through the old town is not wide, but it is deep and cold, and in the spring it "
    "carries the melted snow down from the mountains to the sea. For hundreds of years the people who lived "
    "along its banks built mills and bridges, and they learned to read the colour of the water the way "
    "sailors read the sky. When the water turned brown and fast, they moved their animals to higher ground; "
    "when it ran clear and slow, they fished from the stone steps below the church. The town grew slowly. "
    "A market opened in the square every Saturday, where farmers sold cheese, bread, apples and wool, and "
    "travellers stopped to rest their horses before crossing the pass. In the nineteenth century a railway "
    "line reached the valley, and with it came a school, a small hospital and a newspaper that was printed "
    "twice a week. Children who had never seen a city could now buy a ticket and be there by evening. Many "
    "of them left and did not come back, but others returned with new ideas about farming, medicine and "
    "trade. Today the mills are museums, and the bridges carry cars instead of carts, yet the river is "
    "still the first thing that visitors notice. They stand on the bridge in the morning light, listen to "
    "the water moving over the stones, and understand why the town was built exactly where it is."
)


# --- the simulation ------------------------------------------------------------------------------
def qdq_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-row (last dim) symmetric e4m3 quantize-dequantize, fp32."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (xf / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * s


def qdq_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """Per row and ``group`` consecutive columns (the last group may be short)."""
    parts = [qdq_rows(c) for c in x.float().split(group, dim=-1)]
    return torch.cat(parts, dim=-1)


def block_quantize(w: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Published block layout: e4m3 ``q [N, K]`` and multipliers ``s [ceil(N/bn), ceil(K/bk)]``."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    s = torch.empty(nb, kb)
    q = torch.empty(n, k, dtype=E4M3)
    for i in range(nb):
        for j in range(kb):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            sc = max(float(tile.abs().max()) / E4M3_MAX, 1e-12)
            s[i, j] = sc
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / sc).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, s


def block_dequantize(q: torch.Tensor, s: torch.Tensor, bn: int = 128, bk: int = 128) -> torch.Tensor:
    n, k = q.shape
    return q.float() * s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def tensor_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.float().abs().max() / E4M3_MAX).clamp(min=1e-12)
    return (w.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s.reshape(1)


def is_quantized_linear(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and not name.endswith("lm_head")


def hf_simulation(path: pathlib.Path, scheme: str | None, activations: bool = True,
                  input_scales: dict[str, float] | None = None) -> nn.Module:
    """transformers in fp32 with every linear layer but the LM head run as ``scheme`` would: weights
    quantize-dequantized (``channel`` / ``block`` / ``tensor``, or ``dequantized`` for a checkpoint
    already holding FP8: its own dequantized weights), activations per token (channel), per token
    and 128 columns (block) or with a static scale (``input_scales``: module name -> scale)."""
    import copy

    from tests.conftest import hf_model

    # A copy of the session's fp32 model of ``path`` (loaded once): the simulation edits its weights.
    model = copy.deepcopy(hf_model(path))
    for name, mod in model.named_modules():
        if not is_quantized_linear(name, mod) or scheme is None:
            continue
        w = mod.weight.data
        if scheme == "channel":
            mod.weight.data = qdq_rows(w)
        elif scheme == "block":
            mod.weight.data = block_dequantize(*block_quantize(w))
        elif scheme == "tensor":
            q, s = tensor_quantize(w)
            mod.weight.data = q.float() * s
        if not activations:
            continue
        if input_scales is not None:
            sc = input_scales[name]
            mod.register_forward_pre_hook(
                lambda m, args, sc=sc: ((args[0] / sc).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float() * sc,))
        elif scheme == "block":
            mod.register_forward_pre_hook(lambda m, args: (qdq_groups(args[0]),))
        else:
            mod.register_forward_pre_hook(lambda m, args: (qdq_rows(args[0]),))
    return model


def fp8_kv_cache(kv_dtype: torch.dtype = E4M3):
    """A transformers cache that stores K/V in ``kv_dtype`` (scale 1, saturated) and hands attention
    the stored values back in fp32: every position, the current ones included, as plait's FP8 pool
    does."""
    from transformers import DynamicCache

    fmax = torch.finfo(kv_dtype).max

    def rt(t: torch.Tensor) -> torch.Tensor:
        return t.float().clamp(-fmax, fmax).to(kv_dtype).float()

    class Fp8SimCache(DynamicCache):
        def update(self, key_states, value_states, *args, **kwargs):  # type: ignore[override]
            return super().update(rt(key_states), rt(value_states), *args, **kwargs)

    return Fp8SimCache()


@torch.inference_mode()
def hf_teacher_forced(model: nn.Module, ids: list[int], chunk: int | None = None,
                      kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` (fp32) of each position, the text fed ``chunk`` tokens at a time;
    ``kv_dtype`` (fp8): attention reads K/V stored in that dtype (``fp8_kv_cache``)."""
    from transformers import DynamicCache

    chunk = chunk or len(ids)
    cache = DynamicCache() if kv_dtype is None else fp8_kv_cache(kv_dtype)
    out = []
    for start in range(0, len(ids), chunk):
        piece = torch.tensor([ids[start : start + chunk]])
        res = model(piece, past_key_values=cache, use_cache=True)
        out.append(res.logits[0].float())
    return torch.cat(out)


# --- plait teacher-forced scoring ----------------------------------------------------------------
@torch.inference_mode()
def plait_teacher_forced(engine, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits of each position through ``engine``'s own model, KV pool and attention backend, the
    text in extend chunks of ``chunk`` tokens (each chunk attends to the earlier ones through the
    cache). The LM head is applied to every position here (the engine computes sampled rows only)."""
    runner = engine.runner
    chunk = chunk or len(ids)
    row = runner.req_to_token_pool.alloc()
    slots = runner.allocator.alloc(len(ids))
    assert row is not None and slots is not None
    dev = runner.req_to_token_pool.req_to_token.device
    runner.req_to_token_pool.write(row, 0, slots)
    out = []
    try:
        for start in range(0, len(ids), chunk):
            e = min(chunk, len(ids) - start)
            fb = ForwardBatch(
                forward_mode=ForwardMode.EXTEND, batch_size=1,
                input_ids=torch.tensor(ids[start : start + e], device=dev),
                req_pool_indices=torch.tensor([row], device=dev), seq_lens=torch.tensor([start + e], device=dev),
                out_cache_loc=slots[start : start + e], positions=torch.arange(start, start + e, device=dev),
                seq_lens_cpu=[start + e], seq_lens_sum=start + e,
                extend=ExtendInfo(num_tokens=e, seq_lens=torch.tensor([e], device=dev),
                                  prefix_lens=torch.tensor([start], device=dev),
                                  start_loc=torch.tensor([0], device=dev), seq_lens_cpu=[e], prefix_lens_cpu=[start]))
            fb.attn_backend = runner.attn_backend
            runner.attn_backend.init_forward_metadata(fb)
            hidden = runner.model.model(fb.input_ids, fb.positions, fb)
            out.append(hidden.float() @ runner.model.lm_head_weight.float().t())
    finally:
        runner.allocator.free(slots)
        runner.req_to_token_pool.free(row)
    return torch.cat(out)[:, : runner.model_config.vocab_size]


@dataclass
class Agreement:
    top1: float  # fraction of positions whose argmax agrees
    ppl: float  # perplexity of the candidate on the text
    ppl_ref: float

    @property
    def ppl_change(self) -> float:
        return self.ppl / self.ppl_ref - 1.0


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
    return math.exp(float(nll))


def agreement(candidate: torch.Tensor, reference: torch.Tensor, ids: list[int]) -> Agreement:
    top1 = float((candidate[:-1].argmax(-1) == reference[:-1].argmax(-1)).float().mean())
    return Agreement(top1, perplexity(candidate, ids), perplexity(reference, ids))


def decided_agreement(candidate: torch.Tensor, reference: torch.Tensor, margin: float) -> float:
    """Top-1 agreement over the positions whose reference argmax leads its runner-up by at least
    ``margin`` logits (the near-ties left out)."""
    top2 = reference[:-1].topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] >= margin
    same = candidate[:-1].argmax(-1) == reference[:-1].argmax(-1)
    return float(same[decided].float().mean())


# --- FP8 checkpoints in the published layouts ------------------------------------------------------
def write_fp8_checkpoint(src: pathlib.Path, dst: pathlib.Path, layout: str,
                         kv_scales: dict[int, tuple[float, float]] | None = None) -> pathlib.Path:
    """Copy the checkpoint ``src`` to ``dst`` with its linear weights (not the LM head or
    embeddings) stored in FP8:
      ``fp8-block``  quant_method fp8, weight_block_size [128, 128], ``weight_scale_inv``
      ``ct-tensor``  compressed-tensors FP8 (per-tensor ``weight_scale``, static ``input_scale``)
      ``ct-channel`` compressed-tensors FP8_DYNAMIC (``weight_scale [N, 1]``)
      ``ct-block``   compressed-tensors FP8_BLOCK (block ``weight_scale``)
    ``kv_scales``: layer -> (k_scale, v_scale), written as ``self_attn.k_scale`` / ``v_scale``.
    Static input scales are the max |x| / 448 the test's own calibration measured on random ids."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    calib = calibrate_input_scales(src) if layout == "ct-tensor" else {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith("_proj.weight") or MIXTRAL_EXPERT.search(name)) or t.dim() != 2:
            out[name] = t
            continue
        if layout in ("fp8-block", "ct-block"):
            q, s = block_quantize(t)
            out[name] = q
            out[module + (".weight_scale_inv" if layout == "fp8-block" else ".weight_scale")] = s
        elif layout == "ct-channel":
            s = (t.float().abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
            out[name] = (t.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            out[module + ".weight_scale"] = s
        elif layout == "ct-tensor":
            q, s = tensor_quantize(t)
            out[name] = q
            out[module + ".weight_scale"] = s
            out[module + ".input_scale"] = torch.tensor([calib[module]])
        else:
            raise ValueError(layout)
    for layer, (ks, vs) in (kv_scales or {}).items():
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(ks)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(vs)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(layout)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def quantization_config(layout: str) -> dict:
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True}
    if layout == "ct-tensor":
        weights["strategy"] = "tensor"
        acts.update(strategy="tensor", dynamic=False)
    elif layout == "ct-channel":
        weights["strategy"] = "channel"
        acts.update(strategy="token", dynamic=True)
    else:
        weights.update(strategy="block", block_structure=[128, 128])
        acts.update(strategy="group", group_size=128, dynamic=True)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}


@torch.inference_mode()
def calibrate_input_scales(path: pathlib.Path) -> dict[str, float]:
    """max |input| / 448 of each linear layer over a few random prompts (static activation scales)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, mod in model.named_modules():
        if is_quantized_linear(name, mod):
            def hook(m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    g = torch.Generator().manual_seed(0)
    model(torch.randint(3, 400, (2, 16), generator=g))
    for h in hooks:
        h.remove()
    return {k: v / E4M3_MAX for k, v in amax.items()}


def random_fp8_weight(layout: str, n: int, k: int, seed: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    """A random ``[n, k]`` weight (std 0.05) as FP8 ``(q, scale, block)``: ``layout`` "channel" (plait's
    per-row quantizer, block None) or "block" (the published 128 x 128 layout)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if layout == "channel":
        from plait.layers.quantization.fp8_kernels import quantize_weight_per_channel

        q, s = quantize_weight_per_channel(w)
        return q, s, None
    q, s = block_quantize(w)
    return q, s, (128, 128)


def write_dequantized_checkpoint(fp8_dir: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``fp8_dir`` (a ``write_fp8_checkpoint`` checkpoint of a block layout) with every FP8 weight
    replaced by its fp32 dequantization ``q * s`` and no quantization_config: what transformers runs
    as the reference of a block-FP8 checkpoint."""
    shutil.copytree(fp8_dir, dst)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue
        module = name.removesuffix(".weight")
        scale = tensors.get(module + ".weight_scale_inv", tensors.get(module + ".weight_scale"))
        out[name] = block_dequantize(t, scale) if scale is not None else t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def write_online_fp8_simulation(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """``src`` with its weights as ``--quantization fp8`` stores them, dequantized to fp32: the dense
    projections per output row, each layer's experts per 128 x 128 block of the stacked gate|up
    [2I, H] and of down [H, I] (the blocks of the fused expert tensors, which may span gate and up)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = dict(tensors)
    for name, t in tensors.items():
        if not name.endswith("_proj.weight") or ".experts." in name:
            continue
        out[name] = qdq_rows(t)
    for name in [n for n in tensors if ".experts." in n and n.endswith(".gate_proj.weight")]:
        up_name = name.replace(".gate_proj.", ".up_proj.")
        stacked = block_dequantize(*block_quantize(torch.cat([tensors[name], tensors[up_name]])))
        out[name], out[up_name] = stacked.split(tensors[name].shape[0])
        down = name.replace(".gate_proj.", ".down_proj.")
        out[down] = block_dequantize(*block_quantize(tensors[down]))
    save_file({k: v.contiguous() for k, v in out.items()}, str(dst / "model.safetensors"))
    return dst
