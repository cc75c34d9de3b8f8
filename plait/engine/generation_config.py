"""Sampling defaults from a checkpoint's ``generation_config.json``, as SGLang and vLLM apply them.

A request that leaves a sampling parameter unset samples with the value the model's authors put in
``generation_config.json`` (Qwen3: temperature 0.6, top_p 0.95, top_k 20, ...), so the same request
samples the same way on plait, SGLang and vLLM. Only parameters both read are taken:
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty``. A request's own value
always wins; a ``SamplingParams`` object handed to the offline Engine is used as it is.

Two flags choose the source (``EngineConfig``): SGLang's ``--sampling-defaults {model,openai}``
(default ``model``; ``openai`` ignores the file) and vLLM's ``--generation-config`` (``auto``: the
model directory, the default; ``vllm``: ignore the file; or a directory holding one).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from plait.config import EngineConfig

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (the same names).
DEFAULT_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config_dir(config: EngineConfig) -> Path | None:
    """The directory whose generation_config.json gives the defaults, or None when they are off."""
    if config.sampling_defaults == "openai" or config.generation_config == "vllm":
        return None
    if config.generation_config == "auto":
        return Path(config.model)
    return Path(config.generation_config)


def read_sampling_defaults(directory: Path) -> dict[str, Any]:
    """The sampling fields of ``directory/generation_config.json`` (empty when there is none).
    HF's "off" values (top_k 0, min_p 0, ...) are left out, so they never override plait's."""
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e}); fix it or pass --sampling-defaults openai") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    out: dict[str, Any] = {}
    for name in DEFAULT_FIELDS:
        value = raw.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        if name == "top_k":
            if int(value) <= 0:  # HF: 0 disables top_k
                continue
            value = int(value)
        out[name] = value
    return out


# vLLM's --override-generation-config takes these on top of generation_config.json's fields.
OVERRIDE_FIELDS: tuple[str, ...] = (*DEFAULT_FIELDS, "max_new_tokens", "frequency_penalty", "presence_penalty")


def sampling_defaults(config: EngineConfig) -> dict[str, Any]:
    """What an unset sampling parameter defaults to under ``config`` (empty: plait's own defaults):
    generation_config.json's values, then ``override_generation_config``'s (vLLM's flag) over them."""
    directory = generation_config_dir(config)
    defaults = read_sampling_defaults(directory) if directory is not None else {}
    if defaults:
        logger.info("sampling defaults from %s: %s (a request's own values win; --sampling-defaults openai "
                    "ignores them)", directory / GENERATION_CONFIG_FILE, defaults)
    if config.override_generation_config:
        overrides = json.loads(config.override_generation_config)
        unknown = sorted(set(overrides) - set(OVERRIDE_FIELDS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown field(s) {unknown}; accepted: "
                             f"{', '.join(OVERRIDE_FIELDS)}")
        defaults = {**defaults, **overrides}
    return defaults
