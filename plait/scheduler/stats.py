"""Cumulative scheduler counters. A module of its own, free of torch, because the HTTP process reads
them (inside SchedulerSnapshot) without loading the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BucketCounts:
    """A histogram as plain numbers: ``counts[i]`` observations <= ``bounds[i]`` (not cumulative),
    ``counts[-1]`` the ones above every bound. ``+`` adds two histograms of the same bounds (data
    parallel replicas sum their counters); the empty default is the identity."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = ()

    def __add__(self, other: BucketCounts) -> BucketCounts:
        if not self.counts:
            return other
        if not other.counts:
            return self
        if self.bounds != other.bounds:
            raise ValueError(f"cannot add histograms with different bounds {self.bounds} and {other.bounds}")
        return BucketCounts(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))


@dataclass
class SchedulerStats:
    num_retractions: int = 0
    num_aborts: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    forward_steps: int = 0
    # Requests that plain forwards decoded (one token each; a speculative worker counts its verified
    # request-steps itself): a run's tokens over its request-steps is its tokens per step.
    decode_rows: int = 0
    # Constrained decoding: grammars compiled, requests served from the compiled-grammar cache, and
    # compile times in seconds (sum and histogram).
    grammar_compiles: int = 0
    grammar_compile_failures: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds_sum: float = 0.0
    grammar_compile_seconds: BucketCounts = field(default_factory=BucketCounts)
