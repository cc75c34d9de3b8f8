"""Cumulative scheduler counters. A module of its own, free of torch, because the HTTP process reads
them (inside SchedulerSnapshot) without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_aborts: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    forward_steps: int = 0
