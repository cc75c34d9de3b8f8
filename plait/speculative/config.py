"""Validation and defaults of the speculative flags (SGLang's names).

``speculative_num_draft_tokens`` counts the tokens verified per request per step *including the
root* (the last accepted token): steps=3, topk=1, draft tokens=4 is a chain of three guesses and a
step gains at most four tokens. Every error names the flag to change, in its command-line spelling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.config import EngineConfig

SPECULATIVE_ALGORITHMS: tuple[str, ...] = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
ATTENTION_MODES: tuple[str, ...] = ("prefill", "decode")
DEFAULT_NUM_STEPS = 3
DEFAULT_TOPK = 1


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fail(message: str) -> None:
    raise ValueError(message)


def resolve_speculative(cfg: EngineConfig) -> dict[str, Any]:
    """Validate the speculative fields of ``cfg``; return the defaults to fill in for unset ones."""
    from plait.config import ATTENTION_BACKENDS

    algo = cfg.speculative_algorithm
    if cfg.speculative_attention_mode not in ATTENTION_MODES:
        _fail(f"{_flag('speculative_attention_mode')} must be one of {ATTENTION_MODES}, "
              f"got {cfg.speculative_attention_mode!r}")
    if algo is None:
        for name in ("speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
                     "speculative_num_draft_tokens", "speculative_draft_attention_backend"):
            if getattr(cfg, name) is not None:
                _fail(f"{_flag(name)} is set but speculative decoding is off: set "
                      f"{_flag('speculative_algorithm')} to one of {SPECULATIVE_ALGORITHMS} or drop {_flag(name)}")
        return {}
    if algo not in SPECULATIVE_ALGORITHMS:
        _fail(f"{_flag('speculative_algorithm')} must be one of {SPECULATIVE_ALGORITHMS} (or unset), got {algo!r}")
    if getattr(cfg, "tp_size", 1) > 1:
        # The speculative step runs its forwards from the scheduler's process only.
        _fail(f"{_flag('speculative_algorithm')} is not supported with --tp-size > 1 yet: set --tp-size 1 "
              f"or drop {_flag('speculative_algorithm')}")
    if algo == "NGRAM":
        if cfg.speculative_draft_model_path is not None:
            _fail(f"{_flag('speculative_algorithm')} NGRAM uses no draft model: drop "
                  f"{_flag('speculative_draft_model_path')} or pick STANDALONE")
    elif not cfg.speculative_draft_model_path:
        _fail(f"{_flag('speculative_algorithm')} {algo} needs a draft model: set "
              f"{_flag('speculative_draft_model_path')} to a checkpoint directory")
    backend = cfg.speculative_draft_attention_backend
    if backend is not None and backend not in ATTENTION_BACKENDS:
        _fail(f"{_flag('speculative_draft_attention_backend')} must be one of {ATTENTION_BACKENDS} (or unset), "
              f"got {backend!r}")
    for name in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            _fail(f"{_flag(name)} must be >= 1, got {value}")
    steps = cfg.speculative_num_steps if cfg.speculative_num_steps is not None else DEFAULT_NUM_STEPS
    topk = cfg.speculative_eagle_topk if cfg.speculative_eagle_topk is not None else DEFAULT_TOPK
    # The most nodes a tree of `steps` levels with `topk` new nodes per level can hold, plus the root
    # (SGLang's bound: each step keeps topk branches).
    most = 1 + steps * topk
    draft = cfg.speculative_num_draft_tokens if cfg.speculative_num_draft_tokens is not None else most
    if draft < 2:
        _fail(f"{_flag('speculative_num_draft_tokens')} counts the root too, so it must be >= 2, got {draft}")
    if topk == 1 and draft != steps + 1:
        _fail(f"with {_flag('speculative_eagle_topk')} 1 (a chain) {_flag('speculative_num_draft_tokens')} must be "
              f"{_flag('speculative_num_steps')} + 1 = {steps + 1}, got {draft}: change one of them")
    if draft > most:
        _fail(f"{_flag('speculative_num_draft_tokens')} {draft} exceeds what {steps} steps of topk {topk} can "
              f"propose ({most} with the root): lower it or raise {_flag('speculative_num_steps')} / "
              f"{_flag('speculative_eagle_topk')}")
    lo, hi = cfg.speculative_ngram_min_match_window_size, cfg.speculative_ngram_max_match_window_size
    if not 1 <= lo <= hi:
        _fail(f"{_flag('speculative_ngram_min_match_window_size')} ({lo}) must be >= 1 and <= "
              f"{_flag('speculative_ngram_max_match_window_size')} ({hi})")
    if cfg.speculative_ngram_capacity < 1:
        _fail(f"{_flag('speculative_ngram_capacity')} must be >= 1, got {cfg.speculative_ngram_capacity}")
    return {"speculative_num_steps": steps, "speculative_eagle_topk": topk, "speculative_num_draft_tokens": draft}
